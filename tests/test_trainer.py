"""The actor's and the critic's trainers on the tiny model (CPU, fp32): a per-step lr override moves the
weights after a state load as before one."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from parallel_helpers import rollout_batch, tiny_cfg, tiny_model

from rollplex.rl.actor import Actor
from rollplex.rl.config import RLConfig
from rollplex.rl.critic import Critic, ValueModel

CFG = RLConfig(lr=1e-4, critic_lr=1e-4, kl_coef=0.05, micro_batch_prompts=2, ppo_mini_batches=2)


def _trainer(role: str, cfg: RLConfig = CFG):
    model = tiny_model(tiny_cfg())
    return Actor(model, cfg) if role == "actor" else Critic(ValueModel(model), cfg)


def _update(role: str, trainer, cfg: RLConfig) -> None:
    """One update of `trainer` on the same batch, with `cfg` as this step's config."""
    batch, adv, ref = rollout_batch()
    if role == "actor":
        trainer.update(batch, adv, ref, trainer.old_logprobs(batch, cfg), 0, cfg)
        return
    g = torch.Generator().manual_seed(1)
    returns = torch.randn(batch.responses.shape, generator=g) * batch.mask
    trainer.update(batch, returns, trainer.values(batch, cfg), 0, cfg)


def _weights(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_lr_override_after_a_load_changes_the_update_as_before_one(role):
    """A state round trip (what /load and a resume do) leaves the optimizer's param groups replaced; a
    step's lr override must still reach them: the loaded trainer makes the fresh one's update."""
    over = dataclasses.replace(CFG, lr=CFG.lr * 10, critic_lr=CFG.critic_lr * 10)
    fresh, loaded, plain = _trainer(role), _trainer(role), _trainer(role)
    loaded.load_state_dict(copy.deepcopy(loaded.state_dict()))
    _update(role, fresh, over)
    _update(role, loaded, over)
    _update(role, plain, CFG)
    a, b, c = _weights(fresh), _weights(loaded), _weights(plain)
    assert not all(torch.equal(x, z) for x, z in zip(a, c)), "the override changes the update"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), f"parameter {i}: the override was lost in the load"
