"""`python -m rollplex.bench serve --load`: the served path under load, against one started server.

This process is the client; the server is `python -m rollplex.server` in a subprocess, started on
empty caches under --cache-root (decode tuning through --tuning-cache-dir, TorchInductor and Triton
through their environment variables). N prompts of --prompt-len random token ids; every prompt
decodes exactly --max-new-tokens (ignore_eos); tok/s = generated tokens / wall time.

1. Cold start: seconds until /health answers, and the server's own phase times (/health startup_s).
2. Correctness: the N prompts as one batched /generate and as N concurrent /generate calls, greedy,
   --check-tokens tokens. Outputs must have that length, and where a concurrent output differs from the
   batched call's, the two tokens at the first difference must be a near tie: their logprobs given the
   common context (one prefill of both continuations) differ by at most --tie-tolerance nats. Kernels
   picked per batch size round differently in bf16 and may flip a near-tied argmax of a random-weight
   model; a request answered with another prompt's tokens or garbage differs by whole nats. The first
   call's wall time is reported as the cold server's first request (compiles still pending at ready).
3. A warm-up of 4 sampled tokens in each of the three patterns below, then per repeat, at
   --temperature: (a) engine speed, all N prompts in one /generate; (b) the same
   prompts as N separate concurrent /generate calls, their tok/s and its ratio to (a) (goal >= 0.80);
   (c) the same as N streaming calls: time to first token (first SSE chunk holding a token, from the
   request's own start) p50 / p99, and streamed tok/s; (d) the same N calls from one `httpx.AsyncClient`
   (what Python RL drivers use: `json=` bodies, `.json()` answers) whose pool holds N connections, and
   (e) from one with httpx's default pool (100 connections: beyond that, requests queue in the client);
   (f) the client's ceiling: (d)'s client against a canned endpoint (a bare asyncio HTTP server in a
   subprocess answering every POST at once with one real /generate answer's bytes), no engine work.
   Where (f)'s tok/s is not well above (a), the client bounds (d); where it is, the server does.
4. Warm start: the server stopped and started again on the same caches: seconds to ready, its phases,
   its first request, and whether that request's greedy tokens equal the cold server's.

The raw client speaks HTTP/1.1 over `asyncio.open_connection`, one connection per request opened when
the request starts and closed after its answer, as N independent clients would. Its request bodies are
encoded before the clock starts; streamed chunks are parsed only up to the first token and for the last
event. The httpx client keeps its connections between rounds (opened by the warm-up), as a driver does.

Prints one JSON line per measurement and two tables last (the run; per client: requests, tok/s, ratio
to the batched call, latency p50 / p99); exits 1 if a request fails or the check does.

    python -m rollplex.bench serve --load --model qwen2.5-vl-3b
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from .server_proc import server_command, start_server, stop_server, wait_ready


class BenchError(RuntimeError):
    """A request failed or answered something other than what was asked."""


class OutputMismatch(BenchError, ValueError):
    """Concurrent outputs differ from the batched call's in a way bf16 rounding does not explain."""


# ---- HTTP/1.1 client: one connection per request -----------------------------------------------------
@dataclass
class Reply:
    status: int
    body: bytes  # the whole body (non-streaming), or the last data event before [DONE] (streaming)
    start: float  # perf_counter when the request began (before connecting)
    end: float  # perf_counter when its answer was complete
    first_token: float | None = None  # streaming: perf_counter of the first chunk holding a token
    done: bool = False  # streaming: [DONE] arrived


class _Events:
    """Server-sent events of one streaming answer: the first event with a token is timed and parsed, later
    ones are kept unparsed (only the last, the sample's final chunk, is read)."""

    def __init__(self, reply: Reply):
        self.reply, self.buf = reply, b""

    def feed(self, data: bytes) -> None:
        self.buf += data
        while (i := self.buf.find(b"\n\n")) >= 0:
            event, self.buf = self.buf[:i], self.buf[i + 2 :]
            if not event.startswith(b"data: "):
                continue
            payload = event[6:]
            if payload == b"[DONE]":
                self.reply.done = True
                continue
            if self.reply.first_token is None and json.loads(payload).get("output_ids"):
                self.reply.first_token = time.perf_counter()
            self.reply.body = payload


