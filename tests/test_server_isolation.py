"""One client cannot take the server down or slow it for others (tiny model on CPU).

Engine: a request that fails in a step is dropped alone and every other request's tokens equal a run
without it. Server: an attacker and a victim at once; the attacker is refused (status, message) and the
victim's answer equals its solo answer; per-request work is capped (stops, ids, rid, samples, JSON
shape, every text field); the HTTP surface is bounded (auth before any body, fixed metric labels, header
and body timeouts, a connection cap); intake is shared fairly and dropped when its client leaves. The
slow soak runs well-behaved clients training beside an attacker and holds their answers and final
weights equal to a run without it.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import torch
from server_helpers import wire_rows
from test_engine import _engine, _prompts

from rollplex.engine import EngineConfig, SamplingParams
from rollplex.engine.engine import Engine
from rollplex.rl.config import RLConfig
from rollplex.server import ServerConfig, serve_in_thread
from rollplex.server.limits import ServerLimits

GREEDY = {"temperature": 0, "max_new_tokens": 3}
SAMPLED = {"temperature": 1.0, "max_new_tokens": 4, "seed": 11, "n": 2}
LIMITS = ServerLimits(max_body_bytes=4 << 20, max_prompts=8, max_samples=24, max_stop=4, max_stop_chars=16,
                      max_stop_token_ids=8, max_rid_chars=32, max_json_containers=4096, header_timeout_s=1.0,
                      body_timeout_s=1.0, max_connections=24)
MARK = 424242  # the seed of requests the fault-injection tests corrupt inside the engine


# ---- the engine: a failing request is dropped alone -----------------------------------------------------
def _corrupt(where: str, eng: Engine, rid: str, proc) -> None:
    req = eng.requests[rid]
    if where == "sampling row":
        for s in req.seqs:
            s.seed = 2**64  # past int64: the batch's sampling tensors cannot be built
    elif where == "stop check":
        class Broken(list):
            def __contains__(self, tok):
                raise RuntimeError("stop check failed")
        req.params.stop_token_ids = Broken([1])
    elif where == "prefill":
        req.inputs.input_ids[1] = 10**6  # past the vocabulary: the batched prefill's embedding fails


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("where,after", [("sampling row", 0), ("sampling row", 2), ("stop check", 0),
                                         ("stop check", 3), ("prefill", 0)])
def test_engine_drops_a_failing_request_alone(tiny_dir, proc, where, after, overlap):
    prompts = _prompts(proc)
    params = [SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=5, ignore_eos=True),
              SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.7, max_new_tokens=7, n=3, seed=9, ignore_eos=True)]
    victims = [prompts[0], prompts[1], prompts[3]]
    solo = _engine(tiny_dir, proc, overlap_schedule=overlap).generate(victims, params)
    eng = _engine(tiny_dir, proc, overlap_schedule=overlap)
    ids = [eng.add_request(p, sp) for p, sp in zip(victims[:2], params[:2])]
    bad = eng.add_request(prompts[2], SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=1, ignore_eos=True))
    ids.append(eng.add_request(victims[2], params[2]))
    outs = {}
    for _ in range(after):
        outs.update({o.request_id: o for o in eng.step()})
    _corrupt(where, eng, bad, proc)
    while eng.has_work:
        outs.update({o.request_id: o for o in eng.step()})
    assert outs[bad].error is not None and all(s.finish_reason == "abort" for s in outs[bad].samples)
    for rid, ref in zip(ids, solo):
        got = outs[rid]
        assert got.error is None
        assert [s.token_ids for s in got.samples] == [s.token_ids for s in ref.samples]
        for a, b in zip(got.samples, ref.samples):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
    assert eng.blocks.num_free == eng.blocks.num_blocks - 1 and not eng.requests  # nothing leaked


def test_generate_raises_a_failing_prompt(tiny_dir, proc):
    eng = _engine(tiny_dir, proc)
    bad = SamplingParams(temperature=1.0, max_new_tokens=3, seed=1)
    bad.seed = 2**64  # set after validation: the engine meets it only in a step
    with pytest.raises(ValueError, match="Overflow"):  # torch's, building the seed tensor
        eng.generate(_prompts(proc)[:2], [SamplingParams(temperature=0, max_new_tokens=3), bad])
    assert not eng.has_work and not eng.requests and eng.blocks.num_free == eng.blocks.num_blocks - 1


def test_seed_range_counts_the_samples():
    SamplingParams(seed=2**63 - 2, n=2)
    with pytest.raises(ValueError, match=r"2\*\*63 - n"):
        SamplingParams(seed=2**63 - 1, n=2)


# ---- the server ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    cfg = ServerConfig(model=str(tiny_dir), device="cpu", limits=LIMITS, intake_threads=2,
                       rl=RLConfig(n=2, lr=1e-3, kl_coef=0.0, max_new_tokens=3),
                       engine=EngineConfig(max_model_len=256, kv_cache_tokens=8192, max_num_seqs=16),
                       checkpoint_root=str(tmp_path_factory.mktemp("ckpt-isolation")))
    srv = serve_in_thread(cfg)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def message(r: httpx.Response) -> str:
    return r.json()["error"]["message"]


def weights(server) -> float:
    with torch.no_grad():
        return sum(float(p.double().sum()) for p in server.state.model.parameters())


VICTIM = {"text": ["What color is the", "Name a shape"], "sampling_params": SAMPLED}


def _at_once(server, attack: dict, victim: dict = VICTIM) -> tuple[httpx.Response, httpx.Response]:
    """The attacker's and the victim's /generate, admitted to the engine together: the engine thread is held
    until both are queued (or refused), so they share their first step."""
    out, gate = {}, threading.Event()
    server.state.worker.call(lambda: gate.wait(30))

    def send(name, body):
        out[name] = httpx.post(server.url + "/generate", json=body, timeout=60)

    threads = [threading.Thread(target=send, args=(k, b)) for k, b in (("attack", attack), ("victim", victim))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while len(server.state.worker._jobs) + len(out) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    gate.set()
    for t in threads:
        t.join(60)
    return out["attack"], out["victim"]


def _tokens(r: httpx.Response) -> list:
    assert r.status_code == 200, r.text
    return [x["output_ids"] for x in r.json()]


def test_a_seed_past_int64_fails_alone(client, server):
    solo = _tokens(client.post("/generate", json=VICTIM))
    before = weights(server)
    attack, victim = _at_once(server, {"text": "hi", "sampling_params": {"seed": 2**63 - 1, "n": 2,
                                                                         "max_new_tokens": 3}})
    assert attack.status_code == 400 and "seed" in message(attack) and "2**63" in message(attack), attack.text
    assert _tokens(victim) == solo
    r = client.post("/rollout", json={"prompts": wire_rows(2), "n": 2, "sampling_params": {"seed": 2**63 - 3}})
    assert r.status_code == 400 and "seed + i*n + j" in message(r) and f"at most {2**63 - 4}" in message(r), r.text
    r = client.post("/rollout", json={"prompts": wire_rows(2), "n": 2, "for_training": False,
                                      "sampling_params": {"seed": 2**63 - 4, "max_new_tokens": 2}})
    assert r.status_code == 200, r.text  # the last seed that fits
    assert weights(server) == before and _tokens(client.post("/generate", json=VICTIM)) == solo


def test_a_request_failing_in_the_engine_fails_alone(client, server, monkeypatch):
    """A value that escapes validation and breaks the engine's step breaks only its own request."""
    solo = _tokens(client.post("/generate", json=VICTIM))
    add = Engine.add

    def add_then_corrupt(self, req, request_id=None):
        rid = add(self, req, request_id)
        if req.params.seed == MARK:
            for s in req.seqs:
                s.seed = 2**64
        return rid

    monkeypatch.setattr(Engine, "add", add_then_corrupt)
    attack, victim = _at_once(server, {"text": "hi", "sampling_params": {**SAMPLED, "seed": MARK}})
    assert attack.status_code == 500 and "engine error" in message(attack), attack.text
    assert _tokens(victim) == solo
    monkeypatch.undo()
    assert _tokens(client.post("/generate", json=VICTIM)) == solo and server.state.engine_counts()["running"] == 0


