"""DAPO: overlong reward shaping against numbers worked out by hand; dynamic sampling (filter_groups) on the
tiny model drops the groups whose rewards are all equal, rolls out more rows to fill the step, trims it,
stops at max_num_gen_batches and reports train/num_gen_batches; the options' checks; a short demo run."""

import itertools
import json
from dataclasses import replace

import pytest
import torch

from rollplex.engine import Engine, EngineConfig
from rollplex.models import ModelInputs, load_model
from rollplex.rl import dynamic_sampling
from rollplex.rl.batch import RolloutBatch
from rollplex.rl.config import RLConfig
from rollplex.rl.rewards import overlong_penalty, score_batch
from rollplex.rl.step import RLStep
from rollplex.tiny import shape_color

ROWS = shape_color.make_rows(16, seed=5)


# ---- overlong reward shaping ----------------------------------------------------------------------
def test_overlong_penalty_by_hand():
    # max_new_tokens 10, buffer 4: nothing up to 6 tokens, then -1/4 per token down to -1 at 10
    assert overlong_penalty([3, 6, 7, 8, 10], 10, 4, 1.0) == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty([3, 6, 7, 8, 10], 10, 4, 0.5) == [0.0, 0.0, -0.125, -0.25, -0.5]
    assert overlong_penalty([1, 10], 10, 10, 2.0) == [-0.2, -2.0]  # a buffer of everything: -2/10 per token
    assert overlong_penalty([3, 10], 10, 0, 1.0) == [0.0, 0.0]  # off
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_penalty([3], 10, 11, 1.0)


def _batch(lengths: list[int], group: list[int]) -> RolloutBatch:
    prompts = [ModelInputs(input_ids=[1, 2])] * (max(group) + 1)
    n = len(lengths)
    return RolloutBatch.from_samples(prompts, group, [[5] * k for k in lengths], pad_id=0, texts=["x"] * n,
                                     data_sources=["d"] * n, ground_truths=["g"] * n, extra_infos=[None] * n)


def test_score_batch_adds_the_penalty_to_the_score():
    batch = _batch([3, 6, 7, 8, 10], [0, 0, 0, 1, 1])

    def reward(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 1.0, "acc": 1.0}

    scores, rewards, m = score_batch(reward, batch, max_new_tokens=10, overlong_buffer_len=4,
                                     overlong_penalty_factor=1.0)
    assert scores == [1.0] * 5
    assert rewards.tolist() == [1.0, 1.0, 0.75, 0.5, 0.0] and rewards.dtype == torch.float32
    # verl's reward_extra_info names: the mean penalty, and the share of responses penalised
    assert m == {"critic/score/acc": 1.0, "critic/score/overlong_reward": -1.75 / 5, "critic/score/overlong": 3 / 5}
    scores, rewards, m = score_batch(reward, batch, max_new_tokens=10)  # off: the scores, no overlong metrics
    assert rewards.tolist() == [1.0] * 5 and m == {"critic/score/acc": 1.0}


def test_options_are_checked():
    for bad in (dict(overlong_buffer_len=-1), dict(overlong_buffer_len=65, max_new_tokens=64),
                dict(overlong_penalty_factor=-0.1), dict(overlong_penalty_factor=float("nan")),
                dict(max_num_gen_batches=-1), dict(filter_groups_metric="not a key")):
        with pytest.raises(ValueError):
            RLConfig(**bad)
    # DAPO's recipe is reachable: clip-higher, token-mean, no KL
    cfg = RLConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="token-mean", use_kl_loss=False,
                   kl_coef=0.0, filter_groups=True, max_num_gen_batches=10, overlong_buffer_len=64,
                   max_new_tokens=64)
    assert cfg.filter_groups and cfg.overlong_penalty_factor == 1.0 and cfg.filter_groups_metric == "seq_reward"


