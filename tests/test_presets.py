"""Presets are shapes with random weights: loading one warns, naming the preset and how to load real
weights, and the CLIs' --help says so."""

from __future__ import annotations

import logging

import pytest
import torch

from rollplex import presets
from rollplex.tiny import tiny_config

IDS = {"vocab_size": 512, "image_token_id": 510, "video_token_id": 511, "vision_start_token_id": 507,
       "vision_end_token_id": 508, "bos_token_id": 498, "eos_token_id": 500, "pad_token_id": 498}


@pytest.fixture
def small_preset(monkeypatch) -> str:
    """A preset with the tiny model's shapes, so that building it is cheap."""
    monkeypatch.setitem(presets.PRESETS, "qwen2.5-vl-test", tiny_config(IDS))
    return "qwen2.5-vl-test"


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "rollplex.presets"]


def test_random_model_warns(small_preset, caplog):
    with caplog.at_level(logging.WARNING):
        model = presets.random_model(small_preset, "cpu", torch.float32, seed=1)
    assert sum(p.numel() for p in model.parameters()) > 0
    [msg] = _warnings(caplog)
    assert "'qwen2.5-vl-test'" in msg and "RANDOM weights" in msg
    assert "checkpoint directory" in msg and "Hugging Face model id from the local cache" in msg
    again = presets.random_model(small_preset, "cpu", torch.float32, seed=1)  # seeded
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_warning_names_the_released_checkpoint():
    msg = presets.random_weights_warning("Qwen2.5-VL-7B-Instruct")
    assert "--model Qwen/Qwen2.5-VL-7B-Instruct" in msg
    assert "huggingface-cli download Qwen/Qwen2.5-VL-7B-Instruct" in msg
    assert set(presets.HUB_IDS) == set(presets.PRESETS)


def test_server_load_warns(small_preset, caplog):
    from rollplex.server.state import ServerConfig
    from rollplex.system import load_policy

    with caplog.at_level(logging.WARNING):
        path, model, processor = load_policy(ServerConfig(model=small_preset, device="cpu"))
    assert path is None and processor is None and not model.training
    assert len(_warnings(caplog)) == 1


def test_help_says_presets_are_random(capsys):
    from rollplex.demo.train import main as demo_main
    from rollplex.server.__main__ import parser

    text = " ".join(parser().format_help().split())
    assert "preset name (qwen2.5-vl-3b/7b/32b: RANDOM weights, for benchmarks only)" in text
    with pytest.raises(SystemExit):
        demo_main(["--help"])
    demo = " ".join(capsys.readouterr().out.split())
    assert "random weights" in demo and "(default: 300)" in demo and "(default: runs/PROJECT/EXPERIMENT)" in demo
