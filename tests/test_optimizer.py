"""MasterAdamW (chunked, optionally paged from the CPU) computes torch.optim.AdamW's update exactly."""

import pytest
import torch

from rollplex.memory import MemoryManager, PhasePlan
from rollplex.rl.optimizer import MasterAdamW


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g).to(dtype)) for s in [(7, 5), (5,), (33, 4), (2, 2)]]


def _run(opt_fn, dtype, steps=3):
    params = _params(dtype)
    opt = opt_fn(params)
    for s in range(steps):
        opt.zero_grad()
        loss = sum(((p.float() * (s + 1)) ** 2).sum() * (i + 1) for i, p in enumerate(params))
        loss.backward()
        opt.step()
    return params, opt


KW = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


@pytest.mark.parametrize("chunk_bytes,offload", [(1 << 30, "none"), (64, "none"), (64, "moments"), (64, "all"),
                                                (64, "cpu")])
def test_matches_torch_adamw_fp32(chunk_bytes, offload):
    ref, _ = _run(lambda ps: torch.optim.AdamW(ps, **KW), torch.float32)
    got, opt = _run(lambda ps: MasterAdamW(ps, chunk_bytes=chunk_bytes, offload=offload, **KW), torch.float32)
    assert len(opt.chunks) == (1 if chunk_bytes > 1000 else 4)
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert b.grad is not None  # persistent buffers survive the step
    if opt.offload:  # paged moments are kept in one host allocation (pinned on a GPU), not one per tensor
        moments = [t for m in opt.master for t in opt.opt.state[m].values() if t.dim() > 0]
        assert len(moments) == 2 * len(opt.master)
        assert len({t.untyped_storage().data_ptr() for t in moments}) == 1
    if offload in ("all", "cpu"):  # host masters likewise: one allocation
        assert len({m.untyped_storage().data_ptr() for m in opt.master}) == 1


@pytest.mark.parametrize("offload", ["all", "cpu"])
def test_bf16_master_chunked_and_paged_agree(offload):
    whole, o1 = _run(lambda ps: MasterAdamW(ps, **KW), torch.bfloat16)
    paged, o2 = _run(lambda ps: MasterAdamW(ps, chunk_bytes=64, offload=offload, **KW), torch.bfloat16)
    for a, b, ma, mb in zip(whole, paged, o1.master, o2.master):
        assert torch.equal(a, b) and torch.equal(ma, mb) and ma.dtype == torch.float32
    sd = o2.state_dict()
    fresh = MasterAdamW(_params(torch.bfloat16, seed=1), chunk_bytes=64, offload=offload, **KW)
    with torch.no_grad():  # a checkpoint load puts the stored (bf16) weights in first
        for p, q in zip(fresh.params, paged):
            p.copy_(q)
        fresh.params[0].add_(1.0)  # edited since the save: its master no longer rounds to it
    assert fresh.load_state_dict(sd) == 1
    assert torch.equal(fresh.master[0], fresh.params[0].float())  # rebuilt from the weights
    assert all(torch.equal(a, b) for a, b in zip(fresh.master[1:], o2.master[1:]))  # the saved fp32 masters
    assert all(torch.equal(a, b) for a, b in zip(fresh.params[1:], paged[1:]))
    if fresh.offload:  # the loaded moments went back into the host allocation
        assert len({t.untyped_storage().data_ptr() for m in fresh.master
                    for t in fresh.opt.state[m].values() if t.dim() > 0}) == 1


def test_regions_hold_grads_and_state():
    mm = MemoryManager(PhasePlan.releases_only().with_overrides("optimizer:*=offloaded"), backend="accounting")
    params, opt = _run(lambda ps: MasterAdamW(ps, memory=mm, **KW), torch.bfloat16, steps=1)
    nparam = sum(p.numel() for p in params)
    assert mm.region_bytes("grads") == 2 * nparam
    assert mm.region_bytes("optimizer") >= 12 * nparam  # masters + both moments (made at the first step)
    before = [m.clone() for m in opt.master]
    mm.enter("rollout")  # grads released, optimizer offloaded
    assert all(torch.isnan(p.grad.float()).all() for p in params)
    mm.enter("update")
    assert all(torch.equal(a, b) for a, b in zip(before, opt.master))
    assert all((p.grad == 0).all() for p in params)  # re-zeroed on resume


def test_touched_params_are_what_received_a_gradient():
    params = _params(torch.float32)
    opt = MasterAdamW(params, **KW)
    opt.zero_grad()
    (params[0].sum() + params[2].sum()).backward()
    assert opt.touched_params() == [params[0], params[2]]
    before = [p.detach().clone() for p in params]
    opt.step()
    assert not torch.equal(params[0], before[0]) and torch.equal(params[1], before[1])  # untouched: no decay
    assert float(torch.nn.utils.clip_grad_norm_(opt.touched_params(), 1.0)) > 0


def test_dropped_optimizer_is_freed_and_grads_can_be_freed():
    import gc
    import weakref

    params = _params(torch.float32)
    opt = MasterAdamW(params, **KW)
    opt.zero_grad()
    sum(p.sum() for p in params).backward()
    opt.step()
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None  # the gradient hooks do not keep it (and its state) alive
    opt = MasterAdamW(params, **KW)
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in params)
    opt.zero_grad()  # buffers come back zeroed
    assert all(p.grad is not None and not p.grad.any() for p in params)
    opt.close()
    sum(p.sum() for p in params).backward()
    assert opt.touched_params() == []