async def post(host: str, port: int, path: str, body: bytes, stream: bool = False) -> Reply:
    """POST `body` (JSON) on a new connection; reads the answer (Content-Length, chunked, or to EOF)."""
    reply = Reply(0, b"", time.perf_counter(), 0.0)
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 22)
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()
        status = await reader.readline()
        reply.status = int(status.split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        parts: list[bytes] = []
        sink = _Events(reply).feed if stream and reply.status == 200 else parts.append
        if "content-length" in headers:
            sink(await reader.readexactly(int(headers["content-length"])))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            while (size := int((await reader.readline()).split(b";")[0], 16)) > 0:
                sink((await reader.readexactly(size + 2))[:-2])
        else:
            sink(await reader.read())
        if parts:
            reply.body = b"".join(parts)
    finally:
        writer.close()
    reply.end = time.perf_counter()
    return reply


def _address(url: str) -> tuple[str, int]:
    u = urlsplit(url)
    return u.hostname, u.port


def _generate_body(prompts, sp, **extra) -> bytes:
    return json.dumps({"input_ids": prompts, "sampling_params": sp, **extra}).encode()


def _ok(reply: Reply, what: str) -> Reply:
    if reply.status != 200:
        raise BenchError(f"{what}: HTTP {reply.status}: {reply.body[:500].decode(errors='replace')}")
    return reply


def _output(item: dict, max_new_tokens: int, what: str) -> list[int]:
    if "error" in item:
        raise BenchError(f"{what}: {item['error']}")
    ids = item["output_ids"]
    if len(ids) != max_new_tokens or item["meta_info"]["completion_tokens"] != max_new_tokens:
        raise BenchError(f"{what}: {len(ids)} tokens instead of {max_new_tokens} (ignore_eos)")
    return ids


async def batched(url: str, prompts: list[list[int]], sp: dict) -> tuple[float, list[list[int]]]:
    """(wall s, outputs) of one /generate holding every prompt."""
    host, port = _address(url)
    body = _generate_body(prompts, sp)
    r = _ok(await post(host, port, "/generate", body), "batched /generate")
    items = json.loads(r.body)
    return r.end - r.start, [_output(it, sp["max_new_tokens"], f"batched output {i}") for i, it in enumerate(items)]


async def concurrent(url: str, prompts: list[list[int]], sp: dict, stream: bool = False) -> tuple[float, list[Reply]]:
    """(wall s, replies) of one /generate per prompt, all sent at once."""
    host, port = _address(url)
    bodies = [_generate_body(p, sp, stream=stream) for p in prompts]
    t0 = time.perf_counter()
    replies = await asyncio.gather(*(post(host, port, "/generate", b, stream) for b in bodies))
    for i, r in enumerate(replies):
        _ok(r, f"/generate {i}")
        if stream and not (r.done and r.first_token is not None):
            raise BenchError(f"stream {i} ended without [DONE] or without a token: {r.body[:300]!r}")
    return max(r.end for r in replies) - t0, replies


def outputs_of(replies: list[Reply], max_new_tokens: int) -> list[list[int]]:
    return [_output(json.loads(r.body), max_new_tokens, f"output {i}") for i, r in enumerate(replies)]


# ---- httpx.AsyncClient: what Python RL drivers use ----------------------------------------------------
def httpx_client(pool: int | None):
    """One AsyncClient as a driver makes it: `pool` connections kept alive (None: httpx's defaults, 100
    connections and 20 kept alive), no timeout (a long generation is not an error)."""
    import httpx

    limits = httpx.Limits() if pool is None else httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
    return httpx.AsyncClient(limits=limits, timeout=None)


async def httpx_concurrent(client, url: str, prompts: list[list[int]], sp: dict) -> tuple[float, list[Reply]]:
    """(wall s, replies) of one /generate per prompt from `client`, all at once; each request's time includes
    the client's encoding of its JSON body and decoding of the answer (`.json()`), as a driver's does."""
    async def one(p):
        start = time.perf_counter()
        r = await client.post(f"{url}/generate", json={"input_ids": p, "sampling_params": sp})
        r.json()
        return Reply(r.status_code, r.content, start, time.perf_counter())

    t0 = time.perf_counter()
    replies = await asyncio.gather(*(one(p) for p in prompts))
    for i, r in enumerate(replies):
        _ok(r, f"httpx /generate {i}")
    return max(r.end for r in replies) - t0, replies


async def httpx_rounds(url: str, prompts: list[list[int]], pool: int | None, warm: dict,
                       sp: dict) -> tuple[float, list[Reply]]:
    """A new client: one warm-up round (`warm`: opens its connections), then the timed round (`sp`)."""
    async with httpx_client(pool) as client:
        await httpx_concurrent(client, url, prompts, warm)
        return await httpx_concurrent(client, url, prompts, sp)


async def _canned(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answer: bytes) -> None:
    try:
        while await reader.readline() not in (b"", b"\r\n"):  # the request line
            length = 0
            while (h := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = h.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            writer.write(answer)
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


def canned_server(port: int, body_file: str) -> None:
    """Answer every POST on 127.0.0.1:`port` at once with the JSON in `body_file` (keep-alive HTTP/1.1):
    the client ceiling's endpoint, run in its own process so that it takes no time from the client's."""
    body = Path(body_file).read_bytes()
    answer = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)) + body

    async def main():
        server = await asyncio.start_server(lambda r, w: _canned(r, w, answer), "127.0.0.1", port, backlog=4096)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def start_canned(port: int, body: bytes, workdir: str, timeout: float = 30.0) -> subprocess.Popen:
    path = os.path.join(workdir, "canned.json")
    Path(path).write_bytes(body)
    proc = subprocess.Popen([sys.executable, "-c", f"from rollplex.bench.serve_load import canned_server; "
                             f"canned_server({port}, {path!r})"])
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:  # ready when it accepts a connection
        if proc.poll() is not None:
            raise BenchError(f"the canned endpoint exited with code {proc.returncode}")
        try:
            reply = asyncio.run(post("127.0.0.1", port, "/generate", b"{}"))
            if reply.status == 200 and reply.body == body:
                return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise BenchError(f"the canned endpoint on port {port} did not answer within {timeout:.0f} s")


