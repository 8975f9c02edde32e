"""The weight-sharing planner without tensors: layouts, exact cover of every rollout shard, rank
mapping, and what the plans share on tiny and real (7B) shapes."""

import itertools
import random

import pytest
from weights_helpers import check_exact_cover, tiny_cfg

from rollplex.weights import ParamSpec, Part, RolloutLayout, TrainLayout, model_specs, plan, preset_specs
from rollplex.weights.layout import tp_rects
from rollplex.weights.mapping import hungarian, interleavings, placement
from rollplex.weights.regions import Rect, Region, fsdp_chunk
from rollplex.weights.report import Summary
from rollplex.weights.share import find_share
from rollplex.weights.tables import parse_train

LAYOUTS = [  # uneven shards, FSDP > TP, FSDP < TP (HSDP), training TP, 2-D, blocked order
    TrainLayout(fsdp=6), TrainLayout(fsdp=8), TrainLayout(fsdp=8, block=4), TrainLayout(fsdp=2, rep=4),
    TrainLayout(fsdp=2, rep=4, block=4), TrainLayout(tp=2), TrainLayout(tp=4), TrainLayout(tp=2, fsdp=3),
    TrainLayout(tp=2, fsdp=2, rep=2, block=4),
]


@pytest.fixture(scope="module")
def tiny_specs():
    return model_specs(tiny_cfg())


def test_fsdp_chunk_matches_torch_fully_shard_rule():
    import torch
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    for rows, n in [(10, 4), (5, 4), (6, 4), (3, 8), (4608, 32), (6840, 32), (1, 3)]:
        region = Region.of([Rect(0, rows, 0, 1)], 1)
        chunks = _chunk_with_empty(torch.arange(rows), n, dim=0)
        for s in range(n):
            got = fsdp_chunk(region, n, s)
            assert [x for r in got.rects for x in range(r.r0, r.r1)] == chunks[s].tolist()
            assert got.rows + got.pad == chunks[0].numel()  # FSDP2 pads every shard to shard 0's size


def test_tp_rects_follow_megatron_with_kv_replication():
    qkv = ParamSpec("qkv", (4 * 8 + 2 * 2 * 8, 16), 0, (Part(32, 4), Part(16, 2, True), Part(16, 2, True)))
    assert tp_rects(qkv, 2, 1) == [Rect(16, 32, 0, 16), Rect(40, 48, 0, 16), Rect(56, 64, 0, 16)]
    # 4 ranks over 2 KV heads: ranks 2 and 3 both hold KV head 1
    assert tp_rects(qkv, 4, 2)[1:] == tp_rects(qkv, 4, 3)[1:] == [Rect(40, 48, 0, 16), Rect(56, 64, 0, 16)]
    with pytest.raises(ValueError, match="cannot be split"):
        tp_rects(qkv, 8, 0)  # 4 query heads over 8 ranks: query heads are not replicable
    down = ParamSpec("down", (16, 12), 1, (Part(12, 12),))
    assert tp_rects(down, 4, 3) == [Rect(0, 16, 9, 12)]
    with pytest.raises(ValueError):
        ParamSpec("bad", (16, 12), 0, (Part(10, 10),))


def test_specs_cover_every_parameter_of_the_presets():
    for name, n_layers in [("qwen2.5-vl-3b", 36), ("qwen2.5-vl-7b", 28), ("qwen2.5-vl-32b", 64)]:
        specs = preset_specs(name)
        names = {s.name for s in specs}
        assert sum("qkv_proj.weight" in n for n in names) == n_layers
        assert ("lm_head.weight" in names) == (name != "qwen2.5-vl-3b")  # 3B ties the head to the embedding
    with pytest.raises(ValueError, match="layout rules"):
        model_specs(tiny_cfg(), [("model.layers.0.new_proj.weight", (4, 4))])


def test_every_rollout_element_is_covered_exactly_once(tiny_specs):
    for train, tp, vision_tp in itertools.product(LAYOUTS, [1, 2, 4], [False, True]):
        if train.world % tp:
            continue
        p = plan(tiny_specs, train, RolloutLayout(tp, vision_tp), gpus_per_node=4)
        for s in tiny_specs:
            for r in range(p.world):
                check_exact_cover(p.param(s.name, r), lambda q, s=s, p=p: p.train.region(s, q))


