"""A failed request changes nothing, or says exactly what changed: failures injected into the real
objects of one in-process server (the tiny model, CPU, fp32), then the fingerprint compared.

The fingerprint is GET /checksum (weights and optimizer checksums, global step, weights version,
LR-schedule step, retained rollouts) and, in this process, the exact tensors behind it. Injected:
out of memory in reference / old-logprob scoring (backed off, then at one prompt), in micro-batch j of
the first mini-batch, in mini-batch k of 2, inside optimizer chunk c of MasterAdamW; a non-finite loss
and a non-finite gradient; unbounded overrides and rewards (given and computed); /save onto the root
or an existing checkpoint; /load of a checkpoint with each file missing, truncated, garbage or off
(names, shapes, dtypes, non-finite values). After each, the retained rollout still trains.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from parallel_helpers import spawn
from safetensors.torch import load_file, save_file

from rollplex.engine import EngineConfig
from rollplex.rl import actor as actor_mod
from rollplex.rl import scoring as scoring_mod
from rollplex.rl.activation_checkpointing import set_activation_checkpointing
from rollplex.rl.config import RLConfig
from rollplex.server import ServerConfig, serve_in_thread

REWARDS = [1.0, 0.0, 0.0, 1.0]
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]  # token-id prompts: no vision pass, a fast step


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    rl = RLConfig(n=2, lr=1e-3, kl_coef=0.05, max_new_tokens=4, micro_batch_prompts=4, micro_batch_samples=8)
    cfg = ServerConfig(model=str(tiny_dir), device="cpu", rl=rl,
                       engine=EngineConfig(max_model_len=128, kv_cache_tokens=2048, max_num_seqs=16),
                       checkpoint_root=str(tmp_path_factory.mktemp("atomic-ckpt")))
    srv = serve_in_thread(cfg)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        ok = c.post("/train_step", json={"rollout_id": _rollout(c), "rewards": REWARDS})  # AdamW has moments
        assert ok.status_code == 200, ok.text
        yield c


def _rollout(c) -> str:
    r = c.post("/rollout", json={"prompts": [{"input_ids": p} for p in PROMPTS], "n": 2})
    assert r.status_code == 200, r.text
    return r.json()["rollout_id"]


def _train(c, rid, **kw) -> httpx.Response:
    return c.post("/train_step", json={"rollout_id": rid, "rewards": REWARDS, **kw})


def _snapshot(server, c) -> dict:
    """/checksum, and the exact tensors and counters it stands for."""
    st = server.state
    opt = st.rl.actor.optimizer
    return {"http": c.get("/checksum").json(),
            "weights": [p.detach().clone() for p in st.model.parameters()],
            "optimizer": [t.detach().clone() for t in opt.state_tensors()],
            "adam_steps": [float(s["step"]) for s in opt.opt.state.values() if "step" in s]}


def _assert_same(a: dict, b: dict) -> None:
    assert a["http"] == b["http"]
    assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"], strict=True))
    assert all(torch.equal(x, y) for x, y in zip(a["optimizer"], b["optimizer"], strict=True))
    assert a["adam_steps"] == b["adam_steps"]


def _assert_partial(before: dict, after: dict, rid: str, applied_sched_steps: int) -> None:
    """What a step that failed after writing weights leaves: global step, weights version and the LR schedule
    counted, the rollout retained (stale)."""
    h0, h1 = before["http"], after["http"]
    assert h1["global_step"] == h0["global_step"] + 1 and h1["weights_version"] == h0["weights_version"] + 1
    assert h1["lr_schedule_step"] == h0["lr_schedule_step"] + applied_sched_steps
    assert h1["weights_checksum"] != h0["weights_checksum"] and rid in h1["retained_rollouts"]


def _oom(*a, **k):
    raise torch.OutOfMemoryError("CUDA out of memory (injected)")


def _error(r) -> str:
    return r.json()["error"]["message"]


# ---- scoring --------------------------------------------------------------------------------------
@pytest.mark.parametrize("what", ["reference", "old-logprob"])
def test_scoring_oom_backs_off_then_fails_with_nothing_changed(server, client, monkeypatch, what):
    st = server.state
    scored = st.rl.ref if what == "reference" else st.model
    extra = {} if what == "reference" else {"ppo_epochs": 2}  # several updates: old logprobs are scored
    real = scoring_mod.token_logprobs

    def big_oom(model, mb, *a, **k):  # only passes of more than one prompt run out of memory
        if model is scored and mb.num_prompts > 1:
            _oom()
        return real(model, mb, *a, **k)

    monkeypatch.setattr(scoring_mod, "token_logprobs", big_oom)
    r = _train(client, _rollout(client), **extra)
    assert r.status_code == 200, r.text
    assert st.rl.actor.score_backoff.cap.prompts == 1  # halved, kept for later steps
    st.rl.actor.score_backoff.cap = None

    rid = _rollout(client)
    before = _snapshot(server, client)
    monkeypatch.setattr(scoring_mod, "token_logprobs",
                        lambda model, *a, **k: _oom() if model is scored else real(model, *a, **k))
    r = _train(client, rid, **extra)
    assert r.status_code == 507, r.text
    msg = _error(r)
    assert f"{what} scoring ran out of device memory at one prompt" in msg and "unchanged" in msg, msg
    _assert_same(before, _snapshot(server, client))
    st.rl.actor.score_backoff.cap = None
    monkeypatch.undo()
    assert _train(client, rid, **extra).status_code == 200  # still retained, still on-policy


# ---- the update -----------------------------------------------------------------------------------
@pytest.mark.parametrize("j", [0, 1])
def test_oom_in_micro_batch_j_of_the_first_mini_batch_changes_nothing(server, client, monkeypatch, j):
    st = server.state
    real = actor_mod.token_logprobs

    def oom_at_j(model, mb, *a, **k):  # the pass holding prompt j, at every micro-batch size
        if any(p.input_ids == PROMPTS[j] for p in mb.prompts):
            _oom()
        return real(model, mb, *a, **k)

    rid = _rollout(client)
    before = _snapshot(server, client)
    monkeypatch.setattr(actor_mod, "token_logprobs", oom_at_j)
    r = _train(client, rid, micro_batch_prompts=1)  # micro-batch j is prompt j
    assert r.status_code == 507 and "unchanged" in _error(r) and "retained" in _error(r), r.text
    _assert_same(before, _snapshot(server, client))
    monkeypatch.undo()
    set_activation_checkpointing(st.model, False, False)  # the last rung it took
    st.rl.actor._backoff = None
    assert _train(client, rid).status_code == 200


@pytest.mark.parametrize("k", [1, 2])
def test_oom_in_mini_batch_k_of_2(server, client, monkeypatch, k):
    """Mini-batch 1: nothing applied, nothing changed. Mini-batch 2: one optimizer step applied, and the
    answer, global step, LR schedule and weights version say so; the rollout then trains off-policy only."""
    st = server.state
    opt = st.rl.actor.optimizer
    steps = [0]
    real_step, real_lp = opt.step, actor_mod.token_logprobs

    def counting_step():
        real_step()
        steps[0] += 1

    def oom_after(model, mb, *a, **kw):
        if steps[0] >= k - 1:
            _oom()
        return real_lp(model, mb, *a, **kw)

    rid = _rollout(client)
    before = _snapshot(server, client)
    monkeypatch.setattr(opt, "step", counting_step)
    monkeypatch.setattr(actor_mod, "token_logprobs", oom_after)
    r = _train(client, rid, ppo_mini_batches=2)
    monkeypatch.undo()
    set_activation_checkpointing(st.model, False, False)
    st.rl.actor._backoff = None
    assert r.status_code == 507, r.text
    msg, after = _error(r), _snapshot(server, client)
    if k == 1:
        assert "unchanged" in msg, msg
        _assert_same(before, after)
        assert _train(client, rid).status_code == 200
        return
    assert "1 optimizer step(s) of this train step were applied" in msg and "stale" in msg, msg
    assert "unchanged" not in msg
    _assert_partial(before, after, rid, applied_sched_steps=1)
    assert f"global_step is now {after['http']['global_step']}" in msg
    assert _train(client, rid).status_code == 409  # sampled before the weights it changed
    assert _train(client, rid, off_policy=True).status_code == 200


@pytest.mark.parametrize("c", [0, 1])
def test_oom_inside_optimizer_chunk_c(server, client, monkeypatch, c):
    """AdamW runs out of memory after updating chunk c (of 3): chunks up to c changed, the rest did not,
    and the answer says so (never 'unchanged')."""
    st = server.state
    opt = st.rl.actor.optimizer
    names = [n for n, _ in st.model.named_parameters()]
    text = [i for i, n in enumerate(names) if not n.startswith("visual.")]  # what token-id prompts train
    third = len(text) // 3
    chunks = [sorted(set(range(len(names))) - set(text[third:])), text[third:2 * third], text[2 * third:]]
    monkeypatch.setattr(opt, "chunks", chunks)
    calls = [0]
    real = opt.opt.step

    def torn_step(*a, **k):
        real(*a, **k)  # chunk c is written, then its temporaries run out
        calls[0] += 1
        if calls[0] == c + 1:
            _oom()

    rid = _rollout(client)
    before = _snapshot(server, client)
    monkeypatch.setattr(opt.opt, "step", torn_step)
    r = _train(client, rid)
    monkeypatch.undo()
    assert r.status_code == 507, r.text
    msg, after = _error(r), _snapshot(server, client)
    assert f"({c} of 3 parameter chunks updated, the next one possibly in part)" in msg and "unchanged" not in msg
    _assert_partial(before, after, rid, applied_sched_steps=1)
    for i, (x, y) in enumerate(zip(before["weights"], after["weights"])):
        written = any(i in chunk for chunk in chunks[: c + 1]) and i in text
        assert torch.equal(x, y) != written, names[i]
    assert _train(client, rid, off_policy=True).status_code == 200


class NanGrad(torch.autograd.Function):
    """Identity forward, NaN gradient: a finite loss whose gradients are not."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


