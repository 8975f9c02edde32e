"""Scheduler and block manager, without torch: admission, prompt sharing, preemption, abort."""

import sys
from types import SimpleNamespace

import pytest

from rollplex.engine.block_manager import BlockManager
from rollplex.engine.sampling_params import SamplingParams
from rollplex.engine.scheduler import Scheduler, SchedulerConfig
from rollplex.engine.sequence import Request, SeqStatus


def _req(rid, prompt_len, n=1, max_new=8):
    inputs = SimpleNamespace(input_ids=list(range(prompt_len)))
    return Request(rid, inputs, SamplingParams(n=n, max_new_tokens=max_new), seeds=list(range(n)))


def _sched(num_blocks=32, block_size=4, **kw):
    return Scheduler(SchedulerConfig(**kw), BlockManager(num_blocks, block_size))


def test_modules_do_not_import_torch():
    import subprocess

    code = ("import sys; import rollplex.engine.scheduler, rollplex.engine.block_manager, "
            "rollplex.engine.sampling_params; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_group_prefills_once_and_shares_prompt_blocks():
    s = _sched(num_blocks=16, block_size=4)
    r = _req("a", prompt_len=10, n=3)  # 10 tokens = 2 full blocks + a partial one
    s.add(r)
    b = s.schedule()
    assert b.is_prefill and len(b.prefill) == 1
    item = b.prefill[0]
    assert item.seq is r.seqs[0] and item.forks == r.seqs[1:]
    leader, c1, c2 = r.seqs
    assert c1.block_table[:2] == leader.block_table[:2] == c2.block_table[:2]  # shared full blocks
    assert len({leader.block_table[2], c1.block_table[2], c2.block_table[2]}) == 3  # own partial block
    assert item.copies == [(leader.block_table[2], c1.block_table[2]), (leader.block_table[2], c2.block_table[2])]
    assert s.blocks.ref[leader.block_table[0]] == 3
    assert s.blocks.num_free == 15 - 5
    for seq in r.seqs:
        assert seq.status is SeqStatus.RUNNING


def test_prefill_first_then_decode_and_slots():
    s = _sched(num_blocks=16, block_size=4)
    r = _req("a", prompt_len=4, n=2)  # exactly one block: no partial copy
    s.add(r)
    item = s.schedule().prefill[0]
    assert item.copies == [] and r.seqs[0].block_table == r.seqs[1].block_table
    for seq in r.seqs:
        seq.token_ids.append(99)  # first sampled token, KV not yet computed
    b = s.schedule()
    assert not b.is_prefill and b.decode == r.seqs
    assert r.seqs[0].block_table[1] != r.seqs[1].block_table[1]  # each sample's new block
    assert s.blocks.slot(r.seqs[0], 4) == r.seqs[0].block_table[1] * 4


def test_admission_limits():
    s = _sched(num_blocks=8, block_size=4, max_num_seqs=3, max_num_batched_tokens=20)
    for i in range(3):
        s.add(_req(str(i), prompt_len=8))  # 2 blocks each
    b = s.schedule()
    assert len(b.prefill) == 2  # 16 tokens; a third would exceed 20 batched tokens
    b = s.schedule()
    assert len(b.prefill) == 1 and s.blocks.num_free == 1
    s.add(_req("x", prompt_len=4))
    assert not s.schedule().is_prefill  # max_num_seqs reached -> decode


def test_preemption_recomputes_newest_and_requeues_first():
    s = _sched(num_blocks=5, block_size=4)  # 4 usable blocks
    a, b = _req("a", prompt_len=4), _req("b", prompt_len=4)
    s.add(a)
    s.add(b)
    assert len(s.schedule().prefill) == 2
    for r in (a, b):
        r.seqs[0].token_ids.append(7)
    s.schedule()  # decode: each takes a second block -> 0 free
    assert s.blocks.num_free == 0
    for r in (a, b):
        r.seqs[0].token_ids += [7, 7, 7, 7]  # pretend 4 more tokens: next decode needs a block each
    batch = s.schedule()
    assert batch.decode == [a.seqs[0]]
    assert b.seqs[0].status is SeqStatus.WAITING and s.waiting[0] is b.seqs[0]
    assert s.num_preemptions == 1 and b.seqs[0].block_table == []
    # once a finishes, b is prefilled again with all of its tokens
    s.finish(a.seqs[0], "stop")
    batch = s.schedule()
    assert batch.is_prefill and batch.prefill[0].seq is b.seqs[0] and batch.prefill[0].num_tokens == 9


def test_abort_and_finish_free_blocks():
    s = _sched(num_blocks=10, block_size=4)
    r = _req("a", prompt_len=6, n=3)
    s.add(r)
    s.schedule()
    s.abort(r)
    assert r.finished and all(x.finish_reason == "abort" for x in r.seqs)
    assert s.blocks.num_free == 9 and not s.has_work
    w = _req("w", prompt_len=3)
    s.add(w)
    s.abort(w)  # aborting a waiting request removes it
    assert not s.waiting


def test_rejects_requests_that_can_never_run():
    s = _sched(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add(_req("long", prompt_len=64))
    with pytest.raises(ValueError, match="KV blocks"):
        s.add(_req("big", prompt_len=16))
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
