"""The co-scheduler in the RL step (CPU, fp32, tiny model): prefix work admitted beside decode changes
where it runs, never what is computed. A step with it gives the same losses, gradients and updated
weights as `serial` (and as rollplex without it), with and without the frozen vision tower, with
several mini-batches (old-policy prefixes co-scheduled too)."""

import pytest
import torch
from helpers import FORWARD_TERMS, assert_fp32_close, assert_weights_close, capture_grads

from rollplex.cosched import CoschedConfig, PrefixJob, PrefixRows, Timeline
from rollplex.data import row_to_inputs
from rollplex.engine import Engine, EngineConfig
from rollplex.models import load_model
from rollplex.rl.config import RLConfig
from rollplex.rl.step import RLStep
from rollplex.tiny import shape_color

ROWS = shape_color.make_rows(6, seed=5)
# admit eagerly: on CPU the chunks run inline, so every loaded step is "slow"; the test is about exactness
EAGER = CoschedConfig(slowdown_bound=0.9, baseline_samples=1, initial_budget=50.0, max_chunk_ms=1e6,
                      max_in_flight=2, serial_after=1000, reprobe_every=0, job_prompts=2)


def _rl(tiny_dir, proc, cosched_cfg=None, **cfg):
    model = load_model(tiny_dir)
    engine = Engine(model, proc, EngineConfig(max_num_seqs=64, max_model_len=256))
    base = dict(n=3, max_new_tokens=12, lr=1e-4, kl_coef=0.05, micro_batch_prompts=2, micro_batch_samples=3)
    return RLStep(model, engine, RLConfig(**{**base, **cfg}), proc, reward_fn="shape_color", cosched=cosched_cfg)