@pytest.mark.parametrize("where", ["loss", "grad", "mini-batch 2"])
def test_non_finite_loss_or_gradient_is_422(server, client, monkeypatch, where):
    st = server.state
    opt = st.rl.actor.optimizer
    real = actor_mod.ppo_policy_loss
    steps = [0]
    real_step = opt.step

    def counting_step():
        real_step()
        steps[0] += 1

    def bad_loss(logp, *a, **k):
        if where == "grad":
            return real(NanGrad.apply(logp), *a, **k)
        pg, *rest = real(logp, *a, **k)
        return (pg * float("nan") if where == "loss" or steps[0] >= 1 else pg), *rest

    rid = _rollout(client)
    before = _snapshot(server, client)
    monkeypatch.setattr(opt, "step", counting_step)
    monkeypatch.setattr(actor_mod, "ppo_policy_loss", bad_loss)
    r = _train(client, rid, **({"ppo_mini_batches": 2} if where == "mini-batch 2" else {}))
    monkeypatch.undo()
    assert r.status_code == 422, r.text
    msg, after = _error(r), _snapshot(server, client)
    assert "non-finite" in msg and ("actor/grad_norm" if where == "grad" else "actor/pg_loss") in msg, msg
    if where != "mini-batch 2":
        assert "mini-batch 1 of 1" in msg and "unchanged" in msg, msg
        _assert_same(before, after)
        assert _train(client, rid).status_code == 200
        return
    assert "mini-batch 2 of 2" in msg and "1 optimizer step(s)" in msg, msg
    _assert_partial(before, after, rid, applied_sched_steps=1)  # the skipped step did not move the schedule
    assert _train(client, rid, off_policy=True).status_code == 200


