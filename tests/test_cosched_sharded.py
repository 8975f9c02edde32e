"""The co-scheduled prefix of a sharded model: each rank's jobs run as one sweep of gathered units, in
lockstep with the other ranks' but at its own pace (spawned gloo ranks), and compute what the whole
model's `prefix` computes."""

import pytest
from parallel_helpers import spawn
from sharded_prefix_worker import worker


@pytest.mark.slow
@pytest.mark.parametrize("layers_per_unit", [2])
def test_sharded_prefix_sweep_equals_the_whole_models_prefix(tmp_path, layers_per_unit):
    # two cases per run: rank 0 with the vision prompts and rank 1 text-only; rank 1 with no prompt at all
    # (it still issues every gather). Rank 0 issues ahead of rank 1, which then chunks the sweep otherwise
    shares = [[[0, 2, 3], [1, 4]], [[0, 1, 2, 3, 4], []]]
    spawn(worker, args=(2, f"file://{tmp_path}/store", shares, layers_per_unit), nprocs=2)
