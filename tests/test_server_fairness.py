"""One client cannot take from another: retained rollouts are capped per client (count and bytes) and in
bytes over all clients, a client's rollouts never evicting another's; rewards are scored outside the
training lock (a slow reward function holds up no other client's step); the built-in rewards run in
linear time under a length cap; and non-finite weights are reported by /checksum and /rollout instead of
failing them with 500.

One in-process server (the tiny model, CPU, fp32); clients are told apart by their address, so each test
client connects from its own loopback address (127.0.0.x).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from rollplex.engine import EngineConfig
from rollplex.rl import rewards as rewards_mod
from rollplex.rl.config import RLConfig
from rollplex.server import ServerConfig, serve_in_thread

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
REWARDS = [1.0, 0.0, 0.0, 1.0]
SAMPLING = {"max_new_tokens": 2, "ignore_eos": True}  # every rollout the same size


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    cfg = ServerConfig(model=str(tiny_dir), device="cpu", max_rollouts=2,
                       rl=RLConfig(n=2, lr=1e-3, kl_coef=0.0, max_new_tokens=2),
                       engine=EngineConfig(max_model_len=128, kv_cache_tokens=2048, max_num_seqs=16),
                       checkpoint_root=str(tmp_path_factory.mktemp("ckpt-fair")))
    srv = serve_in_thread(cfg)
    yield srv
    srv.stop()


def _client(server, last_octet: int) -> httpx.Client:
    transport = httpx.HTTPTransport(local_address=f"127.0.0.{last_octet}")
    return httpx.Client(base_url=server.url, timeout=60, transport=transport)


@pytest.fixture
def clients(server):
    server.state.store.clear()
    with _client(server, 2) as a, _client(server, 3) as b:
        yield a, b
    server.state.store.clear()


def _rollout(c, **kw) -> httpx.Response:
    return c.post("/rollout", json={"prompts": [{"input_ids": p} for p in PROMPTS], "n": 2,
                                    "sampling_params": SAMPLING, **kw})


def _rid(c) -> str:
    r = _rollout(c)
    assert r.status_code == 200, r.text
    return r.json()["rollout_id"]


def _retained(server) -> list[str]:
    return server.state.store.ids()


# ---- retained rollouts --------------------------------------------------------------------------------
def test_one_clients_rollouts_never_evict_anothers(server, clients):
    a, b = clients
    mine = [_rid(a), _rid(a)]
    theirs = [_rid(b), _rid(b), _rid(b)]  # over the cap of 2: b's own oldest goes
    assert _retained(server) == [*mine, *theirs[1:]]
    assert a.post("/train_step", json={"rollout_id": mine[0], "rewards": REWARDS}).status_code == 200


def test_retained_rollouts_are_capped_in_bytes(server, clients, monkeypatch):
    a, b = clients
    store = server.state.store
    _rid(a)
    size = store.nbytes()
    assert size > 0
    monkeypatch.setattr(store, "cap", 100)  # the bytes decide here, not the count
    monkeypatch.setattr(store, "client_bytes", int(2.5 * size))
    second, third = _rid(a), _rid(a)
    assert _retained(server) == [second, third] and store.nbytes() == 2 * size  # a's oldest evicted to fit
    monkeypatch.setattr(store, "total_bytes", int(2.5 * size))
    r = _rollout(b)  # would need room a's rollouts hold: refused, nothing of a's evicted
    assert r.status_code == 507, r.text
    msg = r.json()["error"]["message"]
    assert "--max-retained-bytes" in msg and "cannot be retained" in msg, msg
    assert _retained(server) == [second, third]
    assert _rollout(b, for_training=False).status_code == 200  # sampling without retaining still serves b
    monkeypatch.setattr(store, "client_bytes", size // 2)
    r = _rollout(a)
    assert r.status_code == 507 and "--max-client-rollout-bytes" in r.json()["error"]["message"], r.text
    assert _retained(server) == [second, third]
    assert store.num_evicted >= 1


# ---- rewards ------------------------------------------------------------------------------------------
def test_a_slow_reward_holds_up_no_other_clients_step(server, clients, monkeypatch):
    """Client a's reward function runs for a while; client b's step, sent meanwhile, trains at once
    (it got 409 while a's reward ran under the training lock)."""
    a, b = clients
    started, release = threading.Event(), threading.Event()

    def slow(data_source, solution_str, ground_truth, extra_info=None):
        started.set()
        assert release.wait(60)
        return 1.0 if solution_str else 0.0

    monkeypatch.setitem(server.state.rewards.fns, "slow", slow)  # registered at startup, in effect
    ra, rb = _rid(a), _rid(b)
    with ThreadPoolExecutor(1) as ex:
        # off_policy: b's step changes the weights before a's rewards are in
        fa = ex.submit(a.post, "/train_step", json={"rollout_id": ra, "reward": "slow", "off_policy": True})
        assert started.wait(30)
        t0 = time.perf_counter()
        rb_answer = b.post("/train_step", json={"rollout_id": rb, "rewards": REWARDS})
        waited = time.perf_counter() - t0
        release.set()
        ra_answer = fa.result()
    assert rb_answer.status_code == 200, rb_answer.text
    assert waited < 30
    assert ra_answer.status_code == 200, ra_answer.text
    assert ra_answer.json()["training/off_policy"] == 1.0 and _retained(server) == []


def test_a_rollout_consumed_while_its_rewards_were_scored_is_not_trained_twice(server, clients, monkeypatch):
    a, _ = clients
    started, release = threading.Event(), threading.Event()

    def slow(*args, **kw):
        started.set()
        assert release.wait(60)
        return 0.5

    monkeypatch.setitem(server.state.rewards.fns, "slow", slow)
    rid = _rid(a)
    step0 = server.state.rl.step_idx
    with ThreadPoolExecutor(1) as ex:
        first = ex.submit(a.post, "/train_step", json={"rollout_id": rid, "reward": "slow", "off_policy": True})
        assert started.wait(30)
        second = a.post("/train_step", json={"rollout_id": rid, "rewards": REWARDS})  # trains it meanwhile
        release.set()
        first = first.result()
    assert second.status_code == 200, second.text
    assert first.status_code == 404 and "trained or expired while its rewards were scored" in first.text, first.text
    assert server.state.rl.step_idx == step0 + 1


def test_builtin_rewards_run_in_linear_time_under_a_length_cap():
    cap = rewards_mod.MAX_TEXT_CHARS
    hostile = ("\\frac{" * cap)[:cap]  # backtracked over quadratically: 96 KB took ~10 s
    for name, fn in rewards_mod.REGISTRY.items():
        t0 = time.perf_counter()
        fn("x", "\\boxed{1}", hostile)
        fn("x", hostile, "1")
        assert time.perf_counter() - t0 < 0.5, name
        with pytest.raises(ValueError, match=f"over the built-in rewards' limit of {cap}"):
            fn("x", "\\boxed{1}", "1" * (cap + 1))
        with pytest.raises(ValueError, match="response of"):
            fn("x", "y" * (cap + 1), "1")
    assert rewards_mod.math_boxed("x", "so \\boxed{\\frac{1}{2}}", "1/2")["score"] == 1.0  # still parses


def test_an_overlong_ground_truth_is_400_and_the_rollout_stays(server, clients):
    a, _ = clients
    huge = "\\frac{" * 20_000
    r = a.post("/rollout", json={"prompts": [{"input_ids": p, "reward_model": {"ground_truth": huge}}
                                             for p in PROMPTS], "n": 2, "sampling_params": SAMPLING})
    assert r.status_code == 200, r.text
    rid = r.json()["rollout_id"]
    t0 = time.perf_counter()
    bad = a.post("/train_step", json={"rollout_id": rid, "reward": "math_boxed"})
    assert bad.status_code == 400 and "limit of" in bad.json()["error"]["message"], bad.text
    assert time.perf_counter() - t0 < 30 and rid in _retained(server)
    assert a.post("/train_step", json={"rollout_id": rid, "rewards": REWARDS}).status_code == 200


# ---- non-finite weights -------------------------------------------------------------------------------
def test_checksum_and_rollout_answer_with_non_finite_weights(server, clients):
    a, _ = clients
    head = server.state.model.lm_head.weight
    saved = head.detach().clone()
    before = a.get("/checksum").json()
    assert before["weights_finite"] and before["optimizer_finite"]
    try:
        with torch.no_grad():
            head[0].fill_(float("inf"))  # as a poisoned load or update would leave it
        h = a.get("/checksum")
        assert h.status_code == 200, h.text
        h = h.json()
        assert h["weights_checksum"] is None and h["weights_finite"] is False and h["optimizer_finite"] is True
        assert h["global_step"] == before["global_step"]
        r = _rollout(a, sampling_params={"temperature": 0, "max_new_tokens": 2}, for_training=False)
        assert r.status_code == 200, r.text
        assert any(x is None for s in r.json()["samples"] for x in s["logprobs"]), r.text
    finally:
        with torch.no_grad():
            head.copy_(saved)
    assert a.get("/checksum").json() == before
