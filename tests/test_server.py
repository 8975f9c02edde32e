"""The hybrid server over real HTTP: a uvicorn server on loopback (a background thread; one test runs the
`python -m rollplex.server` CLI as a subprocess), the tiny model on CPU.

generate (text, image, logprobs, streaming, disconnect -> abort), rollout -> train_step -> weights
change, reward names, one train step at a time (409), stale rollouts (409, then off-policy), save/load
round trip under the checkpoint root (and nothing outside it), auth, and a corpus of bad requests that
must all be 400 while the server stays healthy and a retained rollout still trains.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch
from server_helpers import IMG, free_port, png_b64, sse_events, wait_for_health, wire_rows

from rollplex.engine import EngineConfig
from rollplex.rl.config import RLConfig
from rollplex.server import ServerConfig, serve_in_thread
from rollplex.tiny import write_tiny

ROOT = Path(__file__).resolve().parents[1]
GREEDY = {"temperature": 0, "max_new_tokens": 4}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny-server"), seed=0)


def _config(tiny_dir, api_key=None, checkpoint_root=None, **rl) -> ServerConfig:
    rl = dict(n=2, lr=1e-3, kl_coef=0.05, max_new_tokens=4, micro_batch_prompts=4, micro_batch_samples=8) | rl
    return ServerConfig(model=str(tiny_dir), device="cpu", api_key=api_key, rl=RLConfig(**rl),
                        engine=EngineConfig(max_model_len=256, kv_cache_tokens=8192, max_num_seqs=64),
                        checkpoint_root=None if checkpoint_root is None else str(checkpoint_root))


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ckpt-root")


@pytest.fixture(scope="module")
def server(tiny_dir, ckpt_root):
    srv = serve_in_thread(_config(tiny_dir, checkpoint_root=ckpt_root))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _checksum(client) -> float:
    return client.get("/checksum").json()["weights_checksum"]


def _rollout(client, n_prompts=2, n=2, **kw) -> dict:
    r = client.post("/rollout", json={"prompts": wire_rows(n_prompts), "n": n, **kw})
    assert r.status_code == 200, r.text
    return r.json()


# ---- info ---------------------------------------------------------------------------------------
def test_health_metrics_memory(client):
    h = client.get("/health").json()
    assert h["status"] == "ok" and h["device"] == "cpu" and h["mode"] == "rollplex" and h["has_ref_model"]
    text = client.get("/metrics").text
    assert "# TYPE rollplex_http_requests_total counter" in text and 'route="/health"' in text
    assert client.get("/get_model_info").json()["is_generation"] is True
    mem = client.get("/memory").json()
    regions = mem["regions"]
    assert regions["weights"] > 0 and regions["kv_cache"] > 0 and regions["ref_weights"] > 0  # kl_coef > 0
    assert mem["total_bytes"] == sum(regions.values()) and mem["cuda"] is None
    manager = mem["manager"]  # the phase-aware memory manager (accounting backend on CPU)
    assert manager["backend"] == "accounting" and manager["plan"]["phases"]["update"]["kv_cache"] == "released"


# ---- /generate ----------------------------------------------------------------------------------
def test_generate_text_single_and_batch(client):
    body = {"text": "What color is the", "sampling_params": GREEDY, "return_logprob": True, "logprob_start_len": 0}
    a = client.post("/generate", json=body).json()
    b = client.post("/generate", json=body).json()
    assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 4  # greedy is deterministic
    meta = a["meta_info"]
    assert meta["finish_reason"]["type"] in ("length", "stop") and meta["completion_tokens"] == 4
    assert [t[1] for t in meta["output_token_logprobs"]] == a["output_ids"]
    assert all(t[0] <= 0 for t in meta["output_token_logprobs"])
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"] and meta["input_token_logprobs"][0][0] is None
    batch = client.post("/generate", json={"text": ["red", "What color is the"],
                                           "sampling_params": [GREEDY, {**GREEDY, "n": 2}]}).json()
    assert isinstance(batch, list) and len(batch) == 3
    assert batch[1]["output_ids"] == a["output_ids"] == batch[2]["output_ids"]  # batched == alone
    ids = client.post("/generate", json={"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": GREEDY}).json()
    assert len(ids) == 2 and ids[0]["meta_info"]["prompt_tokens"] == 3


def test_generate_with_image(client):
    b64 = png_b64()
    body = {"text": f"{IMG}What color?", "image_data": b64, "sampling_params": GREEDY, "return_logprob": True,
            "return_text_in_logprobs": True}
    a = client.post("/generate", json=body)
    assert a.status_code == 200, a.text
    a = a.json()
    assert a["meta_info"]["prompt_tokens"] > client.post("/generate", json={
        "text": "What color?", "sampling_params": GREEDY}).json()["meta_info"]["prompt_tokens"]
    assert all(isinstance(t[2], str) for t in a["meta_info"]["output_token_logprobs"])
    url = client.post("/generate", json={**body, "image_data": "data:image/png;base64," + b64}).json()
    assert url["output_ids"] == a["output_ids"]
    other = client.post("/generate", json={**body, "image_data": png_b64((40, 70, 220))}).json()
    assert other["meta_info"]["output_token_logprobs"] != a["meta_info"]["output_token_logprobs"]  # it sees the image


def test_generate_stream(client):
    body = {"text": "What color is the", "sampling_params": GREEDY}
    ref = client.post("/generate", json=body).json()
    with client.stream("POST", "/generate", json={**body, "stream": True, "return_logprob": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and len(events) >= 3
    chunks = events[:-1]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["output_ids"] == ref["output_ids"] and last["text"] == ref["text"]
    assert last["meta_info"]["finish_reason"] is not None and len(last["meta_info"]["output_token_logprobs"]) == 4
    lens = [len(c["output_ids"]) for c in chunks]
    assert lens == sorted(lens)  # cumulative


def test_stream_disconnect_aborts_the_request(client, server):
    before = server.state.worker.num_aborted
    body = {"text": "hello", "stream": True, "sampling_params": {"max_new_tokens": 240, "ignore_eos": True}}
    with client.stream("POST", "/generate", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # hang up after the first chunk
    deadline = time.monotonic() + 10
    while server.state.worker.num_aborted == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.state.worker.num_aborted == before + 1
    while server.state.engine.has_work and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.state.engine.requests  # nothing left behind


def test_disconnect_aborts_non_streaming_request(server):
    before = server.state.worker.num_aborted
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 240, "ignore_eos": True, "n": 4}}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up (and closes the connection) mid-generation
        httpx.post(server.url + "/generate", json=body, timeout=httpx.Timeout(10, read=0.2))
    deadline = time.monotonic() + 10
    while server.state.worker.num_aborted == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.state.worker.num_aborted == before + 1


def test_max_new_tokens_must_fit_max_model_len(client):
    ids = [5] * 250  # max_model_len 256: room for 6 new tokens
    fits = client.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 6,
                                                                                "ignore_eos": True}})
    assert fits.status_code == 200 and fits.json()["meta_info"]["completion_tokens"] == 6, fits.text
    over = client.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 7}})
    assert over.status_code == 400 and "at most 6 new tokens" in over.json()["error"]["message"], over.text
    ro = client.post("/rollout", json={"prompts": [{"input_ids": ids}], "n": 2,
                                       "sampling_params": {"max_new_tokens": 7}})
    assert ro.status_code == 400 and "max_model_len=256" in ro.json()["error"]["message"], ro.text


def test_finish_reason_has_one_shape(client):
    gen = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    ro = client.post("/rollout", json={"prompts": [{"input_ids": [5, 6, 7]}], "n": 2, "for_training": False,
                                       "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    assert gen.status_code == ro.status_code == 200, (gen.text, ro.text)
    assert gen.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert [s["finish_reason"] for s in ro.json()["samples"]] == [{"type": "length", "length": 3}] * 2


def test_concurrent_generates(client):
    def one(i):
        return client.post("/generate", json={"text": f"color {i}", "sampling_params": {"max_new_tokens": 8}})

    with ThreadPoolExecutor(6) as ex:
        rs = list(ex.map(one, range(6)))
    assert all(r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] >= 1 for r in rs)


# ---- RL ------------------------------------------------------------------------------------------
def test_rollout_train_step_changes_weights(client):
    ro = _rollout(client, n_prompts=2, n=3)
    assert ro["rollout_id"] and ro["num_samples"] == 6 == len(ro["samples"])
    assert [s["prompt_index"] for s in ro["samples"]] == [0, 0, 0, 1, 1, 1]
    s = ro["samples"][0]
    assert len(s["token_ids"]) == len(s["logprobs"]) >= 1 and s["finish_reason"]["type"] in ("stop", "length")
    assert ro["weights_version"] == client.get("/health").json()["weights_version"]
    h0, c0 = client.get("/health").json(), _checksum(client)
    m = client.post("/train_step", json={"rollout_id": ro["rollout_id"], "rewards": [1, 0, 0, 0, 1, 0]})
    assert m.status_code == 200, m.text
    m = m.json()
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/score/mean", "timing_s/step",
              "timing_s/gen", "timing_s/ref", "perf/throughput", "training/rollout_probs_diff_mean"):
        assert k in m, k
    assert m["rollplex/prefix_dedup_ratio"] == 3 and m["training/global_step"] == h0["global_step"] + 1
    assert _checksum(client) != c0
    assert client.get("/health").json()["weights_version"] == h0["weights_version"] + 1
    again = client.post("/train_step", json={"rollout_id": ro["rollout_id"], "rewards": [0] * 6})
    assert again.status_code == 404  # consumed
    assert "rollplex_actor_pg_loss" in client.get("/metrics").text


def test_train_step_with_reward_name_and_chat_prompts(client, server):
    ro = _rollout(client, n_prompts=2, n=2)
    m = client.post("/train_step", json={"rollout_id": ro["rollout_id"], "reward": "shape_color", "lr": 1e-4,
                                         "micro_batch_max_tokens": 64})  # a token budget: one prompt per pass
    assert m.status_code == 200, m.text
    assert 0.0 <= m.json()["critic/score/mean"] <= 1.0 and m.json()["actor/lr"] == 1e-4
    rl = server.state.rl  # the overrides were that step's only
    # the step's config is the server's, with the checkpointing the memory plan resolved (memory/fit.py)
    assert rl.actor.cfg is rl.cfg
    assert replace(rl.cfg, gradient_checkpointing=None, vision_gradient_checkpointing=None) == server.state.cfg.rl
    assert rl.cfg.lr == 1e-3 and rl.cfg.micro_batch_max_tokens is None
    assert [g["lr"] for g in rl.actor.optimizer.param_groups] == [1e-3]
    chat = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Color?"}]}],
            "images": [png_b64()], "ground_truth": "A"}
    ro = client.post("/rollout", json={"prompts": [chat], "n": 2}).json()
    m = client.post("/train_step", json={"rollout_id": ro["rollout_id"], "reward": "choice"})
    assert m.status_code == 200, m.text
    # the algorithm for one step: RLOO advantages, GSPO's loss, truncated importance sampling
    ro = _rollout(client, n_prompts=2, n=2)
    m = client.post("/train_step", json={"rollout_id": ro["rollout_id"], "rewards": [1, 0, 0, 0],
                                         "adv_estimator": "rloo", "policy_loss": "gspo", "tis_imp_ratio_cap": 2.0})
    assert m.status_code == 200, m.text
    assert m.json()["critic/advantages/max"] == 1.0 and "actor/pg_clipfrac_lower" in m.json()  # 1 - 0 (its one other)
    assert rl.cfg.adv_estimator == "grpo" and rl.cfg.policy_loss == "vanilla"


def test_train_step_dapo_overrides(client, server):
    from rollplex.rl.rewards import shape_color

    # dynamic sampling's filter: the first group's rewards are all equal, so only the second one trains
    ro = _rollout(client, n_prompts=2, n=2)
    m = client.post("/train_step", json={"rollout_id": ro["rollout_id"], "rewards": [1, 1, 0, 1],
                                         "filter_groups": True})
    assert m.status_code == 200, m.text
    m = m.json()
    assert (m["train/num_gen_batches"], m["train/num_groups_kept"], m["train/num_groups_dropped"]) == (1, 1, 1)
    assert m["critic/score/mean"] == 0.5  # the second group's rewards alone
    # the client's refill: too few groups kept is a 400 that keeps the rollout; with a second rollout the
    # step keeps 3 groups (a's second, b's both) and trains the first 2
    a, b = _rollout(client, n_prompts=2, n=2), _rollout(client, n_prompts=2, n=2)
    body = {"rollout_id": a["rollout_id"], "rewards": [1, 1, 0, 1], "filter_groups": True, "train_batch_size": 2}
    short = client.post("/train_step", json=body)
    assert short.status_code == 400 and short.json()["error"]["message"].startswith("filter_groups: 1 of the 2")
    body.update(more_rollout_ids=[b["rollout_id"]], rewards=[1, 1, 0, 1, 0, 1, 0.5, 1])
    m = client.post("/train_step", json=body)
    assert m.status_code == 200, m.text
    m = m.json()
    assert (m["train/num_gen_batches"], m["train/num_groups_kept"], m["train/num_groups_dropped"]) == (2, 3, 1)
    assert m["critic/score/mean"] == 0.5  # (0 + 1 + 0 + 1) / 4: the third kept group, (0.5, 1), trimmed off
    for ro in (a, b):  # both consumed
        assert client.post("/train_step", json={"rollout_id": ro["rollout_id"], "rewards": [0] * 4}).status_code == 404
    # overlong shaping of the rewards the server scores, against the rollout's max_new_tokens (3, not the
    # server's 4): with a buffer of 3 every token counts, -0.5 / 3 per token
    ro = _rollout(client, n_prompts=2, n=2, sampling_params={"max_new_tokens": 3})
    m = client.post("/train_step", json={"rollout_id": ro["rollout_id"], "reward": "shape_color",
                                         "overlong_buffer_len": 3, "overlong_penalty_factor": 0.5})
    assert m.status_code == 200, m.text
    m = m.json()
    rows = wire_rows(2)
    lengths = [len(s["token_ids"]) for s in ro["samples"]]
    scores = [shape_color(None, s["text"], rows[s["prompt_index"]]["reward_model"]["ground_truth"])
              for s in ro["samples"]]
    penalty = [-n / 3 * 0.5 for n in lengths]
    assert m["critic/score/overlong"] == 1.0 and m["critic/score/overlong_reward"] == pytest.approx(sum(penalty) / 4)
    assert m["critic/score/mean"] == pytest.approx(sum(s + p for s, p in zip(scores, penalty)) / 4)
    assert not server.state.rl.cfg.filter_groups and server.state.rl.cfg.overlong_buffer_len == 0  # that step's only


def test_second_concurrent_train_step_gets_409(client, server):
    state = server.state
    a, b = _rollout(client), _rollout(client)
    started, orig = threading.Event(), state.train

    def slow(*args, **kw):
        started.set()
        time.sleep(1.0)
        return orig(*args, **kw)

    state.train = slow
    try:
        with ThreadPoolExecutor(1) as ex:
            first = ex.submit(client.post, "/train_step", json={"rollout_id": a["rollout_id"], "rewards": [1, 0, 1, 0]})
            assert started.wait(10)
            second = client.post("/train_step", json={"rollout_id": b["rollout_id"], "rewards": [1, 0, 1, 0]})
            assert first.result().status_code == 200
    finally:
        del state.train
    assert second.status_code == 409 and "already running" in second.json()["error"]["message"]
    b_id = b["rollout_id"]  # sampled before the first step changed the weights: stale now
    assert client.post("/train_step", json={"rollout_id": b_id, "rewards": [1, 0, 1, 0]}).status_code == 409
    ok = client.post("/train_step", json={"rollout_id": b_id, "rewards": [1, 0, 1, 0], "off_policy": True})
    assert ok.status_code == 200, ok.text


def test_stale_rollout_is_409_then_trains_off_policy(client):
    a, b = _rollout(client), _rollout(client)
    assert a["weights_version"] == b["weights_version"]
    on = client.post("/train_step", json={"rollout_id": a["rollout_id"], "rewards": [1, 0, 0, 1]})
    assert on.status_code == 200, on.text
    on = on.json()
    assert on["training/off_policy"] == 0.0 and abs(on["actor/ppo_kl"]) < 1e-6  # old = current policy
    version = client.get("/health").json()["weights_version"]
    assert version == b["weights_version"] + 1
    stale = client.post("/train_step", json={"rollout_id": b["rollout_id"], "rewards": [1, 0, 0, 1]})
    assert stale.status_code == 409, stale.text
    msg = stale.json()["error"]["message"]
    assert f"weights_version {b['weights_version']}" in msg and f"version {version}" in msg and "off_policy" in msg
    assert client.get("/health").json()["retained_rollouts"] >= 1
    off = client.post("/train_step", json={"rollout_id": b["rollout_id"], "rewards": [1, 0, 0, 1],
                                           "off_policy": True})
    assert off.status_code == 200, off.text  # the 409 left it retained
    off = off.json()
    # the ratio is taken against the sampling logprobs, which the first step has moved away from
    assert off["training/off_policy"] == 1.0 and off["training/weights_version_lag"] == 1.0
    assert abs(off["actor/ppo_kl"]) > 1e-5 and off["actor/pg_clipfrac"] >= 0.0
    assert off["training/rollout_probs_diff_mean"] > 1e-5
    assert client.post("/train_step", json={"rollout_id": b["rollout_id"], "rewards": [0] * 4}).status_code == 404


def test_save_load_round_trip(client, ckpt_root):
    step0 = client.get("/health").json()["global_step"]
    c0 = _checksum(client)
    saved = client.post("/save", json={"path": "run/ck", "data_state": {"step": 7}})  # relative: under the root
    assert saved.status_code == 200, saved.text
    ck = ckpt_root / "run" / "ck"
    assert saved.json()["path"] == str(ck.resolve()) and saved.json()["ref_path"] == str(ck.resolve() / "ref")
    names = {p.name for p in ck.iterdir()}
    assert {"config.json", "model.safetensors", "trainer_state.pt", "tokenizer.json", "preprocessor_config.json",
            "ref"} <= names
    ro = _rollout(client)
    assert client.post("/train_step", json={"rollout_id": ro["rollout_id"], "rewards": [1, 0, 0, 1]}).status_code == 200
    assert _checksum(client) != c0
    pending = _rollout(client)["rollout_id"]
    loaded = client.post("/load", json={"path": str(ck)})  # absolute inside the root
    assert loaded.status_code == 200, loaded.text
    body = loaded.json()
    assert body["global_step"] == step0 and body["data_state"] == {"step": 7} and body["dropped_rollouts"] >= 1
    assert _checksum(client) == c0
    assert client.post("/train_step", json={"rollout_id": pending, "rewards": [0] * 4}).status_code == 404
    # the saved policy is an ordinary HF checkpoint the server can start from
    from rollplex.models import load_model

    assert load_model(ck).cfg.text.hidden_size == 128


def test_checkpoint_paths_stay_under_the_root(client, ckpt_root, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (ckpt_root / "escape").symlink_to(outside, target_is_directory=True)
    for path in ("../../etc/x", "../sibling", str(outside / "ck"), "/tmp/ck", "escape/ck"):
        for route in ("/save", "/load"):
            r = client.post(route, json={"path": path})
            assert r.status_code == 400, (route, path, r.text)
            assert "outside the checkpoint root" in r.json()["error"]["message"], r.text
    assert not any(outside.iterdir()) and not (ckpt_root.parent / "sibling").exists()
    assert client.get("/health").json()["status"] == "ok"


def test_confine_resolves_under_the_root(tmp_path):
    from rollplex.server.state import confine

    root = tmp_path / "root"
    assert confine(root, "a/b") == (root / "a" / "b").resolve()
    assert confine(root, "a/../c") == (root / "c").resolve()
    assert confine(root, str(root / "d")) == (root / "d").resolve()
    for bad in ("..", "../x", "a/../../x", str(tmp_path / "x"), "/"):
        with pytest.raises(ValueError, match="outside the checkpoint root"):
            confine(root, bad)


def test_auth(tiny_dir, tmp_path):
    srv = serve_in_thread(_config(tiny_dir, api_key="s3cret", kl_coef=0.0, checkpoint_root=tmp_path))
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            body = {"text": "hi", "sampling_params": GREEDY}
            assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
            assert c.post("/generate", json=body).status_code == 401
            assert c.post("/generate", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
            assert c.post("/generate", content=b"{bad", headers={"Authorization": "Basic s3cret"}).status_code == 401
            for path in ("/rollout", "/train_step", "/save", "/load"):
                assert c.post(path, json={}).status_code == 401, path
            assert c.get("/memory").status_code == 401
            ok = {"Authorization": "Bearer s3cret"}
            assert c.post("/generate", json=body, headers=ok).status_code == 200
            assert c.get("/memory", headers=ok).status_code == 200
            saved = c.post("/save", json={"path": "ck"}, headers=ok)  # no reference model: no ref/
            assert saved.status_code == 200 and saved.json()["ref_path"] is None, saved.text
            assert (tmp_path / "ck" / "trainer_state.pt").exists() and not (tmp_path / "ck" / "ref").exists()
    finally:
        srv.stop()


# ---- robustness ------------------------------------------------------------------------------------
BAD_GENERATE = [
    ({"text": 5}, 400),
    ({"text": "hi", "return_logprob": "yes"}, 400),
    ({"text": "hi", "bogus": 1}, 400),
    ({}, 400),
    ({"text": "hi", "input_ids": [1, 2]}, 400),
    ({"text": "hi", "sampling_params": {"max_new_tokens": "4"}}, 400),
    ({"text": "hi", "sampling_params": {"n": 0}}, 400),
    ({"text": "hi", "sampling_params": {"n": 10**9}}, 400),
    ({"text": "hi", "sampling_params": {"temperature": -1}}, 400),
    ({"text": "hi", "sampling_params": {"top_p": 0}}, 400),
    ({"text": "hi", "sampling_params": {"top_k": 0}}, 400),
    ({"text": "hi", "sampling_params": {"max_new_tokens": 0}}, 400),
    ({"text": "hi", "sampling_params": {"foo": 1}}, 400),
    ({"text": "hi", "sampling_params": {"presence_penalty": 0.5}}, 400),
    ({"text": "hi", "sampling_params": [GREEDY, GREEDY]}, 400),
    ({"text": "hi " * 400}, 400),  # over max_model_len
    ({"input_ids": [5] * 250, "sampling_params": {"max_new_tokens": 7}}, 400),  # 250 + 7 > max_model_len
    ({"input_ids": list(range(300))}, 400),
    ({"input_ids": [10**6]}, 400),
    ({"input_ids": [-1]}, 400),
    ({"input_ids": []}, 400),
    ({"text": []}, 400),
    ({"text": f"{IMG}hi", "image_data": "not an image!!"}, 400),
    ({"text": f"{IMG}hi", "image_data": "aGVsbG8gd29ybGQ="}, 400),  # valid base64, not an image
    ({"text": f"{IMG}hi", "image_data": "http://example.com/a.png"}, 400),
    ({"text": "hi", "image_data": png_b64()}, 400),  # no placeholder for the image
    ({"text": f"{IMG}hi", "image_data": ["x", "y"]}, 400),
    ({"text": "hi", "top_logprobs_num": 3}, 400),
]


def test_bad_requests_are_4xx_and_harmless(client, server):
    retained = _rollout(client)
    rid = retained["rollout_id"]
    long = {}
    worker = threading.Thread(target=lambda: long.update(r=client.post("/generate", json={
        "text": "in flight", "sampling_params": {"max_new_tokens": 150, "ignore_eos": True}})))
    worker.start()  # work in flight while the bad requests arrive
    failures = []

    def expect(resp, status, what):
        ok = resp.status_code == status and resp.json()["error"]["message"]
        if not ok:
            failures.append(f"{what}: {resp.status_code} {resp.text[:200]}")

    for body, status in BAD_GENERATE:
        expect(client.post("/generate", json=body), status, body)
    expect(client.post("/generate", content=b'{"text": "hi",', headers={"content-type": "application/json"}), 400,
           "malformed json")
    expect(client.post("/generate", json=[1, 2]), 400, "array body")
    rows = wire_rows(1)
    bad_rollouts = [
        ({"prompts": []}, 400),
        ({"prompts": rows, "n": 0}, 400),
        ({"prompts": rows, "n": "2"}, 400),
        ({"prompts": [{**rows[0], "images": ["garbage"]}]}, 400),
        ({"prompts": [{**rows[0], "images": []}]}, 400),  # <image> placeholder without an image
        ({"prompts": [{**rows[0], "messages": rows[0]["prompt"]}]}, 400),  # two prompt forms
        ({"prompts": rows, "sampling_params": {"temperature": 0}}, 400),  # training needs sampling
        ({"prompts": rows, "sampling_params": {"whatever": 1}}, 400),
        ({"prompts": rows, "n": 2, "sampling_params": {"n": 3}}, 400),
        ({"prompts": [{"messages": [{"role": "user", "content": "x " * 400}]}]}, 400),
    ]
    for body, status in bad_rollouts:
        expect(client.post("/rollout", json=body), status, body)
    bad_train = [
        ({"rollout_id": "ro-nope", "rewards": [1.0]}, 404),
        ({"rollout_id": rid, "rewards": [1.0, 0.0]}, 400),  # 4 samples
        ({"rollout_id": rid, "rewards": [1, 2, 3, "x"]}, 400),
        ({"rollout_id": rid, "rewards": [1, 0, 1, 0], "reward": "choice"}, 400),
        ({"rollout_id": rid, "reward": "no_such_reward"}, 400),
        ({"rollout_id": rid, "reward": "rollplex.nope:fn"}, 400),
        ({"rollout_id": rid, "rewards": [1, 0, 1, 0], "loss_agg_mode": "bogus"}, 400),
        ({"rollout_id": rid, "rewards": [1, 0, 1, 0], "lr": -1}, 400),
        ({"rollout_id": rid, "rewards": [1, 0, 1, 0], "micro_batch_max_tokens": 0}, 400),
        ({"rollout_id": rid, "rewards": [1, 0, 1, 0], "unknown_knob": 1}, 400),
        ({"rollout_id": rid, "rewards": [1, 0, 1, 0], "overlong_buffer_len": 5}, 400),  # > max_new_tokens 4
        ({"rollout_id": rid, "rewards": [1, 0, 1, 0], "overlong_penalty_factor": 11.0}, 400),
        ({"rollout_id": rid, "rewards": [1, 0, 1, 0], "filter_groups_metric": "not a key"}, 400),
        # a client's rewards hold no reward function's keys
        ({"rollout_id": rid, "rewards": [1, 0, 1, 0], "filter_groups": True, "filter_groups_metric": "acc"}, 400),
        ({"rollout_id": rid, "rewards": [1, 0, 1, 0], "adv_estimator": "gae"}, 400),  # no critic on this server
        ({"rollout_id": rid, "rewards": [1, 0, 1, 0], "critic_lr": 0.5}, 400),
        ({"rollout_id": rid, "rewards": [1, 0, 1, 0], "lam": 1.5}, 400),
        ({"rollout_id": rid, "rewards": [1, 0, 1, 0], "critic_warmup": 2}, 400),  # a startup flag
        ({"rollout_id": rid, "rewards": [1, 0, 1, 0], "max_num_gen_batches": 2}, 400),  # not a server option
        ({"rollout_id": rid, "rewards": [1, 1, 0, 0], "filter_groups": True}, 400),  # no group left to train
        ({"rollout_id": rid, "rewards": [1, 0, 1, 0], "train_batch_size": 2}, 400),  # without filter_groups
        ({"rollout_id": rid, "more_rollout_ids": [rid], "rewards": [1, 0, 1, 0] * 2}, 400),  # twice
        ({"rollout_id": rid, "more_rollout_ids": ["ro-nope"], "rewards": [1, 0, 1, 0] * 2}, 404),
        ({"rewards": [1, 0, 1, 0]}, 400),
    ]
    for body, status in bad_train:
        expect(client.post("/train_step", json=body), status, body)
    expect(client.post("/train_step", content=b'{"rollout_id": "' + rid.encode() + b'", "rewards": [NaN, 0, 0, 0]}',
                       headers={"content-type": "application/json"}), 400, "NaN reward")
    expect(client.post("/load", json={"path": "/definitely/not/here"}), 400, "load missing")
    expect(client.post("/load", json={"path": str(ROOT / "rollplex")}), 400, "load outside the root")
    Path(server.state.cfg.checkpoint_root, "not-a-ckpt").mkdir(parents=True, exist_ok=True)
    expect(client.post("/load", json={"path": "not-a-ckpt"}), 400, "load non-checkpoint")
    expect(client.post("/save", json={"path": "/proc/nope/ck"}), 400, "save unwritable")
    expect(client.post("/save", json={}), 400, "save without path")
    assert client.get("/generate").status_code == 405 and client.get("/nope").status_code == 404
    assert not failures, "\n".join(failures)
    worker.join(30)
    assert long["r"].status_code == 200 and long["r"].json()["meta_info"]["completion_tokens"] == 150
    assert client.get("/health").json()["status"] == "ok"
    ok = client.post("/train_step", json={"rollout_id": rid, "rewards": [1, 0, 0, 1]})
    assert ok.status_code == 200, ok.text  # the retained rollout survived all of the above


def test_rollout_store_ttl_and_cap():
    from rollplex.server.store import RetainedRollout, RolloutStore

    now = [0.0]
    store = RolloutStore(ttl_s=10, cap=2, clock=lambda: now[0])
    a, b, c = (RetainedRollout(batch=None, temperature=1.0, gen_s=0.0) for _ in range(3))
    store.put(a)
    now[0] = 5
    store.put(b)
    assert store.put(c) == [a.rollout_id]  # over the cap: the oldest goes
    assert store.get(a.rollout_id) is None and store.get(b.rollout_id) is b
    now[0] = 15.1  # b and c were created at t=5: both expired
    assert store.get(b.rollout_id) is None and len(store) == 0 and store.num_expired == 2


def test_cli_subprocess(tiny_dir):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "rollplex.server", "--model", str(tiny_dir), "--port", str(port),
                             "--device", "cpu", "--max-model-len", "256", "--kv-cache-tokens", "4096",
                             "--log-level", "warning"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(url, proc, 60)
        r = httpx.post(url + "/generate", json={"text": "hi", "sampling_params": GREEDY}, timeout=30)
        assert r.status_code == 200 and len(r.json()["output_ids"]) >= 1
    finally:
        proc.terminate()
        proc.wait(20)


def test_cli_flags_fill_the_nested_configs(monkeypatch):
    from rollplex.parallel import FSDPConfig, TPConfig
    from rollplex.server.__main__ import config_from_args, parser

    monkeypatch.delenv("ROLLPLEX_API_KEY", raising=False)
    ap = parser()
    assert config_from_args(ap.parse_args(["--device", "cpu"])) == ServerConfig(device="cpu")  # same defaults
    cfg = config_from_args(ap.parse_args([
        "--device", "cpu", "--mode", "serial", "--lr", "3e-4", "--no-packed", "--betas", "0.8", "0.95",
        "--micro-batch-max-tokens", "512", "--max-model-len", "256", "--decode-split-k", "2", "4",
        "--no-overlap-schedule", "--seed", "7", "--rollout-ttl", "30", "--layers-per-unit", "4",
        "--no-reduce-every-pass", "--adv-estimator", "rloo", "--dual-clip", "none", "--lr-schedule-unit",
        "optimizer_step", "--no-use-kl-loss", "--kl-ctrl", "adaptive", "--kl-penalty", "abs",
        "--tensor-parallel", "2", "--tensor-parallel-vision"]))
    assert cfg.rl == RLConfig(mode="serial", lr=3e-4, packed=False, betas=(0.8, 0.95), micro_batch_max_tokens=512,
                              max_new_tokens=128, seed=7, adv_estimator="rloo", dual_clip=None,
                              lr_schedule_unit="optimizer_step", use_kl_loss=False, kl_ctrl="adaptive",
                              kl_penalty="abs")
    assert cfg.engine == EngineConfig(max_model_len=256, decode_split_k=(2, 4), overlap_schedule=False, seed=7)
    assert cfg.fsdp == FSDPConfig(layers_per_unit=4, reduce_every_pass=False)
    assert cfg.tp == TPConfig(tensor_parallel=2, tensor_parallel_vision=True)  # the plan is built from it
    assert cfg.rollout_ttl_s == 30.0 and cfg.checkpoint_root == str(Path("checkpoints").resolve())
    assert config_from_args(ap.parse_args(["--device", "cpu", "--checkpoint-root", "/srv/ck"])).checkpoint_root \
        == str(Path("/srv/ck").resolve())
    help_text = ap.format_help()
    assert "--max-new-tokens" in help_text and "(default: 128)" in help_text and "--kv-cache-tokens" in help_text
    with pytest.raises(SystemExit):  # choices come from the config's own lists
        ap.parse_args(["--loss-agg-mode", "bogus"])
    with pytest.raises(SystemExit):
        ap.parse_args(["--policy-loss", "bogus"])


def test_train_step_overrides_are_rl_config_fields():
    import dataclasses

    from rollplex.server.schemas import TrainStepRequest

    overrides = set(TrainStepRequest.model_fields) - {"rollout_id", "more_rollout_ids", "train_batch_size", "rewards",
                                                      "greedy_rewards", "reward", "off_policy"}
    assert overrides <= {f.name for f in dataclasses.fields(RLConfig)}
    req = TrainStepRequest(rollout_id="r", rewards=[1.0], lr=1e-4, micro_batch_prompts=2)
    assert dataclasses.replace(RLConfig(), **req.overrides()) == RLConfig(lr=1e-4, micro_batch_prompts=2)


def test_a_per_step_bound_declared_in_the_config_is_the_servers():
    import dataclasses

    import pydantic

    from rollplex.rl.config import PER_STEP, per_step
    from rollplex.server.schemas import TrainStepRequest, overrides_model

    lr = next(f for f in dataclasses.fields(RLConfig) if f.name == "lr").metadata[PER_STEP]
    assert TrainStepRequest.model_json_schema()["properties"]["lr"]["anyOf"][0]["maximum"] == lr["le"]

    @dataclasses.dataclass
    class Wider(RLConfig):  # one new field with a bound and one without: only the first is overridable
        probe: float = per_step(0.5, ge=0.0, le=2.0)
        startup_only: int = 3

    model = overrides_model(Wider)
    assert "probe" in model.model_fields and "startup_only" not in model.model_fields
    assert model.model_json_schema()["properties"]["probe"]["anyOf"][0] == {"type": "number", "minimum": 0.0,
                                                                           "maximum": 2.0}
    assert model(probe=1.5).probe == 1.5
    with pytest.raises(pydantic.ValidationError, match="probe"):
        model(probe=2.5)


def test_train_step_oom_is_507_and_changes_nothing(client, server, monkeypatch):
    import torch

    from rollplex.rl import actor as actor_mod

    ro = _rollout(client)
    before = _checksum(client)
    opt = server.state.rl.actor.optimizer
    opt_before = [t.clone() for t in opt.state_tensors()]

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(actor_mod, "token_logprobs", oom)
    r = client.post("/train_step", json={"rollout_id": ro["rollout_id"], "reward": "shape_color"})
    assert r.status_code == 507 and "unchanged" in r.json()["error"]["message"], r.text
    monkeypatch.undo()
    assert _checksum(client) == before
    assert all(torch.equal(a, b) for a, b in zip(opt_before, opt.state_tensors()))
    assert client.post("/generate", json={"text": "Color?", "sampling_params": GREEDY}).status_code == 200
    manager = client.get("/memory").json()["manager"]
    assert manager["phase"] == "rollout" and manager["state"]["kv_cache"] == "resident"
    r = client.post("/train_step", json={"rollout_id": ro["rollout_id"], "reward": "shape_color"})  # still retained
    assert r.status_code == 200, r.text
    assert _checksum(client) != before and "memory/update/resident_gib" in r.json()
    manager = client.get("/memory").json()["manager"]
    assert manager["phase"] == "update" and manager["state"]["kv_cache"] == "released"
    assert manager["phases"]["rollout"]["resident_bytes"]["kv_cache"] > 0


def test_frozen_vision_tower_reuses_the_rollouts_encodings(tiny_dir):
    """freeze_vision_tower: the retained rollout carries the prefill's vision encodings, the step trains
    the decoder and leaves the vision tower as it was; cosched and the fused schedule are refused (the server
    hosts neither)."""
    with serve_in_thread(_config(tiny_dir, freeze_vision_tower=True)) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        ro = _rollout(c, n_prompts=2, n=2)
        entry = srv.state.store.get(ro["rollout_id"])
        assert all(p.vision_embeds is not None for p in entry.batch.prompts)
        vis0 = [p.detach().clone() for p in srv.state.model.visual.parameters()]
        txt0 = srv.state.model.model.layers[0].mlp.down_proj.weight.detach().clone()
        r = c.post("/train_step", json={"rollout_id": ro["rollout_id"], "rewards": [1, 0, 0, 1]})
        assert r.status_code == 200, r.text
        assert all(torch.equal(a, b) for a, b in zip(vis0, srv.state.model.visual.parameters()))
        assert not torch.equal(txt0, srv.state.model.model.layers[0].mlp.down_proj.weight)
    with pytest.raises(ValueError, match="cosched"):
        _config(tiny_dir, cosched=True)
    with pytest.raises(ValueError, match="server's steps are phased"):  # no rollout to fuse into
        _config(tiny_dir, schedule="fused")
