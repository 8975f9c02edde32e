"""Real tensors on the CPU: training shards cut by FSDP2's rule, rollout shards materialised from the
plan (shared windows as views of the training storage, the rest rebuilt), compared with Megatron
slicing of the full tensor, before and after an in-place optimizer-like update."""

import pytest
import torch
from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty
from weights_helpers import tiny_cfg

from rollplex.weights import ModelPlan, ParamSpec, RolloutLayout, TrainLayout, model_specs, plan, preset_specs
from rollplex.weights.storage import allocate, cut, matrix, rebuild_local


def megatron_shard(full: torch.Tensor, spec: ParamSpec, tp: int, t: int) -> torch.Tensor:
    """TP rank t's shard by plain slicing (independent of the planner): each fused part chunked on
    its own, KV heads repeated when tp exceeds their count, row-parallel weights chunked on dim 1."""
    if spec.tp_dim is None or tp == 1:
        return matrix(full)
    if spec.tp_dim == 1:
        return torch.chunk(full, tp, dim=1)[t]
    pieces = []
    for part, x in zip(spec.parts, torch.split(full, [p.size for p in spec.parts], dim=0)):
        n = min(tp, part.units)
        pieces.append(torch.chunk(x, n, dim=0)[t * n // tp])
    return matrix(torch.cat(pieces))


def fsdp_shard(local: torch.Tensor, n: int, s: int) -> torch.Tensor:
    """FSDP2's padded shard s of n, as `FSDPParam._init_sharded_param` builds it."""
    chunks = _chunk_with_empty(local, n, dim=0)
    out = local.new_zeros(chunks[0].shape[0], local.shape[1])
    out[: chunks[s].shape[0]] = chunks[s]
    return out


def check_param(p: ModelPlan, spec: ParamSpec, full: torch.Tensor) -> tuple[int, int]:
    """All ranks' tensors of one parameter: cut, rebuild, alias, update in place, rebuild again.
    Returns (ranks sharing, ranks copying)."""
    train, roll = p.train, p.rollout
    tens = [allocate(p.param(spec.name, r), full.dtype) for r in range(p.world)]

    def train_of(k):
        return tens[k].train

    for r, x in enumerate(tens):
        x.train.copy_(cut(full, p.param(spec.name, r).train))
        if train.block == 1:  # the planner's training region is FSDP2's shard of the TP shard
            _, s, u = train.coords(r)
            ttp = train.tp if spec.tower == "text" or train.vision_tp else 1
            assert torch.equal(x.train, fsdp_shard(megatron_shard(full, spec, ttp, u % ttp), train.fsdp, s))
    rtp = roll.tp if spec.tower == "text" or roll.vision_tp else 1
    new = full * -3 + 7
    truth = {(t, k): megatron_shard(f, spec, rtp, t).contiguous() for t in range(rtp) for k, f in (("old", full),
                                                                                                  ("new", new))}
    for r, x in enumerate(tens):
        q, t = p.param(spec.name, r), p.tp_rank(r) % rtp
        rebuild_local(q, x.rollout, train_of)
        assert torch.equal(x.rollout, truth[t, "old"]), (spec.name, r)
        if q.share is not None:  # the shared window's bytes live inside the training shard's storage
            win = x.rollout.view(-1)[q.share.first : q.share.first + q.share.numel]
            lo, hi = x.train.data_ptr(), x.train.data_ptr() + x.train.numel() * x.train.element_size()
            assert lo <= win.data_ptr() and win.data_ptr() + win.numel() * win.element_size() <= hi
            if q.share.is_view:
                assert lo <= x.rollout.data_ptr()
                assert x.rollout.untyped_storage().data_ptr() == x.train.untyped_storage().data_ptr()
    # an optimizer step: in place on every training shard's parameter rows (padding untouched)
    for r, x in enumerate(tens):
        x.train[: p.param(spec.name, r).train.rows].mul_(-3).add_(7)
    n_shared = n_copied = 0
    for r, x in enumerate(tens):
        q, want, got = p.param(spec.name, r), truth[p.tp_rank(r) % rtp, "new"].view(-1), x.rollout.view(-1)
        if q.share is not None:  # visible with no rebuild
            w = slice(q.share.first, q.share.first + q.share.numel)
            assert torch.equal(got[w], want[w])
            n_shared += 1
        if q.copies:  # rebuilt pieces are stale until the rebuild
            assert not torch.equal(got, want)
            n_copied += 1
    for r, x in enumerate(tens):
        rebuild_local(p.param(spec.name, r), x.rollout, train_of)
        assert torch.equal(x.rollout, truth[p.tp_rank(r) % rtp, "new"])
    return n_shared, n_copied


def run_layout(specs, full, train: TrainLayout, roll: RolloutLayout) -> tuple[int, int]:
    p = plan(specs, train, roll, gpus_per_node=4)
    counts = [check_param(p, spec, full[spec.name]) for spec in specs]
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


@pytest.mark.parametrize("train,tp,vision_tp", [
    (TrainLayout(fsdp=6), 2, False),  # uneven, padded shards
    (TrainLayout(fsdp=8), 4, True),  # FSDP > TP
    (TrainLayout(fsdp=8, block=4), 4, True),  # blocked storage order
    (TrainLayout(fsdp=2, rep=4), 4, False),  # FSDP < TP (HSDP)
    (TrainLayout(tp=2, fsdp=3), 2, False),  # training TP x FSDP
    (TrainLayout(tp=4), 2, True),  # training TP above rollout TP
    (TrainLayout(tp=2, fsdp=2, rep=2, block=4, vision_tp=True, block_vision=True), 4, True),
])
def test_tiny_model_rollout_shards_from_the_plan(train, tp, vision_tp):
    specs = model_specs(tiny_cfg())
    g = torch.Generator().manual_seed(0)
    full = {s.name: torch.randn(s.shape, generator=g, dtype=torch.float64) for s in specs}
    n_shared, n_copied = run_layout(specs, full, train, RolloutLayout(tp, vision_tp))
    assert n_shared > 0 and n_copied > 0


@pytest.mark.slow
def test_real_7b_shapes_rollout_shards_from_the_plan():
    names = ["model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.qkv_proj.bias",
             "model.layers.0.self_attn.o_proj.weight", "model.layers.0.input_layernorm.weight"]
    specs = [s for s in preset_specs("qwen2.5-vl-7b") if s.name in names]
    assert len(specs) == len(names)
    # distinct integers: any misplaced element shows
    full = {s.name: torch.arange(s.numel, dtype=torch.int32).reshape(s.shape) for s in specs}
    for train, tp in [(TrainLayout(fsdp=8), 4), (TrainLayout(fsdp=8, block=4), 4), (TrainLayout(tp=4, fsdp=2), 2)]:
        run_layout(specs, full, train, RolloutLayout(tp))
