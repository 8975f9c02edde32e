"""Multi-process execution on torch.distributed, applied from outside the model (torchtitan style).

    fsdp.py            FSDP2 units (decoder layers, vision blocks, root) for the trainer
    data_parallel.py   the data-parallel placement of scoring and the actor update (prompts dealt over ranks)
    colocated.py       the data-parallel RL step's runtime (`RLStep(..., parallel=data_parallel(...))`): FSDP
                       trainer and reference (`place`), scoring shares, weight sync into the engine's tensors
    fused.py           the fused schedule's per-rank pipeline on a colocated rank
    rollout.py         a colocated rank's rollout backend: prompts dealt over the rollout groups' engines
    rollout_groups.py  which ranks form each tensor-parallel rollout engine (chosen for weight sharing)
    tp.py              tensor-parallel text decoder for rollout (column/row-parallel, vocab-parallel head): a TPPlan
    broadcast.py       trainer -> rollout weight broadcast in buckets
    disaggregated.py   the disaggregated layout: trainer ranks, rollout engines, their groups
    disaggregated_step.py  the RL step in that layout (the baseline): rollout ranks generate, trainer
                       ranks run `RLStep.train`, the weights are broadcast to the rollout ranks
    shared_weights.py  the colocated trainer's FSDP2 shards inside the engine's tensors, and their rebuild
    launch.py          the default process group from torchrun's environment

The commands that check and time these paths end to end live with the benches (rollplex/bench/parallel.py:
`python -m rollplex.bench parallel ...`).
"""

from .broadcast import bucket_plan, receive_weights, send_weights
from .colocated import Colocated, data_parallel
from .data_parallel import DataParallel, DataParallelActor, assign_prompts
from .disaggregated import Disaggregated, DisaggregatedLayout, init_disaggregated
from .disaggregated_step import DisaggregatedStep
from .fsdp import FSDPConfig, apply_fsdp, full_state_dict, full_tensor, sharded_call
from .rollout_groups import best_rollout_groups, new_rollout_group
from .tp import TPConfig, TPPlan, apply_tensor_parallel, shard_state_dict, tensor_parallel_copy

__all__ = [
    "Colocated", "DataParallel", "DataParallelActor", "Disaggregated", "DisaggregatedLayout", "DisaggregatedStep",
    "FSDPConfig", "TPConfig", "TPPlan", "apply_fsdp", "apply_tensor_parallel",
    "assign_prompts", "best_rollout_groups", "bucket_plan", "full_state_dict", "full_tensor",
    "data_parallel", "init_disaggregated", "new_rollout_group", "receive_weights", "send_weights", "shard_state_dict",
    "sharded_call", "tensor_parallel_copy",
]