# ---- dynamic sampling: the pieces ------------------------------------------------------------------
def test_kept_groups():
    values = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.5, 5.0, 0.3, 0.3])
    group = torch.tensor([0, 0, 1, 1, 2, 2, 2, 3, 4, 4])
    # group 1 differs; group 3 has one sample (kept, as verl keeps it); 0, 2 and 4 are all equal
    assert dynamic_sampling.kept_groups(values, group, 5) == [1, 3]


def test_concat_repads_and_offsets_the_groups():
    a, b = _batch([2, 3], [0, 0]), _batch([4, 1, 1], [0, 1, 1])
    a.rewards, b.rewards = torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.25, 0.0])
    c = RolloutBatch.concat([a, b], pad_id=7)
    assert c.num_prompts == 3 and c.group.tolist() == [0, 0, 1, 2, 2]
    assert c.responses.shape == (5, 4) and c.responses[0].tolist() == [5, 5, 0, 7]  # its own padding, then pad_id
    assert c.mask.sum(-1).tolist() == [2, 3, 4, 1, 1] and c.rewards.tolist() == [1.0, 0.0, 0.5, 0.25, 0.0]
    assert c.extras["texts"] == ["x"] * 5 and c.rollout_logprobs is None


# ---- dynamic sampling in the RL step ------------------------------------------------------------
def _rows(vary: set[int], start: int, count: int) -> list[dict]:
    """`count` rows from ROWS[start:]; the reward below gives the rows whose index is in `vary` differing
    scores within their group, every other row 1.0 for all its samples."""
    return [dict(r, extra_info={**r["extra_info"], "vary": r["extra_info"]["index"] in vary})
            for r in ROWS[start:start + count]]


def _reward():
    calls = itertools.count()

    def reward(data_source, solution_str, ground_truth, extra_info=None):
        return float(next(calls) % 2) if extra_info["vary"] else 1.0  # n = 2: one 0 and one 1 per varied group

    return reward


def _step(tiny_dir, proc, **cfg) -> tuple[RLStep, list]:
    model = load_model(tiny_dir)
    engine = Engine(model, proc, EngineConfig(max_num_seqs=64, max_model_len=256))
    cfg = RLConfig(**{**dict(n=2, max_new_tokens=3, lr=1e-3, kl_coef=0.0, micro_batch_prompts=8,
                             filter_groups=True), **cfg})
    rl = RLStep(model, engine, cfg, proc, reward_fn=_reward())
    trained, train = [], rl.train

    def record(batch, *a, **kw):  # the real update, on the batch the step hands it
        trained.append(batch)
        return train(batch, *a, **kw)

    rl.train = record
    return rl, trained


def _ids(batch: RolloutBatch) -> list[int]:
    """The row index of each group, in the batch's order."""
    return [batch.extras["extra_infos"][batch.group.tolist().index(g)]["index"] for g in range(batch.num_prompts)]


def test_dynamic_sampling_fills_the_batch_and_trims_it(tiny_dir, proc):
    rl, trained = _step(tiny_dir, proc)
    vary = {0, 1, 2, 4, 5, 6}
    more = iter([_rows(vary, 4, 4), _rows(vary, 8, 4)])
    m = rl.step(_rows(vary, 0, 4), more_rows=lambda: next(more))
    # rows 0-3 keep 0, 1, 2 (3 gives every sample 1.0); rows 4-7 keep 4, 5, 6: six kept, trimmed to four
    assert m["train/num_gen_batches"] == 2 and m["train/num_groups_kept"] == 6 and m["train/num_groups_dropped"] == 2
    (batch,) = trained
    assert _ids(batch) == [0, 1, 2, 4] and batch.num_samples == 8
    assert batch.rewards.view(4, 2).sum(-1).tolist() == [1.0] * 4  # one 0 and one 1 per kept group
    assert rl.step_idx == 1 and next(more)[0]["extra_info"]["index"] == 8  # the third rollout was not needed
    assert m["critic/score/mean"] == 0.5 and m["timing_s/gen"] > 0


