"""The demo without its format warm-up (`--warmup-steps 0`): it trains and says the warm-up is off."""

from __future__ import annotations

import json

from rollplex.demo import train as demo_train
from rollplex.tiny import write_tiny


def test_warmup_line():
    assert demo_train.warmup_line(0, None, 0.0) == "format warm-up: off (--warmup-steps 0)"
    assert demo_train.warmup_line(30, 1.23456, 2.04) == "format warm-up: 30 steps on random letters, loss 1.235 (2.0s)"


def test_demo_runs_without_the_format_warmup(tmp_path, monkeypatch, capsys):
    tiny = str(write_tiny(tmp_path / "m", seed=0))
    monkeypatch.chdir(tmp_path)
    demo_train.main(["--model", tiny, "--steps", "1", "--target", "2", "--prompts", "2", "--n", "2",
                     "--warmup-steps", "0", "--experiment", "nowarm"])
    assert "format warm-up: off" in capsys.readouterr().out
    [line] = (tmp_path / "runs" / "rollplex" / "nowarm" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(line)["step"] == 1