# ---- correctness ----------------------------------------------------------------------------------------
def divergences(batched_out: list[list[int]], concurrent_out: list[list[int]], tokens: int) -> list[tuple[int, int]]:
    """(prompt, first differing position) of each prompt whose two outputs differ; OutputMismatch if the
    counts differ or an output does not have `tokens` tokens."""
    if len(batched_out) != len(concurrent_out):
        raise OutputMismatch(f"{len(concurrent_out)} concurrent outputs for {len(batched_out)} prompts")
    out = []
    for j, (a, b) in enumerate(zip(batched_out, concurrent_out)):
        if len(a) != tokens or len(b) != tokens:
            raise OutputMismatch(f"prompt {j}: {len(a)} batched / {len(b)} concurrent tokens, expected {tokens}")
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is not None:
            out.append((j, i))
    return out


def check_outputs(batched_out: list[list[int]], concurrent_out: list[list[int]], tokens: int,
                  tie_gaps: Callable[[list[tuple[int, int]]], list[float]], tolerance: float) -> dict:
    """Greedy outputs of the same prompts, batched and concurrent: equal, or first differing at a near tie.
    tie_gaps((prompt, position) pairs) -> |logprob difference| of the two tokens there given the common
    context. Raises OutputMismatch; returns a summary."""
    div = divergences(batched_out, concurrent_out, tokens)
    gaps = tie_gaps(div) if div else []
    bad = [(j, i, round(g, 3)) for (j, i), g in zip(div, gaps) if not g <= tolerance]
    summary = {"prompts": len(batched_out), "tokens": tokens, "equal": len(batched_out) - len(div),
               "near_ties": len(div) - len(bad), "first_difference": sorted(i for _, i in div),
               "max_tie_gap": round(max(gaps), 4) if gaps else 0.0, "tolerance": tolerance}
    if bad:
        raise OutputMismatch(f"{len(bad)} of {len(batched_out)} concurrent outputs differ from the batched call's "
                             f"greedy tokens where the two tokens are not a near tie; (prompt, position, logprob "
                             f"gap): {bad[:8]}; {summary}")
    return summary


