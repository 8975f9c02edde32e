"""How a demo run starts and ends: the CPU threads it picks (and says), the defaults each algorithm brings, the
tiny model of either family, and a clean end on Ctrl-C / SIGTERM with the plot, summary and metrics written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rollplex.demo import train as demo_train
from rollplex.demo.ending import Signals, summary, summary_line
from rollplex.threads import pick_threads
from rollplex.tiny import write_tiny

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--target", "2", "--prompts", "2", "--n", "2", "--warmup-steps", "1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny(tmp_path_factory.mktemp("tiny") / "m", seed=0))


def test_threads_are_picked_and_said(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert pick_threads(None, "cpu", tiny=True)[0] == 1
    assert pick_threads(3, "cpu", tiny=True) == (3, "--threads")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert pick_threads(None, "cpu", tiny=True) == (2, "$OMP_NUM_THREADS")
    assert pick_threads(1, "cpu", tiny=True) == (1, "--threads")
    with pytest.raises(ValueError, match="--threads must be >= 1"):
        pick_threads(0, "cpu", tiny=True)


def _defaults(argv: list[str]) -> dict:
    ap = demo_train.parser()
    _, own = demo_train.config_and_defaults(ap, ap.parse_args(argv))
    return own


def test_each_algorithm_brings_its_defaults_and_flags_win():
    assert _defaults([]) == {}
    assert _defaults(["--adv-estimator", "dr_grpo"]) == {"rl.loss_agg_mode": "seq-mean-token-sum-norm",
                                                         "rl.kl_coef": 0.1, "rl.ppo_mini_batches": 4}
    no_kl = _defaults(["--adv-estimator", "dr_grpo", "--kl-coef", "0"])
    assert no_kl == {"rl.loss_agg_mode": "seq-mean-token-sum-norm", "rl.ppo_mini_batches": 4}
    assert _defaults(["--filter-groups", "--clip-ratio-high", "0.28"]) == {"rl.ppo_mini_batches": 4}
    assert _defaults(["--policy-loss", "gspo"]) == {"rl.ppo_mini_batches": 4}
    assert _defaults(["--policy-loss", "sapo"]) == {}
    # DAPO's overlong buffer gets room past the task's 4 new tokens, unless they are given
    assert _defaults(["--filter-groups", "--overlong-buffer-len", "2", "--ppo-mini-batches", "1"]) == {
        "rl.max_new_tokens": 6}
    assert _defaults(["--overlong-buffer-len", "2", "--max-new-tokens", "4"]) == {}
    for key, value, own in demo_train.RUN_DEFAULTS:  # every entry names a real flag value and real fields
        flag = key.split(".")[-1].replace("_", "-")
        argv = [f"--{flag}"] if value is True else [f"--{flag}", str(value)]
        ap = demo_train.parser()
        cfg, applied = demo_train.config_and_defaults(ap, ap.parse_args(argv))
        assert applied == own or set(own) <= set(applied)
        for k, v in own.items():
            assert getattr(cfg.rl, k.split(".")[-1]) == v


def test_summary_says_how_the_run_ended():
    hist = [{"critic/score/mean": r} for r in (0.2, 0.7, 0.85, 0.9, 0.95)]
    s = summary(hist, 0.8, 3, "target", 12.3, seed=0)
    assert s["reached_at"] == 4 and s["last_mean"] == pytest.approx((0.85 + 0.9 + 0.95) / 3) and s["seed"] == 0
    assert summary_line(s).endswith("reached the target 0.8 at step 4")
    one = summary(hist[:1], 0.8, 3, "Ctrl-C", 1.0)
    assert one["reached_at"] is None and one["last_window"] == 1
    line = summary_line(one)
    assert "(mean of the last step) in 1 steps" in line and line.endswith("not reached: stopped by Ctrl-C")
    assert "before the first step" in summary_line(summary([], 0.8, 3, "SIGTERM", 1.0))


def test_sigterm_raises_keyboard_interrupt_inside_and_not_after():
    with pytest.raises(KeyboardInterrupt):
        with Signals() as sig:
            signal.raise_signal(signal.SIGTERM)
    assert sig.name == "SIGTERM" and sig.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # restored
    with Signals() as sig, sig.ignored():
        signal.raise_signal(signal.SIGINT)  # ignored while the run's files are written


def test_ctrl_c_writes_the_plot_summary_and_metrics_without_a_traceback(tmp_path, tiny):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "rollplex.demo", "--model", tiny, *SMALL, "--steps", "10000",
                             "--log-dir", str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = []
    for line in proc.stdout:  # one line per step: stdout is a pipe
        lines.append(line)
        if line.startswith("step 2/10000: reward "):
            proc.send_signal(signal.SIGINT)
            break
    rest, err = proc.communicate(timeout=300)
    text = "".join(lines) + rest
    assert proc.returncode == 130, text + err
    assert "Traceback" not in text + err and "KeyboardInterrupt" not in err
    s = json.loads((out / "summary.json").read_text())
    assert s["stopped"] == "Ctrl-C" and s["steps"] >= 2 and s["threads"] == 1
    assert len((out / "metrics.jsonl").read_text().splitlines()) == s["steps"]
    assert f"stopped by Ctrl-C after {s['steps']} steps" in text and "not reached: stopped by Ctrl-C" in text
    if (out / "reward.png").exists() or "plot:" in text:
        assert (out / "reward.png").stat().st_size > 1000


def test_the_tiny_qwen3_vl_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ROLLPLEX_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SystemExit):
        demo_train.main(["--model", "x", "--model-family", "qwen3_vl"])
    assert "--model-family picks the embedded tiny model" in capsys.readouterr().err
    demo_train.main(["--model-family", "qwen3_vl", *SMALL, "--steps", "1", "--log-dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    written = tmp_path / "cache" / "tiny-qwen3_vl-seed0"
    assert f"writing the embedded tiny qwen3_vl model (random weights, ~4 MB) to {written}" in out
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["model"] == str(written)
    assert json.loads((written / "config.json").read_text())["model_type"] == "qwen3_vl"


def test_a_fused_run_that_runs_phased_warns(tmp_path, capsys, tiny):
    import torch

    before = torch.get_num_threads()
    demo_train.main(["--model", tiny, *SMALL, "--steps", "1", "--schedule", "fused", "--adv-estimator", "gpg",
                     "--threads", str(before + 1), "--log-dir", str(tmp_path / "run")])
    assert torch.get_num_threads() == before  # the run's threads are its own
    out, err = capsys.readouterr()
    assert f"CPU threads: {before + 1} (--threads)" in out
    assert "warning: schedule='fused' runs phased: adv_estimator='gpg'" in err
    [line] = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(line)["rollplex/fused"] == 0.0


def test_log_mode_on_a_pipe_and_a_zero_width_terminal():
    import fcntl
    import struct
    import termios

    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=False) as tty:
            for cols, lines in ((0, True), (20, True), (80, False)):
                fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, cols, 0, 0))
                assert demo_train.log_mode(tty) is lines, cols
        r, w = os.pipe()
        with open(w, "w") as pipe:
            assert demo_train.log_mode(pipe) is True
        os.close(r)
    finally:
        os.close(master)
        os.close(slave)


def test_a_run_that_fails_a_step_still_writes_its_summary(tmp_path, capsys, tiny):
    """Dynamic sampling that cannot fill a step ends the run with its message (exit 1), after its files."""
    with pytest.raises(SystemExit) as e:
        demo_train.main(["--model", tiny, *SMALL, "--steps", "3", "--filter-groups", "--max-num-gen-batches", "1",
                         "--n", "2", "--prompts", "8", "--log-dir", str(tmp_path / "run")])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "rollplex.demo: step " in err and "dynamic sampling kept" in err
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["stopped"] == "an error" and s["steps"] < 3
