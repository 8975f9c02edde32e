"""The README's main job: GRPO lifts the tiny model's mean reward on the shape-colour task from
chance to >= 0.8 on the CPU (slow: about a minute on two cores)."""

import json

import pytest

from rollplex.demo.train import main
from rollplex.tiny import write_tiny


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


def test_demo_with_cosched_frozen_vision_and_a_trace(tmp_path):
    """The in-process trainer with the co-scheduler, a frozen vision tower and --trace: it runs, logs the
    co-scheduling metrics, and writes the trace (and its PNG when matplotlib is there)."""
    out = tmp_path / "demo"
    model = write_tiny(tmp_path / "tiny", seed=0)
    trace = tmp_path / "trace.json"
    main(["--model", str(model), "--steps", "2", "--target", "2", "--prompts", "4", "--n", "4", "--warmup-steps", "1",
          "--kl-coef", "0.01", "--cosched", "--freeze-vision-tower", "--trace", str(trace), "--out", str(out)])
    history = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(history) == 2 and all("rollplex/prefix_total_s" in h for h in history)
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["name"] == "gen" for e in events if e["ph"] == "X") == 2
    with pytest.raises(SystemExit):
        main(["--model", str(model), "--steps", "1", "--cosched", "--out", str(out)])