# ---- request bounds -------------------------------------------------------------------------------
def test_overrides_and_rewards_are_bounded(server, client, monkeypatch):
    rid = _rollout(client)
    before = _snapshot(server, client)
    bad = [({"lr": 1000}, "lr"), ({"lr": 0.011}, "lr"), ({"clip_ratio_low": 2}, "clip_ratio_low"),
           ({"clip_ratio_high": 1e6}, "clip_ratio_high"), ({"kl_coef": 1e9}, "kl_coef"),
           ({"entropy_coeff": 5}, "entropy_coeff"), ({"dual_clip": 1e9}, "dual_clip"),
           ({"grad_clip": 1e30}, "grad_clip"), ({"ppo_epochs": 17}, "ppo_epochs"),
           ({"ppo_mini_batches": 10**6}, "ppo_mini_batches"), ({"micro_batch_prompts": 10**9}, "micro_batch_prompts"),
           ({"rewards": [1e308, 0, 0, 1]}, "rewards"), ({"rewards": [-1e308, 0, 0, 1]}, "rewards"),
           ({"rewards": [2e6, 0, 0, 1]}, "rewards"), ({"gamma": 1.5}, "gamma"),
           ({"tis_imp_ratio_cap": 1e9}, "tis_imp_ratio_cap"), ({"loss_agg_norm": 1e30}, "loss_agg_norm"),
           ({"adv_estimator": "remax"}, "adv_estimator"), ({"adv_estimator": "gae"}, "holds no critic"),
           ({"policy_loss": "gmpo"}, "policy_loss"),
           ({"kl_penalty": "k4"}, "kl_penalty"), ({"singleton_adv": "mean"}, "singleton_adv"),
           ({"adv_estimator": "dr_grpo"}, "seq-mean-token-sum-norm"), ({"kl_ctrl": "adaptive"}, "kl_ctrl")]
    failures = []
    for body, field in bad:
        r = client.post("/train_step", json={"rollout_id": rid, "rewards": REWARDS, **body})
        if r.status_code != 400 or field not in _error(r):
            failures.append(f"{body}: {r.status_code} {r.text[:200]}")
    for name, value in [("inf_reward", float("inf")), ("nan_reward", float("nan")), ("huge_reward", 1e300)]:
        monkeypatch.setitem(server.state.rewards.fns, name, lambda *a, v=value, **k: v)  # registered at startup
        r = client.post("/train_step", json={"rollout_id": rid, "reward": name})
        if r.status_code != 400 or not ("returned" in _error(r) or "1e+06" in _error(r)):
            failures.append(f"{name}: {r.status_code} {r.text[:200]}")
    assert not failures, "\n".join(failures)
    _assert_same(before, _snapshot(server, client))
    assert _train(client, rid, lr=1e-3).status_code == 200  # the demo's lr is legal