def _run(rl: RLStep):
    grads = capture_grads(rl)
    batch = rl.rollout(ROWS)
    roll_m = dict(rl.rollout_metrics)
    batch.rewards = torch.tensor([float(i % 3 == 0) for i in range(batch.num_samples)])
    m = rl.train(batch)
    return m, roll_m, grads, {n: p.detach().clone() for n, p in rl.model.named_parameters()}, batch


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer\.step\(\)`")
@pytest.mark.parametrize("extra", [dict(), dict(freeze_vision_tower=True),
                                   dict(ppo_mini_batches=2, loss_agg_mode="seq-mean-token-mean")],
                         ids=["plain", "frozen_vision", "mini_batches"])
def test_cosched_step_equals_serial(tiny_dir, proc, extra):
    serial = _run(_rl(tiny_dir, proc, mode="serial", **extra))
    plain = _run(_rl(tiny_dir, proc, mode="rollplex", **extra))
    rl = _rl(tiny_dir, proc, EAGER, mode="rollplex", cosched=True, **extra)
    co = _run(rl)
    m, roll_m, grads, weights, batch = co
    # work really ran beside decode: chunks were admitted and the reference's prefix came from them
    assert roll_m["rollplex/cosched_chunks"] > 0 and roll_m["rollplex/prefix_hidden_s"] > 0
    assert roll_m["rollplex/cosched_jobs_waiting"] == 0
    if extra.get("ppo_mini_batches"):
        assert "rollplex/prefix_old_normal_phase_s" in m
    if extra.get("freeze_vision_tower"):
        assert all(p.vision_embeds is not None for p in batch.prompts)
        assert all(not p.requires_grad for p in rl.model.visual.parameters())
    for other in (serial, plain):
        om, _, og, ow, ob = other
        assert torch.equal(batch.responses, ob.responses)
        for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            assert_fp32_close(m[k], om[k], k, scale=1.0)  # means of O(1) terms that may cancel: relative to 1
        assert len(grads) == len(og)
        for a, b in zip(grads, og):
            assert a.keys() == b.keys()
            for name in a:
                assert_fp32_close(a[name], b[name], f"grad {name}")
        _assert_same_weights(weights, ow)


def _assert_same_weights(weights, want):
    for name in weights:
        assert_weights_close(weights[name], want[name], f"weight {name}")


def test_prefix_job_in_pieces_equals_prefix(tiny_dir, proc):
    """Units run in any chunking give exactly model.prefix; rows re-gathered across jobs too."""
    model = load_model(tiny_dir).eval()
    prompts = [row_to_inputs(proc, r) for r in ROWS[:3]]
    with torch.no_grad():
        want = model.prefix(prompts)
    rows = PrefixRows.plan(model, prompts, per_job=2, key="ref")
    a, b = rows.jobs
    a.run(0, 1)
    a.run(1, 3)
    with pytest.raises(ValueError, match="next unit"):
        a.run(5, 6)
    a.run(3, a.units)
    got = rows.select([2, 0, 1]).gather()  # b runs in its normal phase, inside gather
    assert b.done
    order = [2, 0, 1]
    for layer in range(len(want.keys)):
        for i, j in enumerate(order):
            n = int(want.lens[j])
            # (jobs batch fewer rows than the whole prefix: the matmuls may block their sums otherwise)
            assert_fp32_close(got.keys[layer][i, :, :n], want.keys[layer][j, :, :n], "keys", FORWARD_TERMS)
            assert_fp32_close(got.values[layer][i, :, :n], want.values[layer][j, :, :n], "values", FORWARD_TERMS)
    assert_fp32_close(got.last_hidden, want.last_hidden[order], "last hidden", FORWARD_TERMS)
    assert got.lens.tolist() == want.lens[order].tolist()


def test_timeline_trace(tiny_dir, proc, tmp_path):
    import json

    rl = _rl(tiny_dir, proc, EAGER, mode="rollplex", cosched=True)
    rl.timeline = Timeline(rl.device)
    rl.step(ROWS)
    trace = rl.timeline.write_trace(tmp_path / "t.json")
    events = json.loads(trace.read_text())["traceEvents"]
    lanes = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"phase", "decode", "cosched"} <= lanes
    names = [e["name"] for e in events if e["ph"] == "X"]
    assert "gen" in names and "ref" in names and "update_actor" in names
    assert any(n.startswith("ref/") for n in names)
    pytest.importorskip("matplotlib")
    assert rl.timeline.plot(tmp_path / "t.png").stat().st_size > 0


def test_oom_in_a_chunk_backs_off_and_stays_exact(tiny_dir, proc, monkeypatch):
    """A chunk that runs out of memory part-way: its finished units stay done, the rest goes back to the
    queue, the controller backs off, and the step's result does not change."""
    plain = _run(_rl(tiny_dir, proc, mode="rollplex"))
    rl = _rl(tiny_dir, proc, EAGER, mode="rollplex", cosched=True)
    real = PrefixJob._unit
    calls = {"n": 0}

    def flaky(self, u):
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(self, u)

    monkeypatch.setattr(PrefixJob, "_unit", flaky)
    m, roll_m, _, weights, _ = _run(rl)
    assert roll_m["rollplex/cosched_ooms"] == 1
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert_fp32_close(m[k], plain[0][k], k, scale=1.0)
    _assert_same_weights(weights, plain[3])


@pytest.mark.parametrize("lens", [[5, 1, 3, 5, 2], [1, 1, 1, 1, 1]])
def test_packed_responses_over_a_given_prefix_equal_group_hidden(tiny_dir, proc, lens):
    """Responses packed with no padding over prefix rows made earlier == the one packed pass."""
    model = load_model(tiny_dir).eval()
    prompts = [row_to_inputs(proc, r) for r in ROWS[:3]]
    group = [0, 2, 1, 0, 2]
    g = torch.Generator().manual_seed(0)
    resp = torch.randint(0, 200, (5, 5), generator=g)
    with torch.no_grad():
        want = model.group_hidden(prompts, resp, lens, group)
        got = model.prefix_group_hidden(model.prefix(prompts), resp, lens, group)
    assert_fp32_close(got, want, "packed hidden states", FORWARD_TERMS)


def test_a_claimed_job_never_runs_a_unit_twice(tiny_dir, proc, monkeypatch):
    """A consumer claims a job the hook has run part of, between the step that admitted its next chunk and
    that chunk's launch: the chunk is dropped, the consumer runs the rest, the hook never runs a unit of it
    again (it goes on with the other job), and the accounting counts the claimed work apart."""
    from types import SimpleNamespace

    from rollplex.cosched import CoScheduler

    model = load_model(tiny_dir).eval()
    prompts = [row_to_inputs(proc, r) for r in ROWS[:4]]
    with torch.no_grad():
        want = model.prefix(prompts[:2])
    a, b = PrefixRows.plan(model, prompts, per_job=2, key="ref").jobs
    runs: dict[tuple[str, int], int] = {}
    unit = PrefixJob._unit

    def counted(self, u):
        runs[self.key, u] = runs.get((self.key, u), 0) + 1
        return unit(self, u)

    monkeypatch.setattr(PrefixJob, "_unit", counted)
    one_unit = CoschedConfig(slowdown_bound=0.9, baseline_samples=1, initial_budget=50.0, max_chunk_ms=1e-9,
                             max_in_flight=1, serial_after=1000, reprobe_every=0)
    sched = CoScheduler(one_unit, torch.device("cpu"))
    sched.begin([(a, 0), (b, 1)])
    info = lambda s: SimpleNamespace(step=s, batch_size=4, last_period_ms=None if s == 0 else 10.0)  # noqa: E731
    s = 0
    while a.next_unit < 2:  # one unit per step once the baseline is measured
        sched.on_decode_step(info(s))
        sched.after_decode_launch(info(s))
        s += 1
    sched.on_decode_step(info(s))  # admits a's next unit ...
    assert sched.claim([a]) == []  # ... which the claim drops before its launch (CPU: nothing in flight)
    sched.after_decode_launch(info(s))
    assert a.next_unit == 2
    state = a.complete()  # the consumer runs the rest
    for t in range(s + 1, s + 3 * b.units):
        sched.on_decode_step(info(t))
        sched.after_decode_launch(info(t))
    assert b.done
    m = sched.finish()
    assert runs == {**{("ref/0", u): 1 for u in range(a.units)}, **{("ref/1", u): 1 for u in range(b.units)}}
    assert m["rollplex/cosched_jobs_claimed"] == 1 and m["rollplex/prefix_claimed_s"] > 0
    assert m["rollplex/prefix_hidden_s"] + m["rollplex/prefix_claimed_s"] + m["rollplex/prefix_left_s"] + \
        m["rollplex/prefix_in_flight_s"] == pytest.approx(m["rollplex/prefix_total_s"])
    assert_fp32_close(state.last_hidden, want.last_hidden, "last hidden", FORWARD_TERMS)
