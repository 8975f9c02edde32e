"""ReMax (adv_estimator="remax"): the engine's greedy continuation beside a request's samples, the
estimator on hand-computed values, and the whole step with the greedy response rolled out in the same
call — serial == rollplex, and the fused schedule equal to phased."""

import pytest
import torch
from helpers import assert_fp32_close, capture_grads

from rollplex.engine import Engine, EngineConfig, SamplingParams
from rollplex.models import load_model
from rollplex.rl.algos import compute_advantages
from rollplex.rl.batch import RolloutBatch
from rollplex.rl.config import RLConfig
from rollplex.rl.rollout import rollout_requests
from rollplex.rl.step import RLStep
from rollplex.tiny import shape_color

ROWS = shape_color.make_rows(4, seed=3)


def test_engine_decodes_a_greedy_continuation_beside_the_samples(tiny_dir, proc):
    engine = Engine(load_model(tiny_dir), proc, EngineConfig(max_num_seqs=16, max_model_len=256))
    prompts, params, _ = rollout_requests(proc, ROWS[:2], RLConfig(n=3, max_new_tokens=6), 0)
    with_greedy = engine.generate(prompts, [SamplingParams(**{**p.__dict__, "n_greedy": 1}) for p in params])
    plain = engine.generate(prompts, params)
    greedy = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=6))
    for a, b, g in zip(with_greedy, plain, greedy):
        assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]  # the samples are unchanged
        assert len(a.greedy) == 1 and a.greedy[0].token_ids == g.samples[0].token_ids
        assert a.greedy[0].logprobs == pytest.approx(g.samples[0].logprobs, abs=1e-5)
        assert b.greedy == []
    with pytest.raises(ValueError, match="n_greedy"):
        SamplingParams(n_greedy=-1)


def test_remax_advantages_by_hand():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    scores, group = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    adv, rewards = compute_advantages("remax", scores, group, mask, baselines=torch.tensor([0.25, 0.25]))
    # the reward-to-go of each token (the reward at the last one) minus the greedy response's reward
    assert torch.allclose(adv, torch.tensor([[0.75, 0.75, 0.0], [-0.25, 0.0, 0.0]]))
    assert rewards.tolist() == [1.0, 0.0]
    penalty = torch.full((2, 3), 0.1)  # a KL-in-reward penalty enters the returns, as verl's token_level_rewards
    adv, _ = compute_advantages("remax", scores, group, mask, penalty, baselines=torch.tensor([0.25, 0.25]))
    assert torch.allclose(adv, torch.tensor([[0.55, 0.65, 0.0], [-0.35, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="greedy"):
        compute_advantages("remax", scores, group, mask)


def test_batches_keep_the_greedy_responses_and_baselines():
    from rollplex.models import ModelInputs
    from rollplex.rl.remax import set_baselines

    prompts = [ModelInputs(input_ids=[1, 2]) for _ in range(2)]
    b = RolloutBatch.from_samples(prompts, [0, 0, 1, 1], [[5], [6, 7], [8], [9]], pad_id=0)
    b.greedy = RolloutBatch.from_samples(prompts, [0, 1], [[3], [4, 4]], pad_id=0)
    set_baselines(b, torch.tensor([0.5, 2.0]))
    assert b.baselines.tolist() == [0.5, 0.5, 2.0, 2.0]
    sub, _ = b.select_prompts([1])
    assert sub.baselines.tolist() == [2.0, 2.0] and sub.greedy.responses.tolist() == [[4, 4]]
    both = RolloutBatch.concat([sub, b], pad_id=0)
    assert both.baselines.tolist() == [2.0, 2.0, 0.5, 0.5, 2.0, 2.0] and both.greedy.num_samples == 3
    with pytest.raises(ValueError, match="one greedy reward per prompt"):
        set_baselines(b, torch.tensor([1.0]))


def _step(tiny_dir, proc, **cfg):
    model = load_model(tiny_dir)
    engine = Engine(model, proc, EngineConfig(max_num_seqs=64, max_model_len=256))
    base = dict(n=4, max_new_tokens=6, lr=1e-4, kl_coef=0.05, micro_batch_prompts=2, micro_batch_samples=3,
                adv_estimator="remax")
    return RLStep(model, engine, RLConfig(**{**base, **cfg}), proc, reward_fn=_reward)


def _reward(data_source, solution_str, ground_truth, extra_info=None):
    """Varied rewards on the random tiny model (the option letter alone is at chance): the text's length."""
    return len(solution_str) % 3 / 2


@pytest.mark.parametrize("other", [dict(mode="serial"), dict(schedule="fused")], ids=["serial", "fused"])
def test_remax_step_equals_across_modes_and_schedules(tiny_dir, proc, other):
    """The greedy response is rolled out in the same call in every mode; the whole step (rollout, rewards of
    samples and greedy responses, baselines, update) gives the same update as rollplex / phased."""
    runs = {}
    for name, kw in (("ref", {}), ("other", other)):
        rl = _step(tiny_dir, proc, **kw)
        grads = capture_grads(rl)
        prompts, params, per = rollout_requests(proc, ROWS, rl.cfg, 0)
        assert all(p.n_greedy == 1 for p in params)
        batch, m = rl.run(prompts, params, **per)
        runs[name] = (batch, m, grads)
    (b1, m1, g1), (b2, m2, g2) = runs["ref"], runs["other"]
    assert b1.greedy.num_samples == 4 and b1.num_samples == 16
    assert torch.equal(b1.responses, b2.responses) and torch.equal(b1.baselines, b2.baselines)
    assert torch.equal(b1.greedy.responses, b2.greedy.responses)
    assert b1.baselines.unique().numel() > 1 or b1.rewards.unique().numel() > 1  # not a trivial batch
    if "schedule" in other:
        assert m2["rollplex/fused"] == 1.0
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/advantages/mean"):
        assert_fp32_close(m1[k], m2[k], k, scale=1.0)
    assert float(m1["actor/grad_norm"]) > 0
    for a, b in zip(g1, g2):
        for name in a:
            assert_fp32_close(a[name], b[name], f"grad {name}")