async def tie_gaps(url: str, prompts: list[list[int]], a: list[list[int]], b: list[list[int]],
                   where: list[tuple[int, int]]) -> list[float]:
    """|log p(a[j][i]) - log p(b[j][i])| given prompt j + a[j][:i], both from one prefill (one /generate)."""
    host, port = _address(url)
    inputs, starts = [], []
    for j, i in where:
        for out in (a[j], b[j]):
            inputs.append(prompts[j] + out[: i + 1])
            starts.append(len(prompts[j]) + i)
    body = json.dumps({"input_ids": inputs, "return_logprob": True, "logprob_start_len": starts,
                       "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}).encode()
    items = json.loads(_ok(await post(host, port, "/generate", body), "tie check /generate").body)
    lps = [it["meta_info"]["input_token_logprobs"][0][0] for it in items]
    return [abs(x - y) for x, y in zip(lps[0::2], lps[1::2])]


# ---- the run ------------------------------------------------------------------------------------------
def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


@dataclass
class LoadConfig:
    prompts: int = 256
    prompt_len: int = 352
    max_new_tokens: int = 256
    temperature: float = 1.0
    repeats: int = 3
    check_tokens: int = 16
    tie_tolerance: float = 0.5
    token_range: tuple[int, int] = (1000, 100000)
    seed: int = 0

    def __post_init__(self):
        for name in ("prompts", "prompt_len", "max_new_tokens", "repeats", "check_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.temperature < 0 or self.tie_tolerance < 0:
            raise ValueError("temperature and tie_tolerance must be >= 0")
        lo, hi = self.token_range
        if not 0 <= lo < hi:
            raise ValueError(f"token_range must be lo,hi with 0 <= lo < hi, got {self.token_range}")

    def make_prompts(self) -> list[list[int]]:
        rng = random.Random(self.seed)
        return [[rng.randrange(*self.token_range) for _ in range(self.prompt_len)] for _ in range(self.prompts)]

    def sampling(self, temperature: float, max_new_tokens: int) -> dict:
        return {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": temperature}


def _emit(rows: list[dict], row: dict) -> dict:
    row = {"bench": "serve_load", **row}
    print(json.dumps(row), flush=True)
    rows.append(row)
    return row


def _health(url: str) -> dict:
    import httpx

    return httpx.get(f"{url}/health", timeout=30).json()


def _start(cmd, url, env, log, append, timeout, rows, label, cache_dir: Path):
    """The server started and ready; its time to ready and startup phases reported."""
    files = sum(1 for _ in cache_dir.glob("*.json")) if cache_dir.is_dir() else 0
    t0 = time.perf_counter()
    proc = start_server(cmd, log, env, append=append)
    ready_s = wait_ready(proc, url, timeout, t0)
    phases = _health(url).get("startup_s", {})
    # uvicorn's defaults take httptools and uvloop where installed (per request: C parsing instead of h11's)
    have = {m: importlib.util.find_spec(m) is not None for m in ("httptools", "uvloop")}
    _emit(rows, {"measure": "ready", "start": label, "ready_s": round(ready_s, 2), "tuning_files_before": files,
                 "server_phases_s": {k: round(v, 2) for k, v in phases.items()},
                 "uvicorn_http": "httptools" if have["httptools"] else "h11",
                 "uvicorn_loop": "uvloop" if have["uvloop"] else "asyncio"})
    return proc


def _latencies(replies: list[Reply]) -> dict:
    ms = [(r.end - r.start) * 1e3 for r in replies]
    return {"latency_p50_ms": round(percentile(ms, 50), 1), "latency_p99_ms": round(percentile(ms, 99), 1)}


def measure(url: str, cfg: LoadConfig, rows: list[dict], canned_port: int | None = None,
            workdir: str | None = None) -> list[list[int]]:
    """Steps 2 and 3 against the server at `url`; returns the first (greedy, batched) call's outputs.
    canned_port: where the client ceiling's endpoint listens (None: not measured)."""
    prompts = cfg.make_prompts()
    greedy = cfg.sampling(0.0, cfg.check_tokens)
    first_s, ref = asyncio.run(batched(url, prompts, greedy))
    _emit(rows, {"measure": "first_request", "start": "cold", "wall_s": round(first_s, 2)})
    _, replies = asyncio.run(concurrent(url, prompts, greedy))
    got = outputs_of(replies, cfg.check_tokens)
    check = check_outputs(ref, got, cfg.check_tokens,
                          lambda where: asyncio.run(tie_gaps(url, prompts, ref, got, where)), cfg.tie_tolerance)
    _emit(rows, {"measure": "check", **check})
    sp = cfg.sampling(cfg.temperature, cfg.max_new_tokens)
    # warm-up of the sampled path in each arrival pattern: requests arriving one by one are prefilled in
    # other chunks than one batched call, and a server sees those shapes (and compiles them) only then
    short = cfg.sampling(cfg.temperature, 4)
    asyncio.run(batched(url, prompts, short))
    asyncio.run(concurrent(url, prompts, short))
    asyncio.run(concurrent(url, prompts, short, stream=True))
    n_tok = cfg.prompts * cfg.max_new_tokens
    canned = None
    try:
        for rep in range(cfg.repeats):
            engine_wall, _ = asyncio.run(batched(url, prompts, sp))
            _emit(rows, {"measure": "batched", "repeat": rep, "tokens": n_tok, "wall_s": round(engine_wall, 3),
                         "tok_s": round(n_tok / engine_wall, 1)})
            wall, replies = asyncio.run(concurrent(url, prompts, sp))
            outputs_of(replies, cfg.max_new_tokens)
            _emit(rows, {"measure": "concurrent", "repeat": rep, "requests": cfg.prompts, "tokens": n_tok,
                         "wall_s": round(wall, 3), "tok_s": round(n_tok / wall, 1),
                         "ratio_to_batched": round(engine_wall / wall, 3), **_latencies(replies)})
            for pool in (cfg.prompts, None):
                wall, replies = asyncio.run(httpx_rounds(url, prompts, pool, short, sp))
                outputs_of(replies, cfg.max_new_tokens)
                _emit(rows, {"measure": "httpx", "repeat": rep, "pool": pool or "default", "requests": cfg.prompts,
                             "tokens": n_tok, "wall_s": round(wall, 3), "tok_s": round(n_tok / wall, 1),
                             "ratio_to_batched": round(engine_wall / wall, 3), **_latencies(replies)})
            if canned_port is not None:
                if canned is None:  # one real answer of this run, byte for byte
                    canned = start_canned(canned_port, replies[0].body, workdir or tempfile.gettempdir())
                wall, ceiling = asyncio.run(httpx_rounds(f"http://127.0.0.1:{canned_port}", prompts, cfg.prompts,
                                                         short, sp))
                _emit(rows, {"measure": "client_ceiling", "repeat": rep, "pool": cfg.prompts,
                             "requests": cfg.prompts, "answer_bytes": len(ceiling[0].body),
                             "wall_s": round(wall, 4), "requests_s": round(cfg.prompts / wall, 1),
                             "tok_s": round(n_tok / wall, 1), "ratio_to_batched": round(engine_wall / wall, 3),
                             **_latencies(ceiling)})
            _stream_round(url, prompts, sp, cfg, rows, rep, n_tok)
    finally:
        if canned is not None:
            stop_server(canned)
    return ref


def _stream_round(url, prompts, sp, cfg, rows, rep, n_tok) -> None:
    """(c): N streaming calls, time to first token and streamed tok/s."""
    wall, replies = asyncio.run(concurrent(url, prompts, sp, stream=True))
    outputs_of(replies, cfg.max_new_tokens)
    ttft = [(r.first_token - r.start) * 1e3 for r in replies]
    _emit(rows, {"measure": "streamed", "repeat": rep, "requests": cfg.prompts, "tokens": n_tok,
                 "wall_s": round(wall, 3), "tok_s": round(n_tok / wall, 1),
                 "ttft_p50_ms": round(percentile(ttft, 50), 1), "ttft_p99_ms": round(percentile(ttft, 99), 1),
                 "ttft_max_ms": round(max(ttft), 1)})


def _median(rows, measure, key):
    xs = [r[key] for r in rows if r.get("measure") == measure and key in r]
    return statistics.median(xs) if xs else float("nan")


def table(rows: list[dict]) -> str:
    ready = {r["start"]: r for r in rows if r.get("measure") == "ready"}
    first = {r["start"]: r["wall_s"] for r in rows if r.get("measure") == "first_request"}

    def phases(start):
        p = ready.get(start, {}).get("server_phases_s", {})
        return ", ".join(f"{k} {p[k]:.1f}" for k in ("imports", "weights", "kv_sizing", "tuning", "capture", "trainer")
                         if k in p)

    lines = [f"{'measure':<38} {'value':>10}  notes"]

    def add(name, value, note=""):
        lines.append(f"{name:<38} {value:>10}  {note}".rstrip())

    for start in ("cold", "warm"):
        if start in ready:
            add(f"time to ready, {start} (s)", f"{ready[start]['ready_s']:.1f}", phases(start))
        if start in first:
            add(f"first request after ready, {start} (s)", f"{first[start]:.2f}", "N prompts, greedy, check tokens")
    eng, conc = _median(rows, "batched", "tok_s"), _median(rows, "concurrent", "tok_s")
    add("engine tok/s (one batched call)", f"{eng:,.0f}", "median of repeats")
    add("concurrent /generate tok/s", f"{conc:,.0f}", f"ratio {conc / eng:.2f} (goal >= 0.80)")
    add("streamed /generate tok/s", f"{_median(rows, 'streamed', 'tok_s'):,.0f}")
    add("TTFT p50 / p99 (ms)", f"{_median(rows, 'streamed', 'ttft_p50_ms'):.0f} / "
        f"{_median(rows, 'streamed', 'ttft_p99_ms'):.0f}", "streaming, N concurrent")
    return "\n".join(lines)


def client_table(rows: list[dict]) -> str:
    """Per client, medians over the repeats: requests per round, tok/s, ratio to the one batched call (the
    median of the repeats' own ratios), latency of a request p50 / p99 (batched: the call's)."""
    def pick(measure, **match):
        return [r for r in rows if r.get("measure") == measure and all(r.get(k) == v for k, v in match.items())]

    def med(rs, key):
        return statistics.median(r[key] for r in rs) if rs else float("nan")

    lines = [f"{'client':<44} {'requests':>8} {'tok/s':>9} {'ratio':>6} {'p50 ms':>8} {'p99 ms':>8}"]

    def add(name, rs, ratio, p50, p99):
        if rs:
            lines.append(f"{name:<44} {rs[0].get('requests', 1):>8} {med(rs, 'tok_s'):>9,.0f} {ratio:>6.2f} "
                         f"{p50:>8.0f} {p99:>8.0f}")

    b = pick("batched")
    add("one batched /generate (raw socket)", b, 1.0, med(b, "wall_s") * 1e3, med(b, "wall_s") * 1e3)
    n = next((r["requests"] for r in rows if r.get("measure") == "concurrent"), 0)
    for name, rs in (("raw socket, a connection per request", pick("concurrent")),
                     (f"httpx.AsyncClient, pool {n}", pick("httpx", pool=n)),
                     ("httpx.AsyncClient, default pool (100)", pick("httpx", pool="default")),
                     ("client ceiling: httpx, pool N, canned answer", pick("client_ceiling"))):
        add(name, rs, med(rs, "ratio_to_batched"), med(rs, "latency_p50_ms"), med(rs, "latency_p99_ms"))
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m rollplex.bench serve --load", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=None, help="HF dir or preset (default: the embedded tiny model)")
    ap.add_argument("--server-args", default="", help="extra flags for python -m rollplex.server")
    ap.add_argument("--port", type=int, default=30123)
    ap.add_argument("--canned-port", type=int, default=None,
                    help="port of the client ceiling's canned endpoint (default: --port + 1); 0 skips it")
    ap.add_argument("--prompts", type=int, default=256, help="N: prompts, and concurrent requests")
    ap.add_argument("--prompt-len", type=int, default=352)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0, help="of the timed requests (the check is greedy)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--check-tokens", type=int, default=16)
    ap.add_argument("--tie-tolerance", type=float, default=0.5, help="nats; see the module docstring")
    ap.add_argument("--token-range", default="1000,100000", help="prompt token ids are drawn from [lo, hi)")
    ap.add_argument("--cache-root", default=None,
                    help="tuning, TorchInductor and Triton caches (default: a new temporary folder, removed after)")
    ap.add_argument("--no-warm-start", action="store_true", help="skip step 4")
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    ap.add_argument("--log", default=None, help="file for the servers' output (default: inherit)")
    return ap


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    try:
        lo, hi = (int(x) for x in args.token_range.split(","))
        cfg = LoadConfig(args.prompts, args.prompt_len, args.max_new_tokens, args.temperature, args.repeats,
                         args.check_tokens, args.tie_tolerance, (lo, hi))
    except ValueError as e:
        raise SystemExit(f"serve --load: {e}") from None
    root = args.cache_root or tempfile.mkdtemp(prefix="rollplex-serve-load-")
    tuning = os.path.join(root, "tuning")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor"),
           "TRITON_CACHE_DIR": os.path.join(root, "triton")}
    url = f"http://127.0.0.1:{args.port}"
    # the bench's cache flag first: --server-args may override it
    cmd = server_command(args.model, args.port, f"--tuning-cache-dir {tuning} {args.server_args}")
    rows: list[dict] = []
    proc = None
    try:
        proc = _start(cmd, url, env, args.log, False, args.ready_timeout, rows, "cold", Path(tuning))
        canned_port = args.port + 1 if args.canned_port is None else args.canned_port or None
        ref = measure(url, cfg, rows, canned_port, root)
        stop_server(proc)
        proc = None
        if not args.no_warm_start:
            proc = _start(cmd, url, env, args.log, True, args.ready_timeout, rows, "warm", Path(tuning))
            wall, again = asyncio.run(batched(url, cfg.make_prompts(), cfg.sampling(0.0, cfg.check_tokens)))
            _emit(rows, {"measure": "first_request", "start": "warm", "wall_s": round(wall, 2),
                         "same_tokens_as_cold": sum(a == b for a, b in zip(ref, again)), "of": len(ref)})
    except BenchError as e:
        _emit(rows, {"measure": "error", "error": str(e)[:2000]})
        raise SystemExit(1) from None
    finally:
        if proc is not None:
            stop_server(proc)
        if args.cache_root is None:
            shutil.rmtree(root, ignore_errors=True)
    print("\n" + table(rows) + "\n\n" + client_table(rows))


if __name__ == "__main__":
    main()