# ---- /save ----------------------------------------------------------------------------------------
def test_save_never_into_the_root_nor_over_a_checkpoint(server, client):
    root = Path(server.state.cfg.checkpoint_root)
    for path in (".", "./", "x/..", str(root)):
        r = client.post("/save", json={"path": path})
        assert r.status_code == 400 and "checkpoint root itself" in _error(r), (path, r.text)
    assert client.post("/save", json={"path": ""}).status_code == 400
    assert not (root / "trainer_state.pt").exists() and not (root / "model.safetensors").exists()
    assert client.post("/save", json={"path": "twice"}).status_code == 200
    stamp = (root / "twice" / "trainer_state.pt").stat().st_mtime_ns
    r = client.post("/save", json={"path": "twice"})
    assert r.status_code == 409 and "overwrite" in _error(r), r.text
    assert (root / "twice" / "trainer_state.pt").stat().st_mtime_ns == stamp
    assert client.post("/save", json={"path": "twice", "overwrite": True}).status_code == 200


# ---- /load ----------------------------------------------------------------------------------------
def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _garbage(f: Path) -> None:
    f.write_bytes(b"\x00\x13garbage" * 100)


def _edit_tensors(f: Path, fn) -> None:
    t = load_file(str(f))
    fn(t)
    save_file(t, str(f), metadata={"format": "pt"})


