"""FSDP2 data-parallel actor update on gloo (spawned ranks) equals the single-process `Actor.update`:
gradients, updated weights, metrics and first-pass logprobs."""

import copy
import dataclasses

import pytest
import torch
from helpers import make_prompt
from parallel_dp_worker import worker
from parallel_helpers import rollout_batch, spawn, tiny_cfg, tiny_model

from rollplex.models import ModelInputs
from rollplex.parallel import FSDPConfig, assign_prompts, fsdp
from rollplex.parallel.data_parallel import dummy_prompt, uses_vision, with_dummy
from rollplex.rl.activation_checkpointing import route_layers, set_activation_checkpointing
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


def test_a_copy_of_a_routed_model_runs_its_own_layers():
    """The routing apply_fsdp installs before sharding (layer and block slots calling the modules) is bound
    to its instances: a deep copy of the model computes with the copy's layers and blocks, and its switches
    are its own."""
    model = tiny_model(tiny_cfg())
    route_layers(model, fsdp._route_through_modules)
    set_activation_checkpointing(model, True, False)  # routed again over the checkpointed slot, as the OOM ladder does
    twin = copy.deepcopy(model)
    assert twin.model.layer.__self__ is twin.model and twin.visual.block.__self__ is twin.visual
    plain = tiny_model(tiny_cfg())
    with torch.no_grad():
        for p, q in zip(twin.parameters(), plain.parameters()):
            p.mul_(0.5)
            q.mul_(0.5)
    prompt = [make_prompt(torch.Generator().manual_seed(0), images=[(1, 4, 4)])]
    with torch.no_grad():
        torch.testing.assert_close(twin(prompt), plain(prompt))  # the copy's weights, not the original's
    vars(twin)["_fsdp_direct"][0] = True
    assert vars(twin.model)["_fsdp_direct"][0] and vars(twin.visual)["_fsdp_direct"][0]
    assert not vars(model.model)["_fsdp_direct"][0]
    with torch.no_grad():
        torch.testing.assert_close(twin(prompt), plain(prompt))
