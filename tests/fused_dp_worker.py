"""One rank of the data-parallel fused-step test: the phased and the fused step of the same config on
this rank's group (gloo), their metrics, gradients and updated weights compared."""

from __future__ import annotations

import time

import torch.distributed as dist
from helpers import assert_fp32_close, assert_weights_close
from parallel_helpers import init_group
from parallel_step_worker import build, capture_grads

from rollplex.engine import SamplingParams
from rollplex.rl.config import RLConfig
from rollplex.rl.pipeline import GroupPipeline
from rollplex.rl.step import rollout_requests


def _run(rl, rows, lengths) -> tuple[dict, list[dict], dict]:
    """One step on `rows`, prompt i's samples `lengths[i]` tokens long: (metrics, gradients per optimizer
    step, the policy's weights after it)."""
    grads = capture_grads(rl)
    prompts, params, per_prompt = rollout_requests(rl.processor, rows, rl.cfg, rl.step_idx)
    params = [SamplingParams(n=p.n, max_new_tokens=k, seed=p.seed, ignore_eos=True) for p, k in zip(params, lengths)]
    _, m = rl.run(prompts, params, **per_prompt)
    return m, grads, {n: w.clone() for n, w in rl.policy_state().items()}


def _wait_for_first_chunk(monkeypatch_target=GroupPipeline) -> None:
    """The decode loop waits, once this rank's first group is done, until the worker has trained it: fused
    work runs beside the rollout whatever the machine's speed."""
    add = monkeypatch_target.add

    def slow_add(self, i, output):
        add(self, i, output)
        if len(self.order) == 1:
            t0 = time.monotonic()
            while not self.results and self.error is None and time.monotonic() - t0 < 60:
                time.sleep(0.005)

    monkeypatch_target.add = slow_add


def worker(rank: int, world: int, init: str, tiny_dir, rows, lengths, cfg: RLConfig) -> None:
    init_group(rank, world, init)
    try:
        _wait_for_first_chunk()
        phased = _run(build(tiny_dir, cfg, group=dist.group.WORLD), rows, lengths)
        rl = build(tiny_dir, RLConfig(**{**cfg.__dict__, "schedule": "fused"}), group=dist.group.WORLD)
        assert rl.fused_unsupported() is None
        fused = _run(rl, rows, lengths)
        (m1, g1, w1), (m2, g2, w2) = fused, phased
        assert m1["rollplex/fused"] == 1.0 and m1["rollplex/fused_groups"] == len(rows)
        # every rank trained its first group beside its decode; the first mini-batch holds 3 of the 6 groups
        assert world <= m1["rollplex/fused_groups_in_rollout"] <= 3
        for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac",
                  "critic/score/mean", "critic/advantages/mean", "training/rollout_probs_diff_mean"):
            assert_fp32_close(m1[k], m2[k], k, scale=1.0)
        assert len(g1) == len(g2) == cfg.num_updates
        assert any(t.any() for t in g2[0].values())  # the first mini-batch has a gradient to compare
        for a, b in zip(g1, g2):
            for n, t in b.items():
                assert_fp32_close(a[n], t, f"grad {n}")
        for n, t in w2.items():
            assert_weights_close(w1[n], t, f"weight {n}")
    finally:
        dist.destroy_process_group()