def _edit_state(f: Path, fn) -> None:
    s = torch.load(f, weights_only=True)
    fn(s)
    torch.save(s, f)


def _first_weight(t: dict) -> str:
    return next(k for k in sorted(t) if k.endswith("weight") and t[k].ndim == 2)


def _nan(t):
    k = _first_weight(t)
    t[k] = t[k].clone()
    t[k][0, 0] = float("nan")


def _moment(s, fn):
    st = s["actor"]["optimizer"]["opt"]["state"]
    i = min(st)  # the first parameter with AdamW state
    st[i]["exp_avg"] = fn(st[i]["exp_avg"])


LOAD_CASES = {
    "no model.safetensors": (lambda d: (d / "model.safetensors").unlink(), "no model.safetensors"),
    "truncated model.safetensors": (lambda d: _truncate(d / "model.safetensors"), "not readable"),
    "garbage model.safetensors": (lambda d: _garbage(d / "model.safetensors"), "not readable"),
    "non-finite weight": (lambda d: _edit_tensors(d / "model.safetensors", _nan), "non-finite"),
    "other shape": (lambda d: _edit_tensors(d / "model.safetensors", lambda t: t.update(
        {_first_weight(t): t[_first_weight(t)][:-1].clone()})), "other shapes"),
    "integer weight": (lambda d: _edit_tensors(d / "model.safetensors", lambda t: t.update(
        {_first_weight(t): t[_first_weight(t)].long()})), "not floating point"),
    "unknown tensor": (lambda d: _edit_tensors(d / "model.safetensors", lambda t: t.update(
        {"model.extra.weight": torch.zeros(2)})), "unknown"),
    "missing tensor": (lambda d: _edit_tensors(d / "model.safetensors", lambda t: t.pop(_first_weight(t))),
                       "lacks"),
    "no trainer_state.pt": (lambda d: (d / "trainer_state.pt").unlink(), "not a Rollplex checkpoint"),
    "truncated trainer_state.pt": (lambda d: _truncate(d / "trainer_state.pt"), "not a readable trainer state"),
    "garbage trainer_state.pt": (lambda d: _garbage(d / "trainer_state.pt"), "not a readable trainer state"),
    "trainer_state.pt of another shape": (lambda d: _edit_state(d / "trainer_state.pt", lambda s: _moment(
        s, lambda t: t[:-1])), "optimizer's exp_avg of parameter"),
    "non-finite moment": (lambda d: _edit_state(d / "trainer_state.pt", lambda s: _moment(
        s, lambda t: t * float("inf"))), "non-finite"),
    "no step count": (lambda d: _edit_state(d / "trainer_state.pt", lambda s: s.pop("step_idx")), "step_idx"),
    "no ref/": (lambda d: shutil.rmtree(d / "ref"), "no reference policy"),
    "truncated ref/model.safetensors": (lambda d: _truncate(d / "ref" / "model.safetensors"), "not readable"),
    "non-finite ref weight": (lambda d: _edit_tensors(d / "ref" / "model.safetensors", _nan), "non-finite"),
}


