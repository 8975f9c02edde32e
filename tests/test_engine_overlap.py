"""Overlap scheduling (step N+1 launched before step N's tokens reach the host) changes when the
host learns tokens, never which tokens: every output equals the engine without overlap."""

import pytest
from test_engine import _engine, _prompts

from rollplex.engine import SamplingParams


def _run(tiny_dir, proc, overlap: bool, params, **cfg):
    eng = _engine(tiny_dir, proc, overlap_schedule=overlap, **cfg)
    outs = eng.generate(_prompts(proc), params)
    assert not eng.has_work and eng.blocks.num_free == eng.blocks.num_blocks - 1  # nothing leaked
    return eng, [[(s.token_ids, s.logprobs, s.finish_reason, s.matched_stop, s.text) for s in o.samples] for o in outs]


def _same(a, b):
    for ra, rb in zip(a, b):
        for (ta, la, fa, ma, xa), (tb, lb, fb, mb, xb) in zip(ra, rb):
            assert ta == tb and fa == fb and ma == mb and xa == xb
            assert max((abs(u - v) for u, v in zip(la, lb)), default=0.0) <= 1e-6


def test_overlap_equals_serial_with_stops_and_lengths(tiny_dir, proc):
    _, free = _run(tiny_dir, proc, False, SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))
    stop_tok = free[0][0][0][3]
    params = [SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=[stop_tok]),
              SamplingParams(temperature=1.0, max_new_tokens=7, n=3, seed=2, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=1, n=2, seed=4),
              SamplingParams(temperature=1.0, max_new_tokens=9, stop_token_ids=[stop_tok], n=2, seed=9)]
    _, ref = _run(tiny_dir, proc, False, params)
    _, got = _run(tiny_dir, proc, True, params)
    _same(ref, got)
    assert ref[0][0][2] == "stop" and ref[2][0][0].__len__() == 1


def test_overlap_equals_serial_under_preemption(tiny_dir, proc):
    params = [SamplingParams(temperature=1.0, max_new_tokens=30, ignore_eos=True, n=3, seed=5)] * 4
    ref_eng, ref = _run(tiny_dir, proc, False, params, kv_cache_tokens=16 * 14)
    eng, got = _run(tiny_dir, proc, True, params, kv_cache_tokens=16 * 14)
    assert eng.scheduler.num_preemptions > 0
    _same(ref, got)


@pytest.mark.parametrize("after_steps", [1, 3, 6])
def test_abort_with_a_step_in_flight(tiny_dir, proc, after_steps):
    p = _prompts(proc)[0]
    sp = SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True, n=2, seed=3)
    full = _engine(tiny_dir, proc, overlap_schedule=False).generate([p], sp)[0]
    eng = _engine(tiny_dir, proc, overlap_schedule=True)
    rid = eng.add_request(p, sp)
    for _ in range(after_steps):
        eng.step()
    part = eng.abort(rid)
    for a, b in zip(part.samples, full.samples):
        assert a.finish_reason == "abort" and a.token_ids == b.token_ids[: len(a.token_ids)]
        assert len(a.logprobs) == len(a.token_ids)
    while eng.has_work:  # the in-flight step resolves without reviving the aborted request
        assert eng.step() == []
    assert eng.blocks.num_free == eng.blocks.num_blocks - 1
    again = eng.generate([p], sp)[0]
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in full.samples]


def test_incremental_host_block_table_equals_a_rebuilt_one(tiny_dir, proc):
    """Rows reassigned, tables grown by one block, re-prefilled (new key) and shrinking batches."""
    import random

    import torch

    runner = _engine(tiny_dir, proc, max_num_seqs=8).runner
    rng = random.Random(0)
    seqs = {i: [rng.randrange(1, 100) for _ in range(rng.randrange(1, 5))] for i in range(12)}
    epoch = dict.fromkeys(seqs, 0)
    for _ in range(200):
        live = rng.sample(sorted(seqs), rng.randrange(1, 9))
        for i in live:
            r = rng.random()
            if r < 0.3:
                seqs[i].append(rng.randrange(1, 100))
            elif r < 0.35:  # preempted and prefilled again: a new table under a new key
                seqs[i] = [rng.randrange(1, 100) for _ in range(rng.randrange(1, 5))]
                epoch[i] += 1
        tables = [seqs[i] for i in live]
        rows = min(len(live) + rng.randrange(0, 3), runner._bt_host.shape[0])
        got = runner._host_block_table(tables, [(i, epoch[i]) for i in live], rows)
        width = max(len(t) for t in tables)
        want = torch.tensor([t + [0] * (width - len(t)) for t in tables] + [[0] * width] * (rows - len(live)),
                            dtype=torch.int32)
        assert torch.equal(got[:, :width], want)


def test_a_hook_hears_how_long_the_host_took_to_launch_the_last_step(tiny_dir, proc):
    """With a hook listening, each launch after the first reports the host's time launching the one before
    (there is no device forward to time on the CPU)."""
    eng = _engine(tiny_dir, proc, overlap_schedule=True)
    infos = []
    eng.hooks.append(type("Hook", (), {"on_decode_step": lambda self, info: infos.append(info)})())
    eng.generate(_prompts(proc)[:2], SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
    assert len(infos) >= 5 and infos[0].last_launch_ms is None
    assert all(i.last_launch_ms is not None and i.last_launch_ms > 0 for i in infos[1:])
    assert all(i.last_forward is None for i in infos)
