"""Server startup: its phases are timed, logged and reported by /health, and a restart finds the decode
tuning it stored (CPU: the tuning-cache keys of a restarted server are the same; GPU: a second start on
the same --tuning-cache-dir times nothing).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from rollplex.engine import EngineConfig
from rollplex.rl.config import RLConfig
from rollplex.server import ServerConfig, ServerState, serve_in_thread
from rollplex.tiny import write_tiny

ROOT = Path(__file__).resolve().parents[1]
ENGINE = {"max_model_len": 256, "kv_cache_tokens": 4096, "max_num_seqs": 8}
# a restart: a fresh process builds the same server and prints its key digests
RESTART = """
import json, sys
sys.path.insert(0, "tests")
from test_server_startup import ENGINE, key_digests
from rollplex.engine import EngineConfig
from rollplex.server import ServerConfig, ServerState

state = ServerState(ServerConfig(model=sys.argv[1], device="cpu", engine=EngineConfig(**ENGINE)))
print(json.dumps(key_digests(state)))
state.close()
"""


def key_digests(state: ServerState) -> list[str]:
    """The tuning-cache key digest of every graphed bucket's attention config and projection kernels; the GPU
    and software part of the key (which needs CUDA to read) is a stand-in."""
    from rollplex.engine.model_runner import graph_buckets
    from rollplex.kernels.tuning_cache import key_digest

    env = {"gpu": "stand-in", "kernels": "stand-in"}
    runner = state.engine.runner
    return [key_digest(k) for b in graph_buckets(state.cfg.engine.max_num_seqs) for k in runner._tuning_keys(b, env)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny-startup"), seed=0)


def test_startup_phases_are_logged_and_reported(tiny_dir, caplog):
    with caplog.at_level(logging.INFO, logger="rollplex.server"):
        srv = serve_in_thread(ServerConfig(model=str(tiny_dir), device="cpu", engine=EngineConfig(**ENGINE)))
    try:
        phases = httpx.get(srv.url + "/health", timeout=30).json()["startup_s"]
    finally:
        srv.stop()
    assert list(phases) == ["weights", "kv_sizing", "tuning", "capture", "engine", "trainer", "ready"]
    assert phases["ready"] >= phases["weights"] + phases["engine"] + phases["trainer"] > 0
    assert phases["engine"] >= phases["kv_sizing"] + phases["tuning"] + phases["capture"]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("startup: ")]
    assert [m.split(" in ")[0] for m in lines] == ["startup: weights loaded", "startup: engine", "startup: trainer",
                                                   "startup: ready"]
    assert "decode kernel tuning" in lines[1] and "graph capture" in lines[1]


def test_a_restarted_server_asks_the_tuning_cache_for_the_same_keys(tiny_dir):
    """A key part that changed from one process to the next (an address, a profiled size) would make every
    warm start tune again."""
    state = ServerState(ServerConfig(model=str(tiny_dir), device="cpu", engine=EngineConfig(**ENGINE)))
    try:
        here = key_digests(state)
    finally:
        state.close()
    out = subprocess.run([sys.executable, "-c", RESTART, str(tiny_dir)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here
    assert len(set(here)) == len(here) == 2 * 4  # buckets 1, 2, 4, 8: attention + gemms


def test_a_restarted_server_times_nothing(tiny_dir, tmp_path, monkeypatch, caplog):
    if not torch.cuda.is_available():
        pytest.skip("decode tuning runs before graph capture, on CUDA only")
    from rollplex.engine import model_runner

    engine = EngineConfig(cuda_graph_max_bs=8, max_num_seqs=8, kv_cache_tokens=16384,
                          tuning_cache_dir=str(tmp_path / "tuning"))
    cfg = ServerConfig(model=str(tiny_dir), device="cuda", rl=RLConfig(kl_coef=0.0), engine=engine)
    first = ServerState(cfg)
    tuned = list((tmp_path / "tuning").glob("*.json"))
    first.close()
    del first
    torch.cuda.empty_cache()
    assert len(tuned) == 2 * 4

    def no_timing(*a, **k):
        raise AssertionError("tuned again although the cache holds the result")

    monkeypatch.setattr(model_runner, "tune_decode_gemms", no_timing)
    monkeypatch.setattr(model_runner, "tune_decode", no_timing)
    with caplog.at_level(logging.INFO, logger="rollplex.engine"):
        second = ServerState(cfg)
    try:
        assert "all 8 results from the tuning cache" in caplog.text
        assert second.startup_s["tuning"] < 1.0
    finally:
        second.close()


def test_a_server_that_cannot_fit_its_device_exits_with_the_reason(tiny_dir, caplog):
    """The memory plan's check runs when the server is built: a step too large for the device ends the start
    with the plan's reasons (what it tried, what would be needed), never a failure mid-step."""
    from rollplex.server.__main__ import main

    args = ["--model", str(tiny_dir), "--device", "cpu", "--max-model-len", "256", "--kv-cache-tokens", "4096",
            "--max-num-seqs", "8", "--kl-coef", "0.05", "--device-capacity-gib", "0.001"]
    with caplog.at_level(logging.INFO, logger="rollplex.server"), pytest.raises(SystemExit) as e:
        main(args + ["--no-gradient-checkpointing"])
    msg = str(e.value)
    assert msg.startswith("rollplex.server: the RL step does not fit the device")
    assert "measures taken: reference offloaded, optimizer_offload=moments" in msg
    assert "kept as given: gradient_checkpointing=False" in msg and "peak GiB" in msg
    assert not any(r.getMessage().startswith("startup: ready") for r in caplog.records)
