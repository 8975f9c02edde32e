"""The rebuild with real collectives: gloo, world sizes 2 and 4, one spawned process per rank."""

import pytest
from parallel_helpers import spawn
from weights_dist_worker import worker
from weights_helpers import tiny_cfg

from rollplex.weights import RolloutLayout, TrainLayout, model_specs


@pytest.mark.slow
@pytest.mark.parametrize("train,roll", [
    (TrainLayout(fsdp=2), RolloutLayout(2)),
    (TrainLayout(tp=2, fsdp=2), RolloutLayout(4, vision_tp=True)),
])
def test_gloo_rebuild_matches_the_gathered_truth(tmp_path, train, roll):
    specs = model_specs(tiny_cfg())
    spawn(worker, args=(train.world, f"file://{tmp_path}/store", specs, train, roll), nprocs=train.world)
