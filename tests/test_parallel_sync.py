"""The disaggregated layout on gloo: trainer ranks (FSDP2) update the actor and broadcast its weights;
every rollout rank's live parameters then equal its (tensor-parallel) shard of the trainer's weights."""

import pytest
import torch
from parallel_helpers import spawn, tiny_cfg
from parallel_sync_worker import worker

from rollplex.parallel import DisaggregatedLayout, bucket_plan


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    # two FSDP trainer ranks, one rollout engine over 2 TP ranks, fp32 on the wire, small buckets
    DisaggregatedLayout(train=2, rollout_tp=2, wire_dtype="float32", bucket_bytes=64 << 10),
    # one trainer rank, two single-rank rollout engines, bf16 on the wire
    DisaggregatedLayout(train=1, rollout_tp=1, replicas=2),
])
def test_rollout_ranks_receive_the_trainers_weights(tmp_path, layout):
    spawn(worker, args=(layout.world, f"file://{tmp_path}/store", layout), nprocs=layout.world)


def test_bucket_plan_and_layout():
    cfg = tiny_cfg()
    one = bucket_plan(cfg, torch.float32, 1 << 40)
    small = bucket_plan(cfg, torch.float32, 64 << 10)
    names = [n for b in one for n in b.names]
    assert len(one) == 1 and [n for b in small for n in b.names] == names and len(small) > 3
    assert all(b.numel * 4 <= 64 << 10 or len(b.names) == 1 for b in small)  # a big tensor travels alone
    assert bucket_plan(cfg, torch.bfloat16, 64 << 10) != small  # half the bytes per element
    lay = DisaggregatedLayout(train=2, rollout_tp=2, replicas=3)
    assert lay.world == 8 and lay.replica_ranks(1) == [4, 5] and lay.rollout_ranks == list(range(2, 8))
    assert [lay.role(r) for r in (0, 1, 2)] == ["train", "train", "rollout"]
    for bad in (dict(train=0), dict(train=1, wire_dtype="int8"), dict(train=1, replicas=0)):
        with pytest.raises(ValueError):
            DisaggregatedLayout(**bad)