def test_real_7b_shapes_are_covered_exactly_once():
    specs = preset_specs("qwen2.5-vl-7b")
    for train, tp in [(TrainLayout(fsdp=8), 4), (TrainLayout(fsdp=32, block=2), 2), (TrainLayout(tp=4, fsdp=8), 2)]:
        p = plan(specs, train, RolloutLayout(tp))
        done = set()
        for s in specs:
            if s.signature() not in done:
                done.add(s.signature())
                for r in range(p.world):
                    check_exact_cover(p.param(s.name, r), lambda q, s=s, p=p: p.train.region(s, q))


def test_same_tp_layout_shares_everything_and_copies_nothing(tiny_specs):
    p = plan(tiny_specs, TrainLayout(tp=4, vision_tp=True), RolloutLayout(4, vision_tp=True))
    for s in tiny_specs:
        for r in range(4):
            q = p.param(s.name, r)
            assert q.share is not None and q.share.is_view and q.shared_numel == q.rollout.numel and not q.copies


def test_fsdp_above_tp_keeps_each_training_shard_inside_its_rollout_shard():
    """Plain (unfused) column-parallel weights: a TP-2 shard spans 4 of 8 FSDP shards; with the best
    mapping every rank's training shard is stored inside its rollout buffer (a partial share)."""
    specs = [ParamSpec("w", (64, 8), 0, (Part(64, 8),)), ParamSpec("b", (64,), 0, (Part(64, 8),))]
    p = plan(specs, TrainLayout(fsdp=8), RolloutLayout(2))
    for s in specs:
        for r in range(8):
            q = p.param(s.name, r)
            assert q.shared_numel == q.train.numel == q.rollout.numel // 4 and not q.share.is_view
            assert q.extra_numel == q.rollout.numel - q.train.numel
    assert p.choice.optimal and p.mapping.node_of is not None


def test_fsdp_below_tp_gives_views_and_fused_parts_need_blocked_order(tiny_specs):
    """HSDP with 2 shards under rollout TP 4: an FSDP shard holds two TP shards. Plain weights are
    views as stored; fused gate_up and row-parallel down only in blocked order. qkv's 2 KV heads
    are replicated over 4 TP ranks: a blocked order can make only one rank of each pair contiguous."""
    spec = {s.name: s for s in tiny_specs}
    qkv, gate_up, down = (spec[f"model.layers.0.{n}.weight"] for n in ("self_attn.qkv_proj", "mlp.gate_up_proj",
                                                                       "mlp.down_proj"))
    asis = plan(tiny_specs, TrainLayout(fsdp=2, rep=4), RolloutLayout(4))
    blocked = plan(tiny_specs, TrainLayout(fsdp=2, rep=4, block=4), RolloutLayout(4))
    for r in range(8):
        assert asis.param("lm_head.weight", r).share.is_view
        assert asis.param(down.name, r).share is None
        for s in (qkv, gate_up):
            assert asis.param(s.name, r).shared_numel < asis.param(s.name, r).rollout.numel
        for s in (gate_up, down, spec["lm_head.weight"]):
            assert blocked.param(s.name, r).share.is_view and not blocked.param(s.name, r).copies
        q = blocked.param(qkv.name, r)
        assert (q.share is not None and q.share.is_view and not q.copies) == (blocked.tp_rank(r) % 2 == 0)


def test_uneven_last_shard_padding_is_never_shared():
    spec = ParamSpec("b", (10,), None)
    p = plan([spec], TrainLayout(fsdp=4), RolloutLayout(1))
    q = p.param("b", 3)  # rows [9, 10) plus 2 padding rows
    assert (q.train.rows, q.train.pad) == (1, 2)
    assert q.shared_numel == 1 and q.share.buffer_numel == 12  # padding sits past the rollout tensor's end
    t = fsdp_chunk(Region.of([Rect(0, 10, 0, 1)], 1), 4, 2)  # rows [6, 9), no padding
    s = Region.of([Rect(6, 10, 0, 1)], 1)
    assert find_share(s, t).numel == 3
    # FSDP owns its padding: a rollout tensor running on into it cannot be laid over this shard
    assert find_share(s, Region(t.rects, 1, pad=1)) is None


def test_training_shards_in_another_dtype_share_nothing_but_still_copy_locally(tiny_specs):
    p = plan(tiny_specs, TrainLayout(fsdp=4), RolloutLayout(2), share=False)
    s = Summary.of(p)
    assert all(b.shared == 0 and b.extra == b.rollout for b in s.ranks)
    assert all(b.local > 0 for b in s.ranks)


