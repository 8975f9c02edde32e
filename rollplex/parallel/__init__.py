"""Multi-process execution on torch.distributed, applied from outside the model (torchtitan style).

    fsdp.py            FSDP2 units (decoder layers, vision blocks, root) for the trainer
    data_parallel.py   the actor update with prompts dealt over data-parallel ranks
"""

from .data_parallel import DataParallel, DataParallelActor, assign_prompts, dp_score
from .fsdp import FSDPConfig, apply_fsdp, full_state_dict, full_tensor, sharded_call

__all__ = [
    "DataParallel", "DataParallelActor", "FSDPConfig", "apply_fsdp", "assign_prompts", "dp_score",
    "full_state_dict", "full_tensor", "sharded_call",
]
