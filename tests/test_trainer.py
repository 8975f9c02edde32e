"""The actor's and the critic's trainers (rl/trainer.py) on the tiny model (CPU, fp32): a per-step lr
override moves the weights after a state load as before one; an update that fails after an optimizer
step, whatever the error, says what it applied and the step, LR schedule and step index agree with it;
a critic optimizer step that runs out of memory on one of two gloo ranks is agreed by both, as the actor's."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from parallel_helpers import rollout_batch, spawn, tiny_cfg, tiny_model

from rollplex.rl import critic as critic_mod
from rollplex.rl.actor import Actor
from rollplex.rl.config import RLConfig
from rollplex.rl.critic import Critic, ValueModel
from rollplex.rl.errors import TrainOOM, TrainStepFailed
from rollplex.rl.step import RLStep

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


@pytest.mark.parametrize("error", [RuntimeError, ValueError, KeyError])
def test_an_error_after_an_optimizer_step_is_reported_and_counted(error, monkeypatch):
    """Any error in mini-batch 2 of 2 (not only out of memory or a non-finite loss) says that one optimizer
    step was applied; the step index and the LR schedule count the step once."""
    from rollplex.rl import actor as actor_mod

    rl = RLStep(tiny_model(tiny_cfg()), None, CFG)
    batch, _, _ = rollout_batch()
    real, passes = actor_mod.ppo_policy_loss, [0]
    steps = [0]
    opt_step = rl.actor.optimizer.step

    def counting_step():
        opt_step()
        steps[0] += 1

    def fails_after_a_step(*a, **k):
        if steps[0] >= 1:
            raise error("injected")
        passes[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(rl.actor.optimizer, "step", counting_step)
    monkeypatch.setattr(actor_mod, "ppo_policy_loss", fails_after_a_step)
    w0 = _weights(rl.actor)
    with pytest.raises(TrainStepFailed) as e:
        rl.train(batch)
    err = e.value
    assert err.applied_updates == 1 and err.weights_changed and not err.partial_update
    assert isinstance(err.__cause__, error) and "1 optimizer step(s)" in err.applied()
    assert steps[0] == 1 and rl.step_idx == 1 and rl.actor.scheduler.last_epoch == 1
    assert not all(torch.equal(x, y) for x, y in zip(w0, _weights(rl.actor)))


def test_an_error_after_the_update_says_it_was_applied(monkeypatch):
    """An error after the whole update (here in the step's metrics): the step counted, and the error says
    both optimizer steps were applied."""
    rl = RLStep(tiny_model(tiny_cfg()), None, CFG)
    batch, _, _ = rollout_batch()

    def fails(*a, **k):
        raise ZeroDivisionError("injected")

    monkeypatch.setattr(rl, "_batch_metrics", fails)
    with pytest.raises(TrainStepFailed) as e:
        rl.train(batch)
    assert e.value.applied_updates == 2 and isinstance(e.value.__cause__, ZeroDivisionError)
    assert rl.step_idx == 1 and rl.actor.scheduler.last_epoch == 1


GAE = dataclasses.replace(CFG, adv_estimator="gae", kl_coef=0.0)


@pytest.mark.parametrize("warmup", [0, 1])
def test_a_critic_error_after_an_applied_update_counts_the_step(warmup, monkeypatch):
    """The critic fails in its second mini-batch: after the actor's update (two optimizer steps) the error
    says three were applied; during the critic's warm-up (the actor untrained) one, the critic's. Either
    way the weights changed, so the step counts."""
    rl = RLStep(tiny_model(tiny_cfg()), None, dataclasses.replace(GAE, critic_warmup=warmup))
    batch, _, _ = rollout_batch()
    real, calls = critic_mod.value_loss, [0]
    opt_step, steps = rl.critic.optimizer.step, [0]

    def counting_step():
        opt_step()
        steps[0] += 1

    def fails_after_a_step(*a, **k):
        if steps[0] >= 1:
            raise RuntimeError("injected")
        calls[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(rl.critic.optimizer, "step", counting_step)
    monkeypatch.setattr(critic_mod, "value_loss", fails_after_a_step)
    with pytest.raises(TrainStepFailed) as e:
        rl.train(batch)
    err = e.value
    assert err.applied_updates == (1 if warmup else 3) and err.weights_changed, err
    assert "critic" in str(err) and rl.step_idx == 1
    assert rl.actor.scheduler.last_epoch == (0 if warmup else 1)


def _dp_critic_optimizer_oom(rank: int, world: int, init: str, cfg: RLConfig) -> None:
    """One rank of a data-parallel critic update whose rank 1 runs out of memory in its second (last)
    optimizer step, having written nothing: every rank raises the same TrainOOM (one step applied, the
    second part-way over the group) from a CollectiveOOM, as the actor's optimizer step does."""
    import torch.distributed as dist
    from parallel_helpers import init_group
    from torch.distributed.device_mesh import init_device_mesh

    from rollplex.parallel.data_parallel import DataParallelCritic
    from rollplex.rl.optimizer import OptimizerStepOOM
    from rollplex.rl.placement import CollectiveOOM

    init_group(rank, world, init)
    try:
        critic = DataParallelCritic(ValueModel(tiny_model(tiny_cfg())), cfg, init_device_mesh("cpu", (world,)))
        real, calls = critic.optimizer.step, [0]

        def step():
            calls[0] += 1
            if rank == 1 and calls[0] == 2:
                raise OptimizerStepOOM(0, 1, False)
            real()

        critic.optimizer.step = step
        batch, _, _ = rollout_batch()
        returns = torch.randn(batch.responses.shape, generator=torch.Generator().manual_seed(1)) * batch.mask
        with pytest.raises(TrainOOM) as e:
            critic.update(batch, returns, critic.values(batch))
        err = e.value
        assert err.applied_updates == 1 and err.partial_update and isinstance(err.__cause__, CollectiveOOM), err
        assert calls[0] == 2 and "critic" in str(err)
        dist.barrier()  # the group is still in step
    finally:
        dist.destroy_process_group()


def test_data_parallel_ranks_agree_on_a_critic_optimizer_oom(tmp_path):
    spawn(_dp_critic_optimizer_oom, args=(2, f"file://{tmp_path}/store", GAE), nprocs=2)