def test_hungarian_is_optimal():
    rng = random.Random(0)
    for n in range(1, 7):
        w = [[rng.randrange(100) for _ in range(n)] for _ in range(n)]
        col = hungarian(w)
        assert sorted(col) == list(range(n))
        best = max(sum(w[i][p[i]] for i in range(n)) for p in itertools.permutations(range(n)))
        assert sum(w[i][col[i]] for i in range(n)) == best


def test_interleavings_and_placement():
    maps = dict(interleavings(32, 8))
    assert len(maps) == 10 and all(sorted(m) == list(range(32)) for m in maps.values())
    assert maps["ggttt"] == tuple(range(32))  # rank = g * tp + t
    assert maps["tttgg"][5] == 1 * 8 + 1  # rank = t * groups + g: rank 5 is t 1 of group 1
    assert placement(1, 8, maps["ggttt"], 8) == tuple(r // 8 for r in range(32))
    # training TP 8 groups are contiguous ranks; rollout TP 8 groups strided: both cannot be node-local
    assert placement(8, 8, maps["tttgg"], 8) is None
    assert placement(1, 8, maps["tttgg"], 8) is not None  # FSDP's order is free


def test_real_shape_bounds(tiny_specs):
    """7B, FSDP 8: every rank's training shard is shared whole with rollout TP 1; blocked order makes
    the whole training shard shareable under rollout TP 4 too (the vision tower is replicated)."""
    specs = preset_specs("qwen2.5-vl-7b")
    for train, tp in [(TrainLayout(fsdp=8), 1), (TrainLayout(fsdp=8, block=4), 4)]:
        s = Summary.of(plan(specs, train, RolloutLayout(tp)))
        assert s.plan.choice.optimal and s.plan.mapping.node_of is not None
        for b, r in zip(s.ranks, range(8)):
            held = sum(s.plan.counts[sig] * per[r].train.numel * 2 for sig, per in s.plan.plans.items())
            assert b.shared == held and b.extra == b.rollout - held
            assert b.rebuilt == b.local + b.intra_in + b.inter_in
    assert parse_train("tp4xfsdp8") == TrainLayout(tp=4, fsdp=8)
    with pytest.raises(ValueError):
        parse_train("tp4xtp2")


def test_cli_prints_the_tables(capsys):
    from rollplex.weights.__main__ import main

    main(["--models", "qwen2.5-vl-7b", "--train", "fsdp8,tp2", "--rollout-tp", "1,2,8", "--footprint",
          "qwen2.5-vl-7b:8"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| FSDP 8 |")]
    assert len(rows) == 3 + 3 + 2  # three sharing rows (TP 8: n/a, 28 heads), three runtime, two footprint
    assert "n/a: model.layers.0.self_attn.qkv_proj.weight: 28 units" in rows[2]
    # the runtime (engines grouped for sharing, window shares only): FSDP shard + what a TP-2 engine adds
    assert "| FSDP 8 | 2 | gtg | 1.93 | 8.35 | 7.31 (14%) | 9.24 | 7.31 (7.05) |" in out
    assert "| TP 2 | 2 | 2 | t | 8.35 | 0.00 (100%) | 0.00 (0.00) | 0 |" in out
    main(["--explain", "qwen2.5-vl-7b,fsdp8,4"])
    out = capsys.readouterr().out
    assert "mapping gtt (optimal: True)" in out and "| model.layers.0.mlp.down_proj.weight (3584, 18944) | 28 |" in out


def test_realised_plan_keeps_only_windows_of_the_rollout_tensor(tiny_specs):
    """What the runtime runs: shares whose training shard is a window of the rollout tensor as an engine
    allocates it stay; joint buffers and padded shards become copies, still an exact cover."""
    from rollplex.weights import in_place, realised
    from rollplex.weights.mapping import Mapping

    for train, tp in [(TrainLayout(fsdp=2), 2), (TrainLayout(fsdp=4), 2), (TrainLayout(fsdp=6), 1),
                      (TrainLayout(fsdp=4), 4)]:
        full = plan(tiny_specs, train, RolloutLayout(tp), mapping=Mapping("identity", tuple(range(train.world)), None))
        got = realised(full)
        kept = dropped = 0
        for s in tiny_specs:
            for r in range(got.world):
                q, before = got.param(s.name, r), full.param(s.name, r)
                check_exact_cover(q, lambda k, s=s, p=got: p.train.region(s, k))
                if before.share is not None and in_place(before):
                    assert q == before
                    kept += 1
                else:
                    assert q.share is None
                    dropped += before.share is not None
        assert kept > 0  # the norms and the (replicated) vision tower at least
        if train.world == 6:  # 6 does not divide the tiny shapes: padded shards are never in place
            assert dropped > 0
    # one engine over the ranks, FSDP as wide: the vocab shards and whole tensors are windows, a fused
    # q/k/v shard is not
    got = realised(plan(tiny_specs, TrainLayout(fsdp=2), RolloutLayout(2),
                        mapping=Mapping("identity", (0, 1), None)))
    names = {s.name for s in tiny_specs}
    qkv = next(n for n in names if n.endswith("layers.0.self_attn.qkv_proj.weight"))
    assert all(got.param(qkv, r).share is None for r in range(2))
    assert all(got.param("model.embed_tokens.weight", r).share is not None for r in range(2))


def test_engine_mapping_groups_engines_for_sharing():
    """The runtime's engines: the interleaving that shares the most under `realised`, never less than
    consecutive blocks; at TP 4 over 16 ranks (7B) a strided mix shares 2.4x what consecutive blocks do."""
    from rollplex.parallel.rollout_groups import groups_of
    from rollplex.weights import engine_mapping, in_place, realised
    from rollplex.weights.mapping import Mapping

    specs = preset_specs("qwen2.5-vl-7b")

    def shared(m):
        p = realised(plan(specs, TrainLayout(fsdp=16), RolloutLayout(4), mapping=m))
        return sum(p.counts[sig] * q.shared_numel for sig, qs in p.plans.items() for q in qs if q.share is not None
                   and in_place(q))

    best = engine_mapping(specs, 16, 4)
    consecutive = Mapping("consecutive", tuple(range(16)), None)
    assert best.name == "gttg" and shared(best) > 2 * shared(consecutive)
    groups = groups_of(best.slot_of, 4)  # engines partition the ranks, TP rank increasing with the rank
    assert sorted(r for g in groups for r in g) == list(range(16)) and all(g == sorted(g) for g in groups)
    assert groups[0] == [0, 2, 4, 6]
    assert engine_mapping(specs, 4, 4).slot_of == tuple(range(4))  # one engine over all ranks: no choice


def test_column_sharded_row_parallel_weights_are_the_engines_shards(tiny_specs):
    """The runtime's layout under one engine over every rank (`runtime_train_layout`): FSDP2 shards o /
    down by columns (`Shard(1)`), a rank's region is torch's own dim-1 chunk, and it is the rank's TP
    shard, so the realised plan shares it; under several engines (or a per-rank engine) rows as before."""
    import torch
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    from rollplex.weights import in_place, realised, runtime_train_layout
    from rollplex.weights.mapping import Mapping

    assert runtime_train_layout(4, 4).column_shard and not runtime_train_layout(4, 2).column_shard
    assert not runtime_train_layout(1, 1).column_shard and not runtime_train_layout(4, 1).column_shard
    down = next(s for s in tiny_specs if s.name.endswith("layers.0.mlp.down_proj.weight"))
    norm = next(s for s in tiny_specs if s.name.endswith("layers.0.input_layernorm.weight"))
    layout = runtime_train_layout(2, 2)
    assert layout.column_sharded(down) and not layout.column_sharded(norm)
    matrix = torch.arange(down.numel).view(down.rows, down.cols)
    for s, chunk in enumerate(_chunk_with_empty(matrix, 2, dim=1)):
        (rect,) = layout.region(down, s).rects
        assert torch.equal(matrix[rect.r0 : rect.r1, rect.c0 : rect.c1], chunk)
    identity = Mapping("identity", (0, 1), None)
    got = realised(plan(tiny_specs, layout, RolloutLayout(2), mapping=identity))
    rows = realised(plan(tiny_specs, TrainLayout(fsdp=2), RolloutLayout(2), mapping=identity))
    for r in range(2):
        q = got.param(down.name, r)
        assert q.share is not None and in_place(q) and q.shared_numel == q.rollout.numel and not q.copies
        assert rows.param(down.name, r).share is None
        check_exact_cover(q, lambda k: layout.region(down, k))
    saved = [Summary.of(p).saved for p in (rows, got)]
    assert saved[1] > saved[0] + 0.05, saved  # tiny shapes: 45% -> 53% of the rollout copy
