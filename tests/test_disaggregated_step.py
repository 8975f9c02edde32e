"""The disaggregated RL step (trainer ranks and rollout ranks apart, the weights broadcast after each
update) computes the single-process step: same rollouts, metrics and weights over two steps (gloo, fp32,
the tiny checkpoint), in serial and rollplex mode."""

import pytest
from disaggregated_step_worker import worker
from parallel_helpers import spawn
from parallel_step_worker import build, run_steps

from rollplex.parallel import DisaggregatedLayout
from rollplex.rl.config import RLConfig
from rollplex.tiny import shape_color

ROWS = shape_color.make_rows(5, seed=3)
BASE = dict(n=4, max_new_tokens=6, lr=1e-4, kl_coef=0.05, micro_batch_prompts=2)


@pytest.mark.slow
@pytest.mark.parametrize("layout,mode", [
    (DisaggregatedLayout(train=1, rollout_tp=2, wire_dtype="float32"), "serial"),  # one 2-rank TP engine
    (DisaggregatedLayout(train=2, rollout_tp=1, replicas=2, wire_dtype="float32"), "rollplex"),  # FSDP2 over 2
])
def test_disaggregated_step_equals_single_process(tmp_path, tiny_dir, layout, mode):
    cfg = RLConfig(**BASE, mode=mode)
    want = run_steps(build(tiny_dir, cfg, group=None), ROWS, 2)
    spawn(worker, args=(layout.world, f"file://{tmp_path}/store", tiny_dir, ROWS, cfg, layout, want),
             nprocs=layout.world)
