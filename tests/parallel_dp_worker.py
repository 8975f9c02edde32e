"""One rank of the data-parallel update test: FSDP2 over gloo, the rank's share of the prompts, then
the gathered weights, gradients, metrics and logprobs against the single-process update."""

from __future__ import annotations

import torch
import torch.distributed as dist
from helpers import FORWARD_TERMS, assert_fp32_close, assert_weights_close
from parallel_helpers import init_group, rollout_batch, tiny_cfg, tiny_model
from torch.distributed.device_mesh import init_device_mesh

from rollplex.parallel import DataParallelActor, FSDPConfig, full_state_dict, full_tensor
from rollplex.parallel.fsdp import can_call_directly
from rollplex.rl.config import RLConfig


def worker(rank: int, world: int, init: str, rl: RLConfig, fsdp: FSDPConfig, tie: bool, want: dict,
           refuse_on: int | None = None) -> None:
    """refuse_on: the rank whose device memory (as `fits` sees it) takes no unsharded copy."""
    init_group(rank, world, init)
    try:
        model = tiny_model(tiny_cfg(tie))
        actor = DataParallelActor(model, rl, init_device_mesh("cpu", (world,)), fsdp)
        if rank == refuse_on:
            actor.dp.fits = lambda mb, mode, extra=0: extra == 0
        accumulated = []  # per training mini-batch of several passes: reduced once after its last pass
        kept = []  # per scoring call of several passes: the units gathered once for all of them
        hooked = [0]  # passes expected through FSDP2's hooks (module calls of a layer)
        passes = actor.dp.passes

        def recording(local, mode, plan, **kw):
            out = passes(local, mode, plan, **kw)
            once = actor.dp._accumulate if torch.is_grad_enabled() else len(out) > 1 and actor.dp._scoring_left > 0
            if len(out) > 1:
                (accumulated if torch.is_grad_enabled() else kept).append(once)
            # with every unit gathered the passes skip the hooks, and a reduce once per mini-batch reduce-scatters
            # without them; under a mixed-precision policy the passes and that reduce (one more, dummy pass) use them
            through = not can_call_directly(fsdp)
            hooked[0] += (len(out) + int(torch.is_grad_enabled()) if through else 0) if once else len(out)
            return out

        module_calls = [0]
        model.model.layers[0].register_forward_pre_hook(lambda *_: module_calls.__setitem__(0, module_calls[0] + 1))

        actor.dp.passes = recording
        grads = []
        step = actor.optimizer.step

        def capture():
            grads.append({n: full_tensor(p.grad) for n, p in model.named_parameters() if p.grad is not None})
            step()

        actor.optimizer.step = capture
        batch, adv, ref = rollout_batch()
        old = actor.old_logprobs(batch)
        metrics, first = actor.update(batch, adv, ref, old)
        weights = full_state_dict(model)
        # the default reduces once per mini-batch unless some rank's memory refuses the copy: all ranks agree
        assert accumulated and set(accumulated) == {fsdp.reduce_every_pass is not True and refuse_on is None}, \
            accumulated
        assert (len(kept) > 0) == (rl.num_updates > 1) and set(kept) <= {refuse_on is None}, kept
        assert module_calls[0] == hooked[0], (module_calls, hooked)
        assert isinstance(model.model.layers[0].self_attn.qkv_proj.weight, torch.distributed.tensor.DTensor)
        assert len(grads) == len(want["grads"])
        for mine, ref_g in zip(grads, want["grads"]):
            assert mine.keys() == ref_g.keys()
            for n, g in ref_g.items():
                assert_fp32_close(mine[n], g, f"grad {n}")
        assert_fp32_close(first, want["first"], "first-pass logprobs", FORWARD_TERMS)
        for n, w in want["weights"].items():
            assert_weights_close(weights[n], w, f"weight {n}")
        for k, v in want["metrics"].items():  # means of O(1) terms that may cancel: relative to 1
            assert_fp32_close(metrics[k], v, k, scale=1.0)
        dist.barrier()
    finally:
        dist.destroy_process_group()