def test_dynamic_sampling_stops_at_the_bound(tiny_dir, proc):
    rl, trained = _step(tiny_dir, proc, max_num_gen_batches=2)
    calls = []

    def more():
        calls.append(1)
        return _rows(set(), 2 * len(calls), 2)

    with pytest.raises(ValueError, match=r"kept 1 of the 2 groups .* after 2 rollouts \(max_num_gen_batches=2\)"):
        rl.step(_rows({0}, 0, 2), more_rows=more)
    assert len(calls) == 1 and not trained and rl.step_idx == 0  # two rollouts, nothing trained
    with pytest.raises(ValueError, match="pass more_rows"):  # no more rows: the one rollout is the bound
        rl.step(_rows({0}, 0, 2))
    # filter_groups_partial trains on the groups kept instead
    rl.cfg = replace(rl.cfg, filter_groups_partial=True)
    m = rl.step(_rows({0}, 0, 4), more_rows=lambda: _rows({5}, 4, 4))
    assert m["train/num_gen_batches"] == 2 and m["train/num_groups_kept"] == 2 and _ids(trained[0]) == [0, 5]
    # the metric "score" is the reward function's score: a constant one keeps nothing, whatever the shaping
    rl.cfg = replace(rl.cfg, filter_groups_metric="score", overlong_buffer_len=2)
    with pytest.raises(ValueError, match="kept 0 of the 2 groups"):
        rl.step(_rows(set(), 0, 2))


def test_dynamic_sampling_filters_by_a_key_the_reward_returns(tiny_dir, proc):
    """filter_groups_metric="acc" (verl's DAPO recipes): the groups whose samples all have the same `acc` are
    dropped even where their scores differ; a key the reward function does not return is a ValueError."""
    calls = itertools.count()

    def reward(data_source, solution_str, ground_truth, extra_info=None):
        k = next(calls) % 2  # n = 2: the group's two samples get k = 0 and 1
        acc = float(k) if extra_info["vary"] else 1.0
        return {"score": 0.9 * acc + 0.1 * k, "acc": acc, "format": float(k)}

    rl, trained = _step(tiny_dir, proc, filter_groups_metric="acc", filter_groups_partial=True, max_num_gen_batches=1)
    rl.reward_fn = reward
    m = rl.step(_rows({0, 2}, 0, 4))
    assert m["train/num_groups_kept"] == 2 and _ids(trained[-1]) == [0, 2]  # by score all four would stay
    assert m["critic/score/acc"] == pytest.approx(0.75)
    assert [d["acc"] for d in trained[-1].extras["reward_extra_info"]] == [0.0, 1.0, 0.0, 1.0]
    rl.cfg = replace(rl.cfg, filter_groups_metric="score")
    assert rl.step(_rows({0, 2}, 0, 4))["train/num_groups_kept"] == 4
    rl.cfg = replace(rl.cfg, filter_groups_metric="pass_at_1")
    with pytest.raises(ValueError, match=r"pass_at_1.*\['acc', 'format'\]"):
        rl.step(_rows({0, 2}, 0, 4))


def test_later_rollouts_of_a_step_draw_fresh_samples(tiny_dir, proc):
    rl, _ = _step(tiny_dir, proc, max_new_tokens=6)
    first, again, second = (dynamic_sampling._rollout(rl, ROWS[:4], k) for k in (0, 0, 1))
    assert torch.equal(first.responses, again.responses)  # the step's own rollout: seeded as without filtering
    assert not torch.equal(first.responses, second.responses)


