"""The demo's in-process options: the co-scheduler, a frozen vision tower and a trace. That the demo
learns its task (chance to a mean reward >= 0.8) is tests/test_readme.py's run of the command as written."""

import json

import pytest

from rollplex.demo.train import main
from rollplex.tiny import write_tiny


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
