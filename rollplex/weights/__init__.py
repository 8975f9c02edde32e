"""Parallelism-aware weight sharing between the training layout and the rollout layout.

A hybrid engine trains with FSDP2 (optionally with training TP) and rolls out with tensor-parallel
decode on the same GPUs. Keeping a second full copy of the actor for rollout wastes memory that the
KV cache needs; most of it is avoidable, because a rank's rollout shard and its training shard often
hold the same elements. The planner finds them and lays the storage out so they exist once:

    layout.py    where each parameter lives: Megatron TP roles (`ParamSpec`), FSDP2's dim-0
                 chunking with padding (or dim-1 for the row-parallel weights), training meshes
                 [rep, fsdp, tp] (`TrainLayout`, optionally with the parameters in blocked storage
                 order), the rollout TP layout
    regions.py   a rank's local tensor as stacked rectangles of the parameter's 2-D matrix
    share.py     per rank and parameter: the largest run of rollout rows stored identically in the
                 training shard (a view, the training shard inside the rollout buffer, or a joint
                 buffer holding both) and the copies that rebuild the rest, source by source
    mapping.py   which rollout slot (group, TP rank) each training rank plays: exact optimum over
                 all permutations (Hungarian) as the bound, node-local candidates to choose from
    planner.py   the whole model: signatures planned once, every rank
    qwen.py      ParamSpecs of Rollplex's Qwen2.5-VL from its config (meta device)
    storage.py   torch: shared buffers, shards, in-process and torch.distributed rebuild
    report.py    bytes shared / rebuilt per rank, memory saved, estimated rebuild time, footprint
    tables.py    the tables of docs/WEIGHT_SHARING.md; `python -m rollplex.weights` prints them

Contract for the engine and the trainer: for every parameter and rank, `ModelPlan.param(name, rank)`
gives the rollout shard (`rollout` region: the TP shard in Megatron order), the training shard
(`train` region, FSDP2-padded), the `Share` (buffer size and both tensors' offsets in it) and the
`Copy` list to run after each optimizer step. `ModelPlan.rollout_groups()` gives the engine's TP
process groups (training ranks in TP-rank order).
"""

from .layout import ParamSpec, Part, RolloutLayout, TrainLayout, runtime_train_layout
from .mapping import Mapping, MappingChoice
from .planner import ModelPlan, engine_mapping, in_place, plan, realised
from .qwen import model_specs, preset_specs
from .report import Links, RankBytes, Summary
from .share import Copy, ParamPlan, Share

__all__ = [
    "engine_mapping", "in_place", "realised",
    "Copy", "Links", "Mapping", "MappingChoice", "ModelPlan", "ParamPlan", "ParamSpec", "Part", "RankBytes",
    "RolloutLayout", "Share", "Summary", "TrainLayout", "model_specs", "plan", "preset_specs", "runtime_train_layout",
]