def test_load_checks_every_file_before_changing_anything(server, client):
    root = Path(server.state.cfg.checkpoint_root)
    assert client.post("/save", json={"path": "good"}).status_code == 200
    assert _train(client, _rollout(client)).status_code == 200  # the live state is not the checkpoint's
    rid = _rollout(client)  # a load would drop it
    before = _snapshot(server, client)
    failures = []
    for name, (corrupt, message) in LOAD_CASES.items():
        bad = root / f"bad-{name.replace(' ', '-').replace('/', '')}"
        shutil.copytree(root / "good", bad)
        corrupt(bad)
        r = client.post("/load", json={"path": bad.name})
        if r.status_code != 400 or message not in _error(r):
            failures.append(f"{name}: {r.status_code} {r.text[:300]}")
    assert not failures, "\n".join(failures)
    _assert_same(before, _snapshot(server, client))  # the rollout store included
    assert _train(client, rid).status_code == 200  # still retained and on-policy
    loaded = client.post("/load", json={"path": "good"})  # and the good one loads
    assert loaded.status_code == 200 and loaded.json()["dropped_rollouts"] == 0, loaded.text
    h = client.get("/checksum").json()
    assert h["weights_version"] == before["http"]["weights_version"] + 2 and h["retained_rollouts"] == []


def test_checkpoint_stores_the_weights_once_and_loads_edits(server, client):
    """fp32 weights: trainer_state.pt holds no second copy (no masters), so weights edited in
    model.safetensors are what a load restores."""
    root = Path(server.state.cfg.checkpoint_root)
    assert client.post("/save", json={"path": "edit"}).status_code == 200
    state = torch.load(root / "edit" / "trainer_state.pt", weights_only=True)
    assert all(m is None for m in state["actor"]["optimizer"]["master"])
    tensors = load_file(str(root / "edit" / "model.safetensors"))
    name = _first_weight(tensors)
    want = tensors[name] + 0.25
    _edit_tensors(root / "edit" / "model.safetensors", lambda t: t.update({name: want}))
    r = client.post("/load", json={"path": "edit"})
    assert r.status_code == 200 and r.json()["masters_rebuilt"] == 0, r.text
    assert "proj" not in name  # a tensor our layout keeps whole (not fused into q/k/v or gate/up)
    assert torch.equal(dict(server.state.model.named_parameters())[name].detach(), want), name
    assert _train(client, _rollout(client)).status_code == 200


# ---- the library ------------------------------------------------------------------------------------
def test_bf16_masters_restore_exactly_or_are_rebuilt_from_edited_weights(tiny_dir, tmp_path):
    from rollplex.models import load_model
    from rollplex.rl.run_state import load_checkpoint, save_checkpoint
    from rollplex.rl.step import RLStep

    def step():
        return RLStep(load_model(tiny_dir, dtype=torch.bfloat16), None, RLConfig(kl_coef=0.0))

    a = step()
    opt = a.actor.optimizer
    assert opt.master[0] is not opt.local[0]
    with torch.no_grad():  # fp32 digits below the bf16 weight's (well inside half a bf16 ulp), as after training
        opt.master[0].mul_(1 + 1e-4)
    assert not torch.equal(opt.master[0], opt.local[0].float())
    assert torch.equal(opt.master[0].to(torch.bfloat16), opt.local[0])
    save_checkpoint(a, tmp_path / "ck")
    b, report = step(), {}
    load_checkpoint(b, tmp_path / "ck", report)
    assert report["masters_rebuilt"] == 0 and torch.equal(b.actor.optimizer.master[0], opt.master[0])
    tensors = load_file(str(tmp_path / "ck" / "model.safetensors"))
    name = _first_weight(tensors)
    _edit_tensors(tmp_path / "ck" / "model.safetensors", lambda t: t.update({name: t[name] + 1.0}))
    c, report = step(), {}
    load_checkpoint(c, tmp_path / "ck", report)
    assert report["masters_rebuilt"] >= 1
    for m, p in zip(c.actor.optimizer.master, c.actor.optimizer.local):
        assert torch.equal(m.to(torch.bfloat16), p)  # every master rounds to the weights it serves


