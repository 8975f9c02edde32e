"""Activation checkpointing applied from outside the model (rl/activation_checkpointing.py), on the tiny
model (CPU, fp32): the wrappers follow a deep copy of the model, so a reference or critic copied from a
policy that already runs checkpointed computes with its own layers, and a step built over such a policy
trains as one built over a fresh model."""

import copy

import torch
from test_critic import ROWS, _step, _weights

from rollplex.models import load_model
from rollplex.models.inputs import ModelInputs
from rollplex.rl.activation_checkpointing import activation_checkpointing, set_activation_checkpointing
from rollplex.rl.step import RLStep


def test_a_copy_of_a_checkpointed_model_runs_its_own_layers(tiny_dir):
    model = load_model(tiny_dir)
    set_activation_checkpointing(model, True, True)
    twin = copy.deepcopy(model)
    assert activation_checkpointing(twin) == (True, True)
    assert twin.model.layer.__self__ is twin.model and twin.visual.block.__self__ is twin.visual
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    plain = copy.deepcopy(twin)
    set_activation_checkpointing(plain, False, False)
    prompt = [ModelInputs(list(range(3, 15)))]
    out = twin(prompt)
    torch.testing.assert_close(out, plain(prompt), rtol=0, atol=0)  # the copy's weights, not the original's
    out.float().square().mean().backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None for p in twin.model.layers.parameters())


def test_a_step_built_over_a_checkpointed_policy_trains_as_one_built_first(tiny_dir, proc):
    """The first step turns checkpointing on for its policy; a second step built over that policy copies its
    reference and its critic from it. Both must train as a step built over a fresh model does."""
    first = _step(tiny_dir, proc, gradient_checkpointing=True, vision_gradient_checkpointing=True)
    assert activation_checkpointing(first.model) == (True, True)
    second = RLStep(first.model, first.engine, first.cfg, proc, reward_fn="shape_color")
    fresh = _step(tiny_dir, proc, gradient_checkpointing=True, vision_gradient_checkpointing=True)
    for _ in range(2):
        m_second, m_fresh = second.step(ROWS), fresh.step(ROWS)
        assert m_second["critic/vf_loss"] == m_fresh["critic/vf_loss"]
    for a, b in ((fresh.critic.model, second.critic.model), (fresh.model, second.model)):
        for (k, x), y in zip(_weights(a).items(), _weights(b).values()):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7, msg=k)
