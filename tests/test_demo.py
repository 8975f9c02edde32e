"""The README's main job: GRPO lifts the tiny model's mean reward on the shape-colour task from
chance to >= 0.8 on the CPU (slow: about a minute on two cores)."""

import json

import pytest

from rollplex.demo.tiny import write_tiny
from rollplex.demo.train import main


@pytest.mark.slow
def test_demo_learns(tmp_path):
    out = tmp_path / "demo"
    model = write_tiny(tmp_path / "tiny", seed=0)  # the checkpoint `python -m rollplex.demo` uses
    main(["--model", str(model), "--steps", "400", "--out", str(out)])
    history = [json.loads(line) for line in open(out / "metrics.jsonl")]
    first = history[0]["critic/score/mean"]
    last = sum(h["critic/score/mean"] for h in history[-3:]) / 3
    assert first < 0.5, "the warmed-up model should start near chance (0.25)"
    assert last >= 0.8, f"mean reward only reached {last:.2f} in {len(history)} steps"
    assert (out / "reward.png").exists()
