"""examples/train_grpo.py end to end on the tiny model: an in-process server (real HTTP on loopback),
verl parquet rows, metrics jsonl + reward plot, a checkpoint, and resume from it for one more step."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from rollplex.data import save_rows
from rollplex.demo import shape_color
from rollplex.demo.tiny import write_tiny

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
def test_driver_trains_saves_and_resumes(tmp_path, driver):
    tiny = write_tiny(tmp_path / "tiny", seed=1)
    data = save_rows(shape_color.make_rows(12, seed=1), tmp_path / "train.parquet")
    common = ["--model", str(tiny), "--data", str(data), "--device", "cpu", "--rollout-batch-size", "3",
              "--n-samples", "3", "--max-new-tokens", "3", "--lr", "1e-3", "--log-dir", str(tmp_path / "log"),
              "--save-dir", str(tmp_path / "ckpt"), "--save-every", "2", "--format-warmup-steps", "2"]
    out = driver.main(common + ["--steps", "2"])
    assert out["steps"] == 2 and out["checkpoint"].endswith("global_step_2")
    lines = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [m["training/global_step"] for m in lines] == [1, 2]
    for key in ("critic/score/mean", "actor/pg_loss", "perf/throughput", "timing_s/step", "timing_s/gen"):
        assert all(key in m for m in lines), key
    assert (tmp_path / "log" / "reward.png").stat().st_size > 1000
    ckpt = Path(out["checkpoint"])
    assert (ckpt / "model.safetensors").exists() and (ckpt / "trainer_state.pt").exists()

    again = driver.main(common + ["--steps", "3", "--resume", str(ckpt)])
    assert again["steps"] == 1 and again["final_step"] == 3
    lines = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [m["training/global_step"] for m in lines] == [1, 2, 3]  # appended, step counter restored


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