def test_per_request_work_is_capped(client, server):
    cases = [
        ({"text": "hi", "sampling_params": {"stop": ["a", "b", "c", "d", "e"]}}, "5 stop strings", "--max-stop"),
        ({"text": "hi", "sampling_params": {"stop": "x" * 17}}, "17 characters", "--max-stop-chars"),
        ({"text": "hi", "sampling_params": {"stop_token_ids": list(range(9))}}, "9 ids", "--max-stop-token-ids"),
        ({"text": "hi", "rid": "r" * 33}, "rid of 33 characters", "--max-rid-chars"),
        ({"text": ["a", "b"], "rid": ["ok", "r" * 40]}, "rid[1]", "--max-rid-chars"),
        ({"text": ["a"] * 7, "sampling_params": {"n": 4}}, "28 samples", "--max-samples"),
    ]
    for body, what, flag in cases:
        r = client.post("/generate", json=body)
        assert r.status_code == 400 and what in message(r) and flag in message(r), (body, r.text)
    row = wire_rows(1)[0]
    r = client.post("/rollout", json={"prompts": [row] * 7, "n": 4})
    assert r.status_code == 400 and "28 samples" in message(r) and "--max-samples" in message(r), r.text
    r = client.post("/rollout", json={"prompts": [row], "sampling_params": {"stop": ["a"] * 5}})
    assert r.status_code == 400 and "--max-stop" in message(r), r.text
    cap = server.state.cfg.limits.prompt_chars(256)
    role = {"messages": [{"role": "u" * cap, "content": "hi"}]}  # the role reaches the chat template too
    r = client.post("/rollout", json={"prompts": [role]})
    assert r.status_code == 400 and "--max-prompt-chars" in message(r), r.text
    kind = {"messages": [{"role": "user", "content": [{"type": "t" * cap, "text": "hi"}]}]}
    r = client.post("/rollout", json={"prompts": [kind]})
    assert r.status_code == 400 and "--max-prompt-chars" in message(r), r.text
    r = client.post("/generate", json={"text": "hi", "rid": "r" * 32, "sampling_params": {"stop": ["a"] * 4}})
    assert r.status_code == 200 and r.json()["meta_info"]["id"] == "r" * 32, r.text  # at the caps: served


