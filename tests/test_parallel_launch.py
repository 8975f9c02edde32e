"""`python -m torch.distributed.run -m rollplex.bench parallel ...` on CPU (gloo): the torchrun entry point
runs the data-parallel update and the tensor-parallel engine and matches one process (--check)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FORWARD_RTOL, STEP_RTOL

from rollplex.parallel.launch import init_from_env

ROOT = Path(__file__).resolve().parent.parent


def _run(nproc: int, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "rollplex.bench", "parallel", *args]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-4000:]
    return res.stdout


def _torchrun(nproc: int, *args: str) -> dict:
    return json.loads(_run(nproc, *args).strip().splitlines()[-1])


@pytest.mark.slow
def test_torchrun_train_matches_one_process(tiny_dir):
    out = _torchrun(2, "train", "--check", "--model", str(tiny_dir), "--prompts", "5", "--steps", "2")
    assert out["world"] == 2 and len(out["step_s"]) == 2
    # up to fp32 summation order (helpers.fp32_rtol; the grad norm is O(1): absolute)
    assert out["check"]["max_rel_grad_diff"] <= STEP_RTOL and out["check"]["grad_norm_diff"] <= STEP_RTOL
    assert out["check"]["max_abs_weight_diff"] <= 2e-4  # two Adam steps of lr 1e-4: see the check's comment


@pytest.mark.slow
def test_torchrun_decode_matches_one_process(tiny_dir):
    out = _torchrun(2, "decode", "--check", "--model", str(tiny_dir), "--temperature", "1.0", "--samples", "2")
    assert out["check"]["tokens_equal"] and out["check"]["max_logprob_diff"] <= FORWARD_RTOL  # O(1): absolute


@pytest.mark.slow
def test_torchrun_disaggregated_steps(tiny_dir):
    # one trainer rank, one 2-rank rollout engine: two whole steps with the weights broadcast after each
    out = _torchrun(3, "disaggregated", "--model", str(tiny_dir), "--train-ranks", "1", "--rollout-tp", "2",
                    "--steps", "2", "--prompts", "3", "--samples", "2", "--new-tokens", "6")
    assert out["layout"] == {"train": 1, "rollout_tp": 2, "replicas": 1}
    assert [r["role"] for r in out["per_rank"]] == ["train", "rollout", "rollout"]
    assert all(r["broadcast_weights"] >= 0 and r["gen"] > 0 for r in out["per_rank"])
    assert out["metrics"]["actor/grad_norm"] > 0


@pytest.mark.slow
def test_torchrun_step_check_and_bench_on_cpu(tiny_dir):
    # the GPU measurement entry with tiny shapes: the check first, then the paths timed warm (one with
    # other FSDP settings)
    copy = "parallel-copy:layers_per_unit=2;reduce_every_pass=false"
    out = _run(1, "step", "--check", "--bench", "--device", "cpu", "--preset", str(tiny_dir), "--prompts", "4",
               "--samples", "2", "--new-tokens", "8", "--image-size", "56", "--text-tokens", "16",
               "--micro-prompts", "2", "--warmup-steps", "1", "--timed-steps", "2",
               "--paths", f"single,parallel,{copy}", "--tol", str(STEP_RTOL))
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    check = next(x for x in lines if x["bench"] == "dp_step_check")
    assert check["passed"] and check["tokens_equal"] and check["max_rel_grad_diff"] <= STEP_RTOL
    steps = [(x["path"], x["step"]) for x in lines if x["bench"] == "dp_step"]
    assert steps == [(p, s) for p in ("single", "parallel", copy) for s in ("warm-up", "timed", "timed")]
    assert all(x["oom_backoff"] is None and not x["checkpointing"] for x in lines if x["bench"] == "dp_step")
    weights = {x["path"]: x["final_weight_max_abs_diff"] for x in lines if x["bench"] == "dp_step_weights"}
    assert weights.keys() == {"parallel", copy} and max(weights.values()) <= 1e-5
    assert "| parallel | timed | 1 |" in out and "parallel step vs one process (median of timed steps)" in out
    assert f"{copy} step vs one process" in out


@pytest.mark.slow
def test_torchrun_step_check_with_tensor_parallel_rollout_groups(tiny_dir):
    # 2 ranks, one 2-rank tensor-parallel engine (its vision tower split too) for the data-parallel paths,
    # both trainer layouts; the reference's prefixes co-scheduled (the sharded reference's as a lockstep sweep)
    out = _run(2, "step", "--check", "--device", "cpu", "--preset", str(tiny_dir), "--check-tokens", "8",
               "--image-size", "56", "--text-tokens", "16", "--rollout-tp", "2", "--vision-tp", "--cosched",
               "--paths", "single,parallel,parallel-copy", "--tol", str(STEP_RTOL))
    check = next(json.loads(x) for x in out.splitlines() if x.startswith('{"bench": "dp_step_check"'))
    assert check["paths"] == ["parallel", "parallel-copy"] and check["passed"] and check["tokens_equal"], check
    assert check["weights_moved"] and check["max_rel_grad_diff"] <= STEP_RTOL, check
    assert all(c["hidden_s"] > 0 for c in check["cosched"].values()), check
    assert [label for label, c in check["cosched"].items() if c["sweep"]] == ["parallel", "parallel-copy"], check


@pytest.mark.slow
def test_torchrun_step_check_and_bench_against_disaggregated(tiny_dir):
    # 2 ranks: colocated over both (rollplex mode with the co-scheduler, and serial mode without), then one
    # trainer rank and one rollout rank; all checked against one process, then timed: the multi-GPU
    # comparison's command shape
    out = _run(2, "step", "--check", "--bench", "--device", "cpu", "--preset", str(tiny_dir), "--check-tokens", "8",
               "--image-size", "56", "--text-tokens", "16", "--prompts", "4", "--samples", "2", "--new-tokens", "8",
               "--micro-prompts", "2", "--warmup-steps", "1", "--timed-steps", "1", "--cosched",
               "--paths", "disaggregated,single,parallel,parallel-serial", "--tol", str(STEP_RTOL))
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    check = next(x for x in lines if x["bench"] == "dp_step_check")
    assert check["paths"] == ["disaggregated", "parallel", "parallel-serial"], check
    assert check["passed"] and check["weights_moved"], check
    assert [label for label, c in check["cosched"].items() if c["sweep"]] == ["parallel"], check
    steps = [(x["path"], x["step"]) for x in lines if x["bench"] == "dp_step"]
    assert steps == [(p, s) for p in ("single", "parallel", "parallel-serial", "disaggregated")
                     for s in ("warm-up", "timed")]
    weights = {x["path"]: x["final_weight_max_abs_diff"] for x in lines if x["bench"] == "dp_step_weights"}
    assert weights.keys() == {"parallel", "parallel-serial", "disaggregated"} and max(weights.values()) <= 1e-5
    assert "colocated (parallel) over disaggregated on the same ranks:" in out
    assert "colocated (parallel) over parallel-serial on the same ranks:" in out


def test_init_from_env_needs_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="torchrun"):
        init_from_env()
