"""examples/train_grpo.py end to end on the tiny model: an in-process server (real HTTP on loopback),
verl parquet rows, metrics jsonl + reward plot, a checkpoint, and resume from it for one more step;
validation (verl's val-core / val-aux metrics before training, every N steps and at the end); --help."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from rollplex.data import save_rows
from rollplex.tiny import shape_color, write_tiny

ROOT = Path(__file__).resolve().parents[1]


def _driver():
    spec = importlib.util.spec_from_file_location("train_grpo", ROOT / "examples" / "train_grpo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def driver():
    return _driver()


@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")  # rollplex.rl.warmup.format_warmup
def test_driver_trains_saves_and_resumes(tmp_path, driver, capsys):
    tiny = write_tiny(tmp_path / "tiny", seed=1)
    data = save_rows(shape_color.make_rows(12, seed=1), tmp_path / "train.parquet")
    common = ["--model", str(tiny), "--data", str(data), "--device", "cpu", "--rollout-batch-size", "3",
              "--n-samples", "3", "--max-new-tokens", "3", "--lr", "1e-3", "--log-dir", str(tmp_path / "log"),
              "--save-dir", str(tmp_path / "ckpt"), "--save-every", "2", "--format-warmup-steps", "2"]
    out = driver.main(common + ["--steps", "2"])
    assert out["steps"] == 2 and out["checkpoint"].endswith("global_step_2")
    printed = capsys.readouterr()
    assert printed.out.startswith("CPU threads: ")
    # stdout is no terminal here: a line per step, no bar frames
    assert [ln.split(":")[0] for ln in printed.out.splitlines() if ln.startswith("step ")] == ["step 1/2", "step 2/2"]
    assert "\r" not in printed.out + printed.err
    lines = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [m["training/global_step"] for m in lines] == [m["step"] for m in lines] == [1, 2]
    assert not any(k.startswith("val") for k in lines[0])  # no validation without --val-data
    for key in ("critic/score/mean", "actor/pg_loss", "perf/throughput", "timing_s/step", "timing_s/gen"):
        assert all(key in m for m in lines), key
    assert (tmp_path / "log" / "reward.png").stat().st_size > 1000
    ckpt = Path(out["checkpoint"])
    assert (ckpt / "model.safetensors").exists() and (ckpt / "trainer_state.pt").exists()

    # the resumed run trains with Dr.GRPO: the estimator and its aggregation go with each /train_step
    again = driver.main(common + ["--steps", "3", "--resume", str(ckpt), "--adv-estimator", "dr_grpo"])
    assert again["steps"] == 1 and again["final_step"] == 3
    lines = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [m["training/global_step"] for m in lines] == [1, 2, 3]  # appended, step counter restored


def test_driver_validates(tmp_path, driver):
    """--val-data with 2 data sources, 2 samples per prompt at temperature 1, --eval-every 2 over 3 steps:
    validation before step 1 (logged as step 0), after step 2, and after the last step (3)."""
    tiny = write_tiny(tmp_path / "tiny", seed=1)
    data = save_rows(shape_color.make_rows(6, seed=1), tmp_path / "train.parquet")
    val = shape_color.make_rows(4, seed=2, split="test")
    for row in val[2:]:
        row["data_source"] = "colors/other"
    val_path = save_rows(val, tmp_path / "val.jsonl")
    out = driver.main(["--model", str(tiny), "--data", str(data), "--device", "cpu", "--rollout-batch-size", "2",
                       "--n-samples", "2", "--max-new-tokens", "2", "--steps", "3", "--reward", "shape_color",
                       "--val-data", str(val_path), "--eval-every", "2", "--val-n", "2", "--val-temperature", "1.0",
                       "--log-dir", str(tmp_path / "log"), "--logger", "jsonl,console"])
    lines = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3]
    names = {f"{sec}/{src}/reward/{metric}" for src in ("rollplex/shape_color", "colors/other")
             for sec, metric in (("val-core", "mean@2"), ("val-core", "best@2/mean"), ("val-aux", "std@2"),
                                 ("val-aux", "worst@2/mean"))}
    evals = {m["step"]: {k: v for k, v in m.items() if k.startswith("val-")} for m in lines}
    assert {s: set(v) for s, v in evals.items()} == {0: names, 1: set(), 2: names, 3: names}
    assert set(lines[0]) == names | {"step", "timing_s/testing"}  # before training: validation only
    assert all("critic/score/mean" in m for m in lines[1:])
    for s in (0, 2, 3):
        v = {k.split("/reward/")[1]: x for k, x in evals[s].items() if "/shape_color/" in k}
        assert 0 <= v["worst@2/mean"] <= v["mean@2"] <= v["best@2/mean"] <= 1 and 0 <= v["std@2"] <= 0.5
        assert v["mean@2"] * 4 == round(v["mean@2"] * 4)  # 2 prompts x 2 samples of 0/1 rewards
    assert out["val"] == {k: lines[3][k] for k in names | {"timing_s/testing"}}


def test_validation_metrics_follow_verl(driver):
    samples = [("a", 0, {"reward": 1.0, "acc": 1.0}), ("a", 0, {"reward": 0.0, "acc": 0.0}),
               ("a", 1, {"reward": 1.0, "acc": 1.0}), ("a", 1, {"reward": 1.0, "acc": 1.0}),
               ("b", 2, {"reward": 0.5}), ("b", 2, {"reward": 0.25})]
    m = driver.validation_metrics(samples)
    # per prompt, then averaged over prompts; `acc` is the core variable when the reward reports it.
    # best@2 of prompt 0 ({1, 0}): 1 - P(both draws are 0) = 3/4; worst@2: P(both are 1) = 1/4
    assert m == {
        "val-aux/a/reward/mean@2": 0.75, "val-aux/a/reward/std@2": 0.25,
        "val-aux/a/reward/best@2/mean": (0.75 + 1) / 2, "val-aux/a/reward/worst@2/mean": (0.25 + 1) / 2,
        "val-core/a/acc/mean@2": 0.75, "val-aux/a/acc/std@2": 0.25,
        "val-core/a/acc/best@2/mean": (0.75 + 1) / 2, "val-aux/a/acc/worst@2/mean": (0.25 + 1) / 2,
        "val-core/b/reward/mean@2": 0.375, "val-aux/b/reward/std@2": 0.125,
        "val-core/b/reward/best@2/mean": 0.5 * 0.75 + 0.25 * 0.25,
        "val-aux/b/reward/worst@2/mean": 0.25 * 0.75 + 0.5 * 0.25}
    greedy = driver.validation_metrics([("a", 0, {"reward": 1.0}), ("a", 1, {"reward": 0.0})])
    assert greedy == {"val-core/a/reward/mean@1": 0.5}
    assert math.isclose(driver._expected_max([0.0, 1.0, 2.0], 3), (0 * 1 + 1 * 7 + 2 * 19) / 27)


def test_driver_help_shows_defaults(driver, capsys, monkeypatch):
    monkeypatch.setenv("ROLLPLEX_API_KEY", "s3cret-key")
    with pytest.raises(SystemExit) as e:
        driver.parse_args(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for expected in ("--steps STEPS training steps (default: 300)", "(GRPO group size) (default: 16)",
                     "(default: jsonl)", "(default: runs/PROJECT/EXPERIMENT)",
                     "(default: train_grpo-YYYYMMDD-HHMMSS, a new folder per run)",
                     "--eval-every EVAL_EVERY", "(default: 0)", "--val-temperature", "(0: greedy) (default: 0.0)",
                     "(default: $ROLLPLEX_API_KEY)", "random weights: for benchmarks only"):
        assert expected in text, expected
    assert "s3cret-key" not in text and "(default: None)" not in text
    assert driver.parse_args([]).api_key == "s3cret-key"


def test_driver_logger_and_validation_flags(tmp_path, driver, capsys):
    args = driver.parse_args(["--logger", "console", "--logger", "jsonl,tensorboard", "--experiment", "e1"])
    assert args.logger == ["console", "jsonl", "tensorboard"] and args.log_dir == str(Path("runs/rollplex/e1"))
    for bad in (["--logger", "mlflow"], ["--data", "x.jsonl", "--eval-every", "5"], ["--val-n", "0"],
                ["--eval-every", "-1"]):
        with pytest.raises(SystemExit):
            driver.parse_args(bad)
    err = capsys.readouterr().err
    assert "unknown logger 'mlflow'" in err and "--eval-every needs --val-data" in err
    args = driver.parse_args(["--eval-every", "5", "--log-dir", str(tmp_path)])  # the demo task validates on
    val = driver.load_val_dataset(args)                                          # its own held-out rows
    assert len(val) == 64 and Path(args.val_data).name == "shape_color_val.jsonl"
    assert val[0]["images"][0].startswith("data:image/png;base64,") and val[0]["data_source"] == "rollplex/shape_color"


def test_driver_data_helpers(tmp_path, driver):
    args = driver.parse_args(["--log-dir", str(tmp_path)])
    assert args.max_new_tokens == 4 and args.lr == 1e-3 and args.target_reward == 0.8  # the demo's defaults
    rows = driver.load_dataset(args)
    assert len(rows) == 512 and Path(args.data).name == "shape_color_train.jsonl"
    wire = driver.row_to_wire(shape_color.make_rows(1)[0])
    assert wire["images"][0].startswith("data:image/png;base64,") and json.dumps(wire)
    a = driver.batch_indices(10, 3, 4, seed=0)  # positions 12..15: epoch 1
    assert a == driver.batch_indices(10, 3, 4, seed=0) and len(set(driver.batch_indices(10, 0, 10, 0))) == 10


@pytest.mark.slow
def test_readme_recipe_learns(tmp_path, driver):
    """README's "Serve and train over HTTP": `python -m rollplex.server --format-warmup-steps 30`, then
    `python examples/train_grpo.py --server URL` reaches the demo's target reward (0.8) as the in-process
    demo does."""
    from rollplex.server import ServerConfig, serve_in_thread

    srv = serve_in_thread(ServerConfig(device="cpu", format_warmup_steps=30))  # the README's flags
    try:
        out = driver.main(["--server", srv.url, "--steps", "150", "--log-dir", str(tmp_path / "log")])
    finally:
        srv.stop()
    lines = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["actor/lr"] == 1e-3  # the demo's lr, not the server's default
    assert out["steps"] < 150, "the recipe did not reach the target reward"
    assert sum(m["critic/score/mean"] for m in lines[-3:]) / 3 >= 0.8
