"""Checkpoints of the data-parallel RL step (gloo, 2 spawned ranks, the tiny checkpoint): save after a
step, load into a fresh group, and the next step equals the one the saving group took; the HF
directory is the policy (and PPO's critic, gathered from its shards); a checkpoint of another layout is
refused on every rank."""

import pytest
from parallel_helpers import spawn
from parallel_step_worker import checkpoint_worker

from rollplex.rl.config import RLConfig
from rollplex.tiny import shape_color

ROWS = shape_color.make_rows(5, seed=3)


@pytest.mark.slow
# per-rank engines (with PPO's critic, sharded too), or one tensor-parallel engine
@pytest.mark.parametrize("rollout,rl", [("data", dict(adv_estimator="gae", use_kl_loss=False)), ("tensor", {})])
def test_data_parallel_checkpoint_resumes_the_same_run(tmp_path, tiny_dir, rollout, rl):
    cfg = RLConfig(n=4, max_new_tokens=6, lr=1e-4, kl_coef=0.05, micro_batch_prompts=2, temperature=1.0, **rl)
    spawn(checkpoint_worker, args=(2, f"file://{tmp_path}/store", tiny_dir, ROWS, cfg, str(tmp_path / "ck"),
                                      rollout), nprocs=2)
