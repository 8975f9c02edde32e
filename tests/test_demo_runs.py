"""What a demo run leaves and says: its own folder per run (runs/PROJECT/demo-DATE-TIME, never the last
run's), the reward plot's title, chance and target lines from the data and the run, the CPU cost warning,
and in a log a line per step and the in-step progress."""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import pytest

from rollplex.demo import progress as progress_mod
from rollplex.demo import train as demo_train
from rollplex.loggers import add_arguments, resolve_run_dir, run_name
from rollplex.plots import reward_figure, reward_labels
from rollplex.rl.config import RLConfig
from rollplex.tiny import shape_color, write_tiny

SMALL = ["--steps", "1", "--target", "2", "--prompts", "2", "--n", "2", "--warmup-steps", "1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny(tmp_path_factory.mktemp("tiny") / "m", seed=0))


def test_each_run_gets_its_own_folder(tmp_path, monkeypatch, capsys, tiny):
    """Two runs without --experiment from the same directory: two folders, each with its own metrics, plot and
    summary; under pytest stdout is no terminal, so each step prints one line (and no bar frames)."""
    monkeypatch.chdir(tmp_path)
    demo_train.main(["--model", tiny, *SMALL])
    demo_train.main(["--model", tiny, *SMALL, "--seed", "1"])
    runs = sorted((tmp_path / "runs" / "rollplex").iterdir())
    assert len(runs) == 2 and all(r.name.startswith("demo-") for r in runs)
    for r in runs:
        [line] = (r / "metrics.jsonl").read_text().splitlines()
        assert json.loads(line)["step"] == 1
        if importlib.util.find_spec("matplotlib") is not None:
            assert (r / "reward.png").stat().st_size > 1000
        summary = json.loads((r / "summary.json").read_text())
        assert summary["steps"] == 1 and summary["stopped"] == "steps" and summary["last_window"] == 1
    out = capsys.readouterr().out
    assert "\r" not in out and sum(ln.startswith("step 1/1: reward ") for ln in out.splitlines()) == 2
    assert "(mean of the last step) in 1 steps" in out and "target 2 not reached: the step budget" in out
    assert sum(f"logs: {Path('runs') / 'rollplex' / r.name}," in out for r in runs) == 2


def test_run_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ap = argparse.ArgumentParser()
    add_arguments(ap, experiment="demo")
    now = time.mktime((2026, 12, 3, 10, 5, 7, 0, 0, -1))
    assert run_name("demo", now) == "demo-20261203-100507"
    args = ap.parse_args([])
    assert resolve_run_dir(args, "demo", now) == [] and args.experiment == "demo-20261203-100507"
    assert args.log_dir == str(Path("runs/rollplex/demo-20261203-100507"))
    Path(args.log_dir).mkdir(parents=True)  # a run started in the same second gets the next free name
    args = ap.parse_args([])
    resolve_run_dir(args, "demo", now)
    assert args.experiment == "demo-20261203-100507-2"
    args = ap.parse_args(["--experiment", "colours", "--project", "p"])
    assert resolve_run_dir(args, "demo", now) == [] and args.log_dir == str(Path("runs/p/colours"))
    (tmp_path / "runs/p/colours").mkdir(parents=True)
    (tmp_path / "runs/p/colours/metrics.jsonl").write_text("{}\n")  # an explicit name is kept, its files reported
    args = ap.parse_args(["--experiment", "colours", "--project", "p"])
    assert resolve_run_dir(args, "demo", now) == [str(Path("runs/p/colours/metrics.jsonl"))]
    args = ap.parse_args(["--log-dir", str(tmp_path / "elsewhere")])
    resolve_run_dir(args, "demo", now)
    assert args.experiment == "elsewhere" and args.log_dir == str(tmp_path / "elsewhere")


HISTORY = [{"training/global_step": i, "critic/score/mean": r, "perf/throughput": 100.0 + i}
           for i, r in enumerate([0.2, 0.4, 0.9], start=1)]


def _hlines(ax) -> list[float]:
    return [ln.get_ydata()[0] for ln in ax.get_lines() if len(set(ln.get_ydata())) == 1 and len(ln.get_ydata()) == 2]


def test_reward_plot_title_and_chance_come_from_the_data():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    assert reward_labels([shape_color.DATA_SOURCE] * 3) == ("shape colour: reward", 0.25)
    assert reward_labels(["geo3k", "geo3k"]) == ("geo3k: reward", None)
    assert reward_labels(["geo3k", shape_color.DATA_SOURCE]) == (f"geo3k, {shape_color.DATA_SOURCE}: reward", None)
    assert reward_labels(["a", "b", "c", "d"]) == ("4 data sources: reward", None)
    assert reward_labels([None, None]) == ("mean reward", None)

    fig = reward_figure(HISTORY, *reward_labels(r["data_source"] for r in shape_color.make_rows(4)))
    ax = fig.axes[0]
    assert ax.get_title() == "shape colour: reward" and _hlines(ax) == [0.25]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["reward", "chance (0.25)"]
    plt.close(fig)
    # a run that stops at a target: its line, and the mean of the last 3 steps it stops on
    fig = reward_figure(HISTORY, "shape colour: reward", 0.25, target=0.8, window=3)
    ax = fig.axes[0]
    assert sorted(_hlines(ax)) == [0.25, 0.8]
    curves = {ln.get_label(): list(ln.get_ydata()) for ln in ax.get_lines()}
    assert curves["mean of 3 steps"] == pytest.approx([0.2, 0.3, 0.5])
    plt.close(fig)
    rows = [{"data_source": "geo3k"}] * 4
    fig = reward_figure(HISTORY, *reward_labels(r["data_source"] for r in rows))
    ax = fig.axes[0]
    assert ax.get_title() == "geo3k: reward" and _hlines(ax) == [] and ax.get_legend() is None
    assert [list(ln.get_ydata()) for ln in ax.get_lines()] == [[0.2, 0.4, 0.9]]
    plt.close(fig)


def test_cpu_cost_estimate():
    # Qwen2.5-VL-3B's decoder (3.09e9 parameters), the W3B step: 32 prompts of 352 tokens x 8 x 512
    tokens, flops = progress_mod.step_cost(3_090_000_000, 352, 32, 8, 512)
    assert tokens == 32 * (352 + 8 * 512) and flops == pytest.approx(8 * 3.09e9 * tokens)
    serial_tokens, _ = progress_mod.step_cost(3_090_000_000, 352, 32, 8, 512, mode="serial")
    assert serial_tokens == 32 * 8 * (352 + 512)
    warning = progress_mod.cpu_cost_warning(3_090_000_000, 352, 32, 8, 512, rate=1e11)
    assert warning is not None and "at least 9.8 h per step" in warning and "(100 GFLOP/s)" in warning
    assert progress_mod.cpu_cost_warning(1_000_000, 60, 32, 16, 4, rate=1e11) is None  # the tiny demo: ~0.2 s
    assert progress_mod.cpu_cost_warning(1_000_000, 60, 32, 16, 4) is None  # no measurement needed
    cfg = RLConfig(n=16, micro_batch_prompts=8, micro_batch_samples=32)
    assert progress_mod.expected_passes(cfg, 32) == 4
    assert progress_mod.expected_passes(RLConfig(mode="serial", n=16, micro_batch_samples=32), 32) == 16
    assert progress_mod.expected_passes(RLConfig(n=4, micro_batch_prompts=2, ppo_mini_batches=2), 6) == 4


def test_progress_on_and_the_cost_warning(tmp_path, monkeypatch, capsys, tiny):
    """--progress on without a terminal prints lines (every 5 s; 0 here), from the real engine's decode
    hook and the policy's gradient hook; the cost warning is forced by a zero threshold."""
    monkeypatch.setattr(demo_train, "LOG_EVERY_S", 0.0)
    monkeypatch.setattr(progress_mod, "WARN_STEP_S", 0.0)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the first line names the count and why, whatever the shell set
    demo_train.main(["--model", tiny, *SMALL, "--steps", "2", "--prompts", "3", "--progress", "on",
                     "--log-dir", str(tmp_path / "log")])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "CPU threads: 1 ($OMP_NUM_THREADS)"
    [warning] = [ln for ln in out if ln.startswith("warning: CPU run: one step is about")]
    assert "3 prompts of" in warning
    for step in (1, 2):
        rollout = [ln for ln in out if ln.startswith(f"step {step} rollout: ")]
        tokens = [int(ln.split(": ")[1].split(" tokens")[0].replace(",", "")) for ln in rollout]
        assert rollout and tokens == sorted(tokens) and tokens[-1] <= 3 * 2 * 4
        assert all(ln.endswith("/6 samples done") for ln in rollout)
        # 3 prompts at 8 per micro-batch: one backward pass per update
        assert [ln for ln in out if ln.startswith(f"step {step} update")] == [f"step {step} update: 1/1 micro-batches"]
    assert len((tmp_path / "log" / "metrics.jsonl").read_text().splitlines()) == 2