def test_demo_with_dynamic_sampling(tmp_path, tiny_dir):
    from rollplex.demo.train import main

    out = tmp_path / "demo"
    main(["--model", str(tiny_dir), "--steps", "2", "--target", "2", "--prompts", "2", "--n", "4",
          "--warmup-steps", "1", "--filter-groups", "--clip-ratio-high", "0.28",
          "--overlong-buffer-len", "1", "--out", str(out)])
    history = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(history) == 2
    for h in history:  # every step filled its 2 groups, from as many rollouts as that took
        assert h["train/num_groups_kept"] >= 2 and h["rollplex/prefix_dedup_ratio"] == 4
        assert h["train/num_gen_batches"] >= 1 and "critic/score/overlong" in h
    assert any(h["train/num_groups_dropped"] > 0 and h["train/num_gen_batches"] > 1 for h in history)


def test_server_flags_and_overrides(monkeypatch):
    from pydantic import ValidationError

    from rollplex.server.__main__ import config_from_args, parser
    from rollplex.server.schemas import TrainStepRequest

    monkeypatch.delenv("ROLLPLEX_API_KEY", raising=False)
    ap = parser()
    cfg = config_from_args(ap.parse_args([
        "--device", "cpu", "--clip-ratio-high", "0.28", "--no-use-kl-loss", "--kl-coef", "0", "--overlong-buffer-len",
        "16", "--overlong-penalty-factor", "0.5", "--filter-groups", "--filter-groups-metric", "score"]))
    assert cfg.rl == RLConfig(max_new_tokens=128, clip_ratio_high=0.28, use_kl_loss=False, kl_coef=0.0,
                              overlong_buffer_len=16, overlong_penalty_factor=0.5, filter_groups=True,
                              filter_groups_metric="score")
    for flag in ("--max-num-gen-batches", "--filter-groups-partial"):  # a server rolls out nothing itself
        with pytest.raises(SystemExit):
            ap.parse_args([flag, "1"] if flag == "--max-num-gen-batches" else [flag])
    req = TrainStepRequest(rollout_id="r", reward="x", overlong_buffer_len=8, overlong_penalty_factor=2.0,
                           filter_groups=True, filter_groups_metric="score")
    assert replace(RLConfig(), **req.overrides()) == RLConfig(overlong_buffer_len=8, overlong_penalty_factor=2.0,
                                                              filter_groups=True, filter_groups_metric="score")
    for bad in (dict(overlong_buffer_len=-1), dict(overlong_penalty_factor=10.5), dict(max_num_gen_batches=2)):
        with pytest.raises(ValidationError):
            TrainStepRequest(rollout_id="r", reward="x", **bad)


def test_server_filters_by_a_key_its_reward_returns():
    """/train_step's filter (the server scored the rewards): a key of the reward's dict, e.g. acc; rewards a
    client sent have no such key (400)."""
    from fastapi import HTTPException

    from rollplex.models import ModelInputs
    from rollplex.server.routes_rl import _filter_groups
    from rollplex.server.store import RetainedRollout

    prompts = [ModelInputs(input_ids=[1, 2]) for _ in range(3)]
    batch = RolloutBatch.from_samples(prompts, [0, 0, 1, 1, 2, 2], [[5]] * 6, pad_id=0)
    batch.extras["reward_extra_info"] = [{"acc": a} for a in (0.0, 1.0, 1.0, 1.0, 1.0, 0.0)]
    scores = [0.1, 1.0, 0.9, 1.0, 1.0, 0.0]  # group 1 differs in score, not in acc
    entry = RetainedRollout(batch, temperature=1.0, gen_s=0.0)
    kept, rewards, m = _filter_groups(entry, scores, scores, "acc", None, 1)
    assert kept.batch.num_prompts == 2 and rewards == [0.1, 1.0, 1.0, 0.0] and m["train/num_groups_dropped"] == 1
    assert _filter_groups(entry, scores, scores, "score", None, 1)[0].batch.num_prompts == 3
    del batch.extras["reward_extra_info"]
    with pytest.raises(HTTPException, match="filter_groups: .*only a score"):
        _filter_groups(entry, scores, scores, "acc", None, 1)
