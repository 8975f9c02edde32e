"""The colocated trainer's FSDP2 shards live inside the engine's tensors (gloo, spawned ranks): an
optimizer step is visible in the engine's weights with no copy, the rest is rebuilt equal to the
gathered weights, and a padded FSDP2 chunk falls back to a separate shard that the rebuild copies.
The engine decodes the policy itself, or its tensor-parallel copy (then nothing holds the policy whole)."""

import pytest
from parallel_helpers import spawn, tiny_cfg
from shared_weights_worker import tp_worker, worker

from rollplex.models import Qwen25VL


def _expected(world: int, tie: bool) -> dict:
    """Per rank: the parameters whose FSDP2 chunk is unpadded (shared), and the bytes of the others."""
    import torch

    with torch.device("meta"):
        params = dict(Qwen25VL(tiny_cfg(tie)).named_parameters())
    shared, separate = [], []
    for r in range(world):
        names, nbytes = set(), 0
        for n, p in params.items():
            chunk = -(-p.shape[0] // world)
            if min((r + 1) * chunk, p.shape[0]) - min(r * chunk, p.shape[0]) == chunk:
                names.add(n)
            else:
                nbytes += chunk * (p.numel() // p.shape[0]) * 4
        shared.append(names)
        separate.append(nbytes)
    return dict(shared=shared, separate=separate)


@pytest.mark.slow
@pytest.mark.parametrize("world,tie", [
    (1, False),  # one rank: the trainer is the policy, nothing to rebuild
    (2, True),  # every tiny dim is even: all shared; tied embeddings
    (3, False),  # 64 / 3 rows: the last rank's chunks are padded and kept separately
])
def test_trainer_shards_live_in_the_policy(tmp_path, world, tie):
    want = _expected(world, tie)
    if world == 3:
        assert want["shared"][0] and want["separate"][2] > 0  # both kinds occur
    spawn(worker, args=(world, f"file://{tmp_path}/store", tie, want), nprocs=world)


@pytest.mark.slow
@pytest.mark.parametrize("world,tp,tie,best", [
    (2, 2, False, False),  # one engine over both ranks
    (4, 4, True, False),  # tied embeddings; KV heads replicated over the TP ranks (2 of them, TP 4)
    (4, 2, False, True),  # two engines of 2, chosen for sharing: ranks {0, 2} and {1, 3}
])
def test_trainer_shards_live_in_the_tensor_parallel_engine(tmp_path, world, tp, tie, best):
    spawn(tp_worker, args=(world, f"file://{tmp_path}/store", tp, tie, best), nprocs=world)
