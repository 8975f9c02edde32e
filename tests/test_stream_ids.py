"""Streaming /generate: every chunk of a sample carries one id (`meta_info.id`), its final chunk (the one
with the finish_reason) included, and it is the id the non-streaming answer gives that sample."""

from __future__ import annotations

from collections import defaultdict

import httpx
import pytest
from server_helpers import sse_events

from rollplex.engine import EngineConfig
from rollplex.rl.config import RLConfig
from rollplex.server import ServerConfig, serve_in_thread
from rollplex.tiny import write_tiny

SAMPLED = {"temperature": 1.0, "max_new_tokens": 4, "ignore_eos": True, "seed": 3}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tiny = write_tiny(tmp_path_factory.mktemp("tiny-stream"), seed=0)
    cfg = ServerConfig(model=str(tiny), device="cpu", rl=RLConfig(n=1, max_new_tokens=4),
                       engine=EngineConfig(max_model_len=256, kv_cache_tokens=4096, max_num_seqs=16))
    srv = serve_in_thread(cfg)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            yield c
    finally:
        srv.stop()


def _stream(client, body) -> dict[int, list[dict]]:
    """Chunks by sample index, in arrival order."""
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    by_index = defaultdict(list)
    for c in events[:-1]:
        by_index[c["index"]].append(c)
    return by_index


def _ids(chunks: list[dict]) -> list[str]:
    return [c["meta_info"]["id"] for c in chunks]


@pytest.mark.parametrize("n", [1, 3])
def test_every_chunk_of_a_sample_has_its_id(client, n):
    body = {"text": "What color is the", "sampling_params": {**SAMPLED, "n": n}}
    by_index = _stream(client, body)
    assert sorted(by_index) == list(range(n))
    ids = {}
    for i, chunks in by_index.items():
        assert len(chunks) >= 2 and chunks[-1]["meta_info"]["finish_reason"] is not None  # updates + the last
        assert len(set(_ids(chunks))) == 1, _ids(chunks)
        ids[i] = chunks[0]["meta_info"]["id"]
    assert len(set(ids.values())) == n  # one id per sample
    if n > 1:  # the non-streaming answer's form: the request id suffixed with the sample's position
        base = ids[0].rsplit("-", 1)[0]
        assert ids == {j: f"{base}-{j}" for j in range(n)}


def test_stream_ids_follow_the_given_rid(client):
    body = {"text": ["What color is the", "red"], "rid": ["a", "b"],
            "sampling_params": [{**SAMPLED, "n": 2}, SAMPLED]}
    by_index = _stream(client, body)
    assert {i: set(_ids(c)) for i, c in by_index.items()} == {0: {"a-0"}, 1: {"a-1"}, 2: {"b"}}
    plain = client.post("/generate", json=body).json()
    assert [x["meta_info"]["id"] for x in plain] == ["a-0", "a-1", "b"]  # as in the non-streaming answer


def test_a_sample_update_waits_until_its_last_one_is_read():
    """Updates carry the whole output so far: while one is unread the engine thread adds none, and the
    next one after it is read carries every token since (a slow handler gets fewer, larger chunks)."""
    from types import SimpleNamespace

    from rollplex.server.worker import EngineWorker, Ticket

    seq = SimpleNamespace(output_ids=[5], logprobs=[-0.5])
    req = SimpleNamespace(seqs=[seq], params=SimpleNamespace(n=1, skip_special_tokens=True))
    worker = EngineWorker.__new__(EngineWorker)  # no engine thread: only the publishing logic
    worker.engine, worker.decode, worker._outbox = SimpleNamespace(requests={"r": req}), None, {}
    loop = object()
    t = Ticket(queue=None, loop=loop, stream=True, rid="r", sent=[0])
    worker._streams = {"r": t}

    def updates():
        return [event[3] for _, event in worker._outbox.get(loop, [])]

    worker._publish_streams()
    seq.output_ids += [6, 7]
    seq.logprobs += [-0.6, -0.7]
    worker._publish_streams()
    assert updates() == [[5]]  # the second step's tokens wait: [5] is unread
    t.unread.discard(0)  # the handler took it
    worker._publish_streams()
    assert updates() == [[5], [5, 6, 7]]
    worker._publish_streams()
    assert updates() == [[5], [5, 6, 7]]  # nothing new
