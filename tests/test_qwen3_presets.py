"""Qwen3-VL presets and loading by name: the real shapes (parameter counts of the released 2B / 4B / 8B),
config files that transformers reads, random models of the family, the server's `--model` as a preset or
a checkpoint directory, and the tiny Qwen3-VL served over HTTP (generate with an image, rollout, train)."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
import torch
from server_helpers import IMG, png_b64, wire_rows

from rollplex import presets
from rollplex.engine import EngineConfig
from rollplex.models import ModelConfig, Qwen3VL, Qwen3VLConfig, build_model
from rollplex.rl.config import RLConfig
from rollplex.server import ServerConfig, serve_in_thread
from rollplex.tiny import tiny_qwen3_config, write_tiny

IDS = {"vocab_size": 512, "image_token_id": 510, "video_token_id": 511, "vision_start_token_id": 507,
       "vision_end_token_id": 508, "bos_token_id": 498, "eos_token_id": 500, "pad_token_id": 498}


@pytest.mark.parametrize("name,billions", [("qwen3-vl-2b", 2.13), ("qwen3-vl-4b", 4.44), ("qwen3-vl-8b", 8.77)])
def test_presets_have_the_released_shapes(name, billions):
    cfg = presets.preset(name)
    assert isinstance(cfg, Qwen3VLConfig) and presets.preset(f"Qwen3-VL-{name[-2:].upper()}-Instruct") == cfg
    with torch.device("meta"):
        model = build_model(cfg)
    assert isinstance(model, Qwen3VL)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == billions
    assert f"--model {presets.HUB_IDS[name]}" in presets.random_weights_warning(name)


def test_preset_files_are_transformers_configs(tmp_path):
    from transformers import Qwen3VLConfig as HFConfig

    presets.write_preset_files(tmp_path)
    for name in ("qwen3-vl-2b", "qwen3-vl-4b", "qwen3-vl-8b"):
        d = json.loads((tmp_path / f"{name}.json").read_text())
        hf = HFConfig.from_dict(d)
        assert hf.text_config.head_dim == 128 and hf.vision_config.patch_size == 16
        assert ModelConfig.from_hf(d) == presets.preset(name)
        assert (presets.CONFIG_DIR / f"{name}.json").read_text() == (tmp_path / f"{name}.json").read_text()


def test_random_preset_and_server_load(monkeypatch, caplog):
    from rollplex.system import load_policy

    monkeypatch.setitem(presets.PRESETS, "qwen3-vl-test", tiny_qwen3_config(IDS))
    with caplog.at_level(logging.WARNING):
        path, model, processor = load_policy(ServerConfig(model="qwen3-vl-test", device="cpu"))
    assert path is None and processor is None and isinstance(model, Qwen3VL)
    assert any("RANDOM weights" in r.getMessage() for r in caplog.records)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = write_tiny(tmp_path_factory.mktemp("tiny-qwen3-server"), seed=0, family="qwen3_vl")
    cfg = ServerConfig(model=str(path), device="cpu", rl=RLConfig(n=2, lr=1e-3, kl_coef=0.05, max_new_tokens=4),
                       engine=EngineConfig(max_model_len=256, kv_cache_tokens=8192, max_num_seqs=64))
    srv = serve_in_thread(cfg)
    yield srv
    srv.stop()


def test_server_serves_the_tiny_qwen3(server):
    assert isinstance(server.state.model, Qwen3VL)
    greedy = {"temperature": 0, "max_new_tokens": 4}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        body = {"text": f"{IMG}What color?", "image_data": png_b64(), "sampling_params": greedy, "return_logprob": True}
        a = c.post("/generate", json=body)
        assert a.status_code == 200, a.text
        other = c.post("/generate", json={**body, "image_data": png_b64((40, 70, 220))}).json()
        assert other["meta_info"]["output_token_logprobs"] != a.json()["meta_info"]["output_token_logprobs"]
        ro = c.post("/rollout", json={"prompts": wire_rows(2), "n": 2})
        assert ro.status_code == 200, ro.text
        ro = ro.json()
        before = c.get("/checksum").json()["weights_checksum"]
        m = c.post("/train_step", json={"rollout_id": ro["rollout_id"], "rewards": [1, 0, 0, 1]})
        assert m.status_code == 200, m.text
        assert c.get("/checksum").json()["weights_checksum"] != before


def test_vit_flops_counts_the_qwen3_tower():
    """The benchmarks' FLOP count of a Qwen3-VL tower (two-matrix MLP, full attention, DeepStack mergers)
    equals torch's count of its GEMMs plus the attention's 4 * tokens * frame * hidden per block (which
    the counter does not see in the CPU attention path)."""
    from qwen3_helpers import tiny_qwen3
    from torch.utils.flop_counter import FlopCounterMode

    from rollplex.bench.common import vit_flops

    model, grid = tiny_qwen3(), [(1, 8, 6), (2, 4, 4)]
    n, v = sum(t * h * w for t, h, w in grid), model.cfg.vision
    x = torch.randn(n, v.patch_dim)
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        model.visual(x, grid)
    attn = 4 * n * v.hidden_size * 48 * v.depth  # each patch attends to the largest frame's 48 patches (formula)
    assert vit_flops(model.cfg, grid) == fc.get_total_flops() + attn