def _health_latency_during(server, send) -> tuple[float, object]:
    """The slowest /health answer while `send()` runs in another thread, and what send returned."""
    result, worst = {}, 0.0
    t = threading.Thread(target=lambda: result.update(r=send()))
    with httpx.Client(base_url=server.url, timeout=60) as c:
        c.get("/health")
        t.start()
        while t.is_alive():
            t0 = time.perf_counter()
            assert c.get("/health").status_code == 200
            worst = max(worst, time.perf_counter() - t0)
            time.sleep(0.005)
    t.join()
    return worst, result["r"]


def test_a_large_body_does_not_freeze_the_event_loop(client, server):
    head = b'{"text": "hi", "input_ids": ['
    many_lists = head + b",".join([b"[1]"] * ((4 << 20) // 5)) + b"]}"  # ~840k arrays, under 4 MiB
    worst, r = _health_latency_during(server, lambda: httpx.post(
        server.url + "/generate", content=many_lists, headers={"Content-Type": "application/json"}, timeout=60))
    assert r.status_code == 413 and "--max-json-containers" in message(r), r.text[:300]
    assert worst < 0.5, worst
    ints = b'{"input_ids": [' + b",".join([b"7"] * ((4 << 20) // 2 - 16)) + b"]}"  # 2M numbers: one prompt
    worst, r = _health_latency_during(server, lambda: httpx.post(
        server.url + "/generate", content=ints, headers={"Content-Type": "application/json"}, timeout=60))
    assert r.status_code == 400 and "exceed max_model_len=256" in message(r), r.text[:300]
    assert worst < 1.0, worst
    r = client.post("/generate", content=b'{"text": [', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in message(r), r.text


# ---- the HTTP surface -----------------------------------------------------------------------------------------
def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _answer(s: socket.socket) -> bytes:
    """One HTTP answer (headers + Content-Length bytes), or what came before the server closed."""
    data = b""
    try:
        while got := s.recv(65536):
            data += got
            head, sep, body = data.partition(b"\r\n\r\n")
            if sep:
                length = [int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                          if line.startswith(b"content-length:")]
                if length and len(body) >= length[0]:
                    break
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def test_metric_labels_are_a_fixed_set(client, server):
    for i in range(40):
        with _connect(server.url) as s:
            s.sendall(b"MADEUP%d /health HTTP/1.1\r\nHost: x\r\n\r\n" % i)
            _answer(s)
        client.get(f"/no/such/path/{i}")
    text = client.get("/metrics").text
    rows = [line for line in text.splitlines() if line.startswith("rollplex_http_requests_total{")]
    methods = {line.split('method="')[1].split('"')[0] for line in rows}
    routes = {line.split('route="')[1].split('"')[0] for line in rows}
    assert methods <= {"GET", "POST", "HEAD", "OPTIONS", "PUT", "DELETE", "PATCH", "other"}, methods
    assert "other" in methods and not any(r.startswith("/no/") for r in routes), routes


def test_no_body_is_read_outside_the_body_routes(server):
    """OPTIONS, GETs and unknown routes answer without waiting for a body they will never use."""
    for head in (b"OPTIONS /generate", b"POST /health", b"GET /metrics", b"POST /nope"):
        with _connect(server.url) as s:
            s.sendall(head + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 3000000\r\n\r\n" + b"{" * 1000)
            t0 = time.perf_counter()
            answer = _answer(s)
            assert answer[:12] in (b"HTTP/1.1 200", b"HTTP/1.1 404", b"HTTP/1.1 405"), (head, answer[:200])
            assert time.perf_counter() - t0 < 0.9, head  # before the body timeout: nothing waited for it


def test_a_stalled_body_is_408(client, server):
    with _connect(server.url) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"text\": ")
        t0 = time.perf_counter()
        answer = _answer(s)
    assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout-s" in answer, answer[:300]
    assert time.perf_counter() - t0 < 5
    assert client.post("/generate", json={"text": "hi", "sampling_params": GREEDY}).status_code == 200


def test_slow_headers_and_idle_connections_are_closed(client, server):
    idle, slow = _connect(server.url), _connect(server.url)
    slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the end of the headers
    t0 = time.perf_counter()
    for s in (idle, slow):
        assert s.recv(1024) == b""  # closed by the server
        s.close()
    assert time.perf_counter() - t0 < 5
    assert client.get("/health").status_code == 200


def test_connections_over_the_cap_are_closed(client, server):
    held = []
    try:
        for _ in range(40):
            held.append(_connect(server.url))
        time.sleep(0.3)
        closed = 0
        for s in held:
            s.settimeout(0.3)
            try:
                closed += s.recv(1) == b""
            except TimeoutError:
                pass
            except ConnectionResetError:
                closed += 1
        assert closed >= 40 - LIMITS.max_connections, closed
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    assert client.post("/generate", json={"text": "hi", "sampling_params": GREEDY}).status_code == 200


def test_an_empty_api_key_is_a_startup_error(tiny_dir, monkeypatch):
    from rollplex.server.__main__ import config_from_args, main, parser

    with pytest.raises(ValueError, match="API key is empty"):
        config_from_args(parser().parse_args(["--api-key", ""]))
    monkeypatch.setenv("ROLLPLEX_API_KEY", "  ")
    with pytest.raises(ValueError, match="API key is empty"):
        config_from_args(parser().parse_args([]))
    with pytest.raises(SystemExit, match="API key is empty"):
        main(["--api-key", "", "--model", str(tiny_dir), "--device", "cpu"])
    with pytest.raises(ValueError, match="API key is empty"):
        serve_in_thread(ServerConfig(model=str(tiny_dir), device="cpu", api_key=""))
    monkeypatch.setenv("ROLLPLEX_API_KEY", "k")
    assert config_from_args(parser().parse_args([])).api_key == "k"


def test_auth_comes_before_any_body(tiny_dir):
    cfg = ServerConfig(model=str(tiny_dir), device="cpu", api_key="secret", limits=LIMITS,
                       engine=EngineConfig(max_model_len=256, kv_cache_tokens=4096, max_num_seqs=8))
    with serve_in_thread(cfg) as srv:
        for method in (b"OPTIONS", b"POST", b"PUT"):
            with _connect(srv.url) as s:
                s.sendall(method + b" /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 3000000\r\n\r\n")
                t0 = time.perf_counter()
                answer = _answer(s)
            assert answer.startswith(b"HTTP/1.1 401"), (method, answer[:200])
            assert time.perf_counter() - t0 < 0.9, method
        ok = httpx.post(srv.url + "/generate", json={"text": "hi", "sampling_params": GREEDY},
                        headers={"Authorization": "Bearer secret"}, timeout=60)
        assert ok.status_code == 200, ok.text


# ---- intake: shared fairly, dropped when the client leaves ---------------------------------------------------
def test_intake_is_shared_between_requests(client, server, heavy_encode):
    heavy = {"text": [f"HEAVY {i}" for i in range(6)], "sampling_params": GREEDY}
    answers = []
    attackers = [threading.Thread(target=lambda: answers.append(
        httpx.post(server.url + "/generate", json=heavy, timeout=60))) for _ in range(2)]
    for t in attackers:
        t.start()
    while len(heavy_encode) < 2:
        time.sleep(0.005)
    t0 = time.perf_counter()
    r = client.post("/generate", json={"text": "What color is the", "sampling_params": GREEDY})
    waited = time.perf_counter() - t0
    for t in attackers:
        t.join(60)
    assert r.status_code == 200 and all(a.status_code == 200 for a in answers)
    # one heavy prompt per intake thread ahead of it at most (0.25 s), not the attackers' 6 x 0.25 s each
    assert waited < 0.9, waited


def test_intake_stops_when_the_client_leaves(client, server, heavy_encode):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/generate", json={"text": [f"HEAVY {i}" for i in range(8)],
                                                    "sampling_params": GREEDY}, timeout=0.4)
    time.sleep(2.5)  # all 8 would have run by now (8 x 0.25 s over 2 threads)
    assert len(heavy_encode) <= 4, len(heavy_encode)
    assert client.post("/generate", json={"text": "hi", "sampling_params": GREEDY}).status_code == 200


# ---- soak: good clients beside an attacker ---------------------------------------------------------------------
def _hostile(url: str, stop: threading.Event, counts: dict) -> None:
    bodies = [{"text": "hi", "sampling_params": {"seed": 2**63 - 1, "n": 2}},
              {"text": "hi", "sampling_params": {"stop": ["s"] * 100}},
              {"text": "hi", "sampling_params": {"stop_token_ids": list(range(100))}},
              {"text": "hi", "rid": "r" * 10_000},
              {"text": ["a"] * 8, "sampling_params": {"n": 16}}]
    raw = [b"OPTIONS /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n",
           b"BREW /health HTTP/1.1\r\nHost: x\r\n\r\n",
           b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",
           b"POST /rollout HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 50000\r\n\r\n"
           + b"[" * 50000]
    i = 0
    with httpx.Client(base_url=url, timeout=60) as c:
        while not stop.is_set():
            r = c.post("/generate", json=bodies[i % len(bodies)])
            counts[r.status_code] = counts.get(r.status_code, 0) + 1
            r = c.post("/rollout", json={"prompts": wire_rows(1), "n": 2, "sampling_params": {"seed": 2**63 - 1},
                                           "for_training": False})  # sample 0 fits int64, sample 1 does not
            counts[r.status_code] = counts.get(r.status_code, 0) + 1
            with _connect(url) as s:
                s.sendall(raw[i % len(raw)])
                _answer(s)
            i += 1


def _good_run(tiny_dir, tmp_path, attack: bool) -> tuple[list, str, dict]:
    cfg = ServerConfig(model=str(tiny_dir), device="cpu", limits=LIMITS, intake_threads=2,
                       rl=RLConfig(n=2, lr=1e-3, kl_coef=0.0, max_new_tokens=3, seed=0),
                       engine=EngineConfig(max_model_len=256, kv_cache_tokens=8192, max_num_seqs=16),
                       checkpoint_root=str(tmp_path))
    counts: dict = {}
    answers = []
    with serve_in_thread(cfg) as srv:
        stop = threading.Event()
        attacker = threading.Thread(target=_hostile, args=(srv.url, stop, counts))
        if attack:
            attacker.start()
        try:
            with httpx.Client(base_url=srv.url, timeout=120) as c:
                for step in range(16):
                    r = c.post("/rollout", json={"prompts": wire_rows(2, seed=step), "n": 2,
                                                 "sampling_params": {"seed": 100 * step}})
                    assert r.status_code == 200, r.text
                    roll = r.json()
                    answers.append([s["token_ids"] for s in roll["samples"]])
                    rewards = [float(len(s["token_ids"]) % 3) - float(s["token_ids"][0] % 2) for s in roll["samples"]]
                    r = c.post("/train_step", json={"rollout_id": roll["rollout_id"], "rewards": rewards})
                    assert r.status_code == 200, r.text
                    g = c.post("/generate", json={**VICTIM, "sampling_params": {**SAMPLED, "seed": step}})
                    answers.append(_tokens(g))
                checksum = c.get("/checksum").json()
        finally:
            stop.set()
            if attack:
                attacker.join(60)
    return answers, checksum["weights_checksum"], counts


@pytest.mark.slow
def test_soak_good_clients_beside_an_attacker(tiny_dir, tmp_path):
    calm, calm_sum, _ = _good_run(tiny_dir, tmp_path / "calm", attack=False)
    busy, busy_sum, counts = _good_run(tiny_dir, tmp_path / "busy", attack=True)
    assert busy == calm and busy_sum == calm_sum
    assert counts and set(counts) == {400}, counts  # every hostile request refused, none served or crashed