def test_checkpoints_with_fp32_masters_still_load(tiny_dir, tmp_path):
    """Checkpoints written before the weights were stored once hold fp32 masters of fp32 weights too."""
    from rollplex.models import load_model
    from rollplex.rl.run_state import load_checkpoint, save_checkpoint
    from rollplex.rl.step import RLStep

    a = RLStep(load_model(tiny_dir), None, RLConfig(kl_coef=0.0))
    save_checkpoint(a, tmp_path / "ck", data_state={"step": 3})
    _edit_state(tmp_path / "ck" / "trainer_state.pt", lambda s: s["actor"]["optimizer"].update(
        master=[p.detach().clone() for p in a.model.parameters()]))
    b, report = RLStep(load_model(tiny_dir), None, RLConfig(kl_coef=0.0)), {}
    assert load_checkpoint(b, tmp_path / "ck", report) == {"step": 3} and report["masters_rebuilt"] == 0
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))


def test_library_skips_a_non_finite_mini_batch(server, client, tiny_dir, monkeypatch):
    """RLStep.train's default (verl's): a non-finite mini-batch gets no optimizer or LR-schedule step and
    the update goes on; `actor/skipped_updates` says so."""
    from rollplex.models import load_model
    from rollplex.rl.step import RLStep

    batch = server.state.store.get(_rollout(client)).batch
    rl = RLStep(load_model(tiny_dir), None, RLConfig(n=2, kl_coef=0.0, ppo_mini_batches=2))
    real, calls = actor_mod.ppo_policy_loss, [0]

    def first_nan(logp, *a, **k):
        calls[0] += 1
        pg, *rest = real(logp, *a, **k)
        return (pg * float("nan") if calls[0] == 1 else pg), *rest

    monkeypatch.setattr(actor_mod, "ppo_policy_loss", first_nan)
    w0 = [p.detach().clone() for p in rl.model.parameters()]
    m = rl.train(dataclasses.replace(batch, rewards=torch.tensor(REWARDS)))
    assert m["actor/skipped_updates"] == 1.0 and rl.actor.scheduler.last_epoch == 1 and rl.step_idx == 1
    assert not all(torch.equal(a, b) for a, b in zip(w0, rl.model.parameters()))  # mini-batch 2 was applied


def _dp_optimizer_oom(rank: int, world: int, init: str, rl: RLConfig) -> None:
    """One rank of a data-parallel update whose rank 1 runs out of memory in its second optimizer step
    (having written nothing): every rank raises the same TrainOOM (one step applied, the second part-way
    over the group) from a CollectiveOOM, and the LR schedule counts the train step once (verl's unit)."""
    import torch.distributed as dist
    from parallel_helpers import init_group, rollout_batch, tiny_cfg, tiny_model
    from torch.distributed.device_mesh import init_device_mesh

    from rollplex.parallel import DataParallelActor
    from rollplex.rl.actor import TrainOOM
    from rollplex.rl.optimizer import OptimizerStepOOM
    from rollplex.rl.placement import CollectiveOOM

    init_group(rank, world, init)
    try:
        actor = DataParallelActor(tiny_model(tiny_cfg()), rl, init_device_mesh("cpu", (world,)))
        real, calls = actor.optimizer.step, [0]

        def step():
            calls[0] += 1
            if rank == 1 and calls[0] == 2:
                raise OptimizerStepOOM(0, 1, False)
            real()

        actor.optimizer.step = step
        batch, adv, ref = rollout_batch()
        with pytest.raises(TrainOOM) as e:
            actor.update(batch, adv, ref, actor.old_logprobs(batch))
        err = e.value
        assert err.applied_updates == 1 and err.partial_update and isinstance(err.__cause__, CollectiveOOM), err
        assert actor.scheduler.last_epoch == 1 and calls[0] == 2
        dist.barrier()  # the group is still in step
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_data_parallel_ranks_agree_on_an_optimizer_oom(tmp_path):
    rl = RLConfig(lr=1e-4, kl_coef=0.05, micro_batch_prompts=1, ppo_mini_batches=2)
    spawn(_dp_optimizer_oom, args=(2, f"file://{tmp_path}/store", rl), nprocs=2)
