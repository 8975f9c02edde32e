"""FSDP2 data-parallel actor update on gloo (spawned ranks) equals the single-process `Actor.update`:
gradients, updated weights, metrics and first-pass logprobs."""

import dataclasses

import pytest
import torch
from parallel_dp_worker import worker
from parallel_helpers import rollout_batch, spawn, tiny_cfg, tiny_model

from rollplex.models import ModelInputs
from rollplex.parallel import FSDPConfig, assign_prompts
from rollplex.parallel.data_parallel import dummy_prompt, uses_vision, with_dummy
from rollplex.rl.actor import Actor
from rollplex.rl.config import RLConfig


def _single_process(rl: RLConfig, tie: bool) -> dict:
    model = tiny_model(tiny_cfg(tie))
    actor = Actor(model, rl)
    grads = []
    step = actor.optimizer.step

    def capture():
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        step()

    actor.optimizer.step = capture
    batch, adv, ref = rollout_batch()
    metrics, first = actor.update(batch, adv, ref, actor.old_logprobs(batch))
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(metrics=metrics, first=first, grads=grads, weights=weights)


# a small lr: Adam's first step is ~lr * sign(grad), so rounding noise in a near-zero gradient would
# move a weight by up to 2 lr
BASE = dict(lr=1e-4, kl_coef=0.05, micro_batch_prompts=1, micro_batch_samples=3)


@pytest.mark.slow
@pytest.mark.parametrize("world,rl,fsdp,tie", [
    # 5 prompts over 2 ranks, two optimizer steps, entropy bonus, per-layer checkpointing; units of two
    # layers (the third vision block alone), gradients reduced once per mini-batch (the default on CPU)
    (2, dict(ppo_mini_batches=2, loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.01),
     FSDPConfig(activation_checkpointing=True, vision_activation_checkpointing=True, layers_per_unit=2,
                reduce_every_pass=False), False),
    # over 4 ranks: uneven pass counts (dummy passes), text-only ranks in vision passes (dummy images);
    # two epochs score old logprobs first; tied embeddings; gradients reduced after every pass
    (4, dict(ppo_epochs=2), FSDPConfig(reduce_every_pass=True), True),
    # serial mode (rollplex mode runs the packed pass: see test_prefix_state_path_is_refused)
    # rank 1's memory takes no unsharded copy, so both ranks reduce after every pass
    (2, dict(mode="serial", micro_batch_samples=2), FSDPConfig(reshard_after_forward=False, layers_per_unit=3), False),
])
def test_fsdp_update_equals_single_process(tmp_path, world, rl, fsdp, tie):
    cfg = RLConfig(**{**BASE, **rl})
    want = _single_process(cfg, tie)
    refuse_on = 1 if cfg.mode == "serial" else None
    spawn(worker, args=(world, f"file://{tmp_path}/store", cfg, fsdp, tie, want, refuse_on), nprocs=world)


def test_assign_prompts_balances_by_cost():
    # 7 -> r0, 5 -> r1, 2 -> r1 (7 | 7), 1 -> r0 (the lower rank on a tie), 1 -> r1: loads 8 | 8
    assert assign_prompts([5, 1, 1, 7, 2], 2) == [[1, 3], [0, 2, 4]]
    assert assign_prompts([3, 3, 3], 4) == [[0], [1], [2], []]
    assert assign_prompts([], 2) == [[], []]
    shares = assign_prompts([4, 9, 2, 2, 8, 1, 3], 3)
    assert sorted(i for s in shares for i in s) == list(range(7))
    with pytest.raises(ValueError):
        assign_prompts([1], 0)


def test_dummies_add_one_masked_sample():
    cfg = tiny_cfg()
    batch, _, _ = rollout_batch()
    mb, _ = batch.select_prompts([1, 4])  # text only
    assert not uses_vision(mb, "rollplex")
    padded = with_dummy(mb, dummy_prompt(cfg, image=True))
    assert uses_vision(padded, "rollplex") and uses_vision(padded, "serial")
    assert padded.num_samples == mb.num_samples + 1 and padded.num_prompts == 3
    assert padded.mask[-1].sum() == 0 and padded.group[-1] == 2
    assert torch.equal(padded.mask[:-1], mb.mask) and padded.rewards.shape == (mb.num_samples + 1,)
    alone = with_dummy(None, dummy_prompt(cfg, image=False))
    assert alone.num_samples == 1 and alone.mask.sum() == 0 and not uses_vision(alone, "serial")
    # serial passes carry every prompt; only the selected samples' prompts count
    serial = dataclasses.replace(batch.select_samples(torch.tensor([2, 3])))  # prompt 1: text
    assert not uses_vision(serial, "serial")
    # the dummy image is one merged patch: the model embeds it like any image
    model = tiny_model(cfg)
    p = dummy_prompt(cfg, image=True)
    assert isinstance(p, ModelInputs) and model.embed_prompts([p]).embeds.shape == (1, 3, 64)


def test_prefix_state_path_is_refused():
    from rollplex.parallel.data_parallel import check_passes

    check_passes("rollplex", True)
    check_passes("serial", False)  # serial runs one full-sequence pass either way
    with pytest.raises(ValueError, match="packed"):
        check_passes("rollplex", False)
