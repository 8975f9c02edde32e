"""Concurrent requests on the hybrid server (tiny model on CPU, a real uvicorn on loopback).

* 64 separate /generate calls sent together run as one continuous batch: they finish within 1.3x the
  time of one batched call of the same 64 prompts (the client is 64 threads on connections opened
  beforehand, so what is timed is the server, not the client's connection setup).
* Intake does not hold up decoding: while a prompt is being encoded (made slow here), the engine
  keeps decoding the requests already running, because prompts are encoded off the engine thread.
* Engine.prepare validates without touching the engine; Engine.add gives ids and seeds in order.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from rollplex.engine import Engine, EngineConfig, SamplingParams
from rollplex.processor import VLProcessor
from rollplex.rl.config import RLConfig
from rollplex.server import ServerConfig, serve_in_thread
from rollplex.tiny import write_tiny

N_PROMPTS, PROMPT_LEN, NEW_TOKENS = 64, 48, 64
SAMPLING = {"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": 1.0}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny-concurrency"), seed=0)


@pytest.fixture(scope="module")
def server(tiny_dir):
    engine = EngineConfig(max_model_len=256, kv_cache_tokens=16384, max_num_seqs=N_PROMPTS)
    srv = serve_in_thread(ServerConfig(model=str(tiny_dir), device="cpu", rl=RLConfig(kl_coef=0.0), engine=engine))
    yield srv
    srv.stop()


def _connect(server) -> http.client.HTTPConnection:
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    conn.connect()
    return conn


def _post(conn: http.client.HTTPConnection, body: dict):
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    assert resp.status == 200, data[:500]
    return json.loads(data)


def _generate(server, body: dict):
    conn = _connect(server)
    try:
        return _post(conn, body)
    finally:
        conn.close()


def _prompts() -> list[list[int]]:
    return [[5 + (i * 7 + j) % 200 for j in range(PROMPT_LEN)] for i in range(N_PROMPTS)]


def _batched(server) -> float:
    t0 = time.perf_counter()
    out = _generate(server, {"input_ids": _prompts(), "sampling_params": SAMPLING})
    dt = time.perf_counter() - t0
    assert [o["meta_info"]["completion_tokens"] for o in out] == [NEW_TOKENS] * N_PROMPTS
    return dt


def _concurrent(server) -> float:
    conns = [_connect(server) for _ in range(N_PROMPTS)]
    start = threading.Barrier(N_PROMPTS + 1)
    outs: list = [None] * N_PROMPTS

    def call(i):
        start.wait()
        outs[i] = _post(conns[i], {"input_ids": _prompts()[i], "sampling_params": SAMPLING})

    threads = [threading.Thread(target=call, args=(i,)) for i in range(N_PROMPTS)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    for c in conns:
        c.close()
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [NEW_TOKENS] * N_PROMPTS
    return dt


def test_concurrent_generates_run_as_one_batch(server):
    _batched(server)  # warm-up
    ratios = []
    for _ in range(3):  # best of three: other work on the machine may slow one of them down
        batched = _batched(server)
        ratios.append(_concurrent(server) / batched)
        if ratios[-1] <= 1.3:
            break
    assert min(ratios) <= 1.3, f"64 concurrent /generate calls took {[round(r, 2) for r in ratios]}x one batched call"


def test_encoding_a_prompt_does_not_stall_decoding(server, monkeypatch):
    engine = server.state.engine
    running = threading.Thread(target=lambda: _generate(server, {
        "input_ids": _prompts()[0], "sampling_params": {**SAMPLING, "max_new_tokens": 200}}))
    running.start()
    deadline = time.monotonic() + 30
    start = engine.decode_steps
    while engine.decode_steps < start + 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    steps_while_encoding = []
    encode = VLProcessor.encode

    def slow_encode(self, *args, **kwargs):  # e.g. a large image being preprocessed
        before = engine.decode_steps
        time.sleep(0.5)
        steps_while_encoding.append(engine.decode_steps - before)
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(VLProcessor, "encode", slow_encode)
    out = _generate(server, {"text": "What color is the", "sampling_params": {"max_new_tokens": 4}})
    monkeypatch.undo()
    running.join(60)
    assert out["meta_info"]["completion_tokens"] >= 1
    assert steps_while_encoding and steps_while_encoding[0] >= 3, \
        f"the engine made {steps_while_encoding} decode steps while a prompt was being encoded"


def test_prepare_touches_no_engine_state_and_add_orders_ids(tiny_dir):
    engine = Engine.from_pretrained(tiny_dir, config=EngineConfig(max_model_len=64, kv_cache_tokens=1024))
    proc = VLProcessor.from_pretrained(tiny_dir)  # a second thread's own processor
    rng_state = engine._rng.getstate()
    sp = SamplingParams(max_new_tokens=4, n=2, temperature=1.0)
    a = engine.prepare([5, 6, 7], sp)
    b = engine.prepare("What color is the", sp, processor=proc)
    assert not engine.requests and not engine.scheduler.waiting and engine._rng.getstate() == rng_state
    for bad in ([], [10**6], [5] * 64):  # empty, outside the vocabulary, longer than max_model_len
        with pytest.raises(ValueError):
            engine.prepare(bad, sp)
    with pytest.raises(ValueError, match="placeholder|image"):  # an image token without an image
        engine.prepare([5, engine.model.cfg.image_token_id, 6], sp)
    assert engine.add(b) == "req-0" and engine.add(a) == "req-1"
    assert list(engine.scheduler.waiting) == [b, a] and len(set(a.seeds + b.seeds)) == 4
    with pytest.raises(AssertionError):
        engine.add(a)  # a prepared request is added once
    assert [s.seed for s in a.seqs] == a.seeds and [s.seed for s in b.seqs] == b.seeds
    c = engine.prepare([5, 6, 7], SamplingParams(max_new_tokens=4, n=2, temperature=1.0, seed=3))
    engine.add(c)
    assert [s.seed for s in c.seqs] == [3, 4]  # a request's own seed: seed + sample index
    outs = {}
    while engine.has_work:
        outs.update({o.request_id: o for o in engine.step()})
    assert sorted(outs) == ["req-0", "req-1", "req-2"]
    assert [len(s.token_ids) for o in outs.values() for s in o.samples] == [4] * 6
