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

from rollplex.demo.tiny import write_tiny
from rollplex.engine import EngineConfig
from rollplex.rl.config import RLConfig
from rollplex.server import ServerConfig, ServerState, serve_in_thread

ROOT = Path(__file__).resolve().parents[1]
ENGINE = {"max_model_len": 256, "kv_cache_tokens": 4096, "max_num_seqs": 8}
# the tuning-cache keys of every graphed bucket of a server's engine, one digest each (run in a fresh
# process: a restart); `env` stands in for the GPU and software part, which needs CUDA to read
KEYS = """
import json, sys
from rollplex.engine import EngineConfig
from rollplex.engine.model_runner import graph_buckets
from rollplex.kernels.tuning_cache import key_digest
from rollplex.server import ServerConfig, ServerState

state = ServerState(ServerConfig(model=sys.argv[1], device="cpu", engine=EngineConfig(**json.loads(sys.argv[2]))))
env = {"gpu": "stand-in", "kernels": "stand-in"}
print(json.dumps([key_digest(k) for b in graph_buckets(8) for k in state.engine.runner._tuning_keys(b, env)]))
state.close()
"""


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


def _key_digests(tiny_dir) -> list[str]:
    out = subprocess.run([sys.executable, "-c", KEYS, str(tiny_dir), json.dumps(ENGINE)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_restarted_server_asks_the_tuning_cache_for_the_same_keys(tiny_dir):
    """A key part that changed from one process to the next (an address, a profiled size) would make every
    warm start tune again."""
    first, second = _key_digests(tiny_dir), _key_digests(tiny_dir)
    assert first == second and len(set(first)) == len(first) == 2 * 4  # buckets 1, 2, 4, 8: attention + gemms


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
