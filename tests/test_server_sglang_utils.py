"""SGLang's utility endpoints on the real server (uvicorn in a thread, the tiny model on CPU): the shapes SGLang
answers with, the one-token generation behind /health_generate, and the API key they need like every route."""

from __future__ import annotations

import httpx
import pytest

from rollplex.engine import EngineConfig
from rollplex.rl.config import RLConfig
from rollplex.server import ServerConfig, serve_in_thread
from rollplex.tiny import write_tiny

KEY = "sk-utility"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tiny = write_tiny(tmp_path_factory.mktemp("tiny-utils"), seed=0)
    cfg = ServerConfig(model=str(tiny), device="cpu", api_key=KEY, rl=RLConfig(n=2, max_new_tokens=4),
                       engine=EngineConfig(max_model_len=256, kv_cache_tokens=4096, max_num_seqs=16),
                       checkpoint_root=str(tmp_path_factory.mktemp("ckpt")))
    srv = serve_in_thread(cfg)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def _generated(client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("rollplex_generation_tokens_total"):
            return float(line.split()[-1])
    return 0.0


def test_health_generate_runs_one_token_through_the_engine(client):
    before = _generated(client)
    r = client.get("/health_generate")
    assert r.status_code == 200 and r.content == b""
    assert _generated(client) == before + 1  # one greedy token of token id 0, as SGLang's check


def test_model_info_and_models_list(client, server):
    path = str(server.state.model_path)
    for route in ("/get_model_info", "/model_info"):
        info = client.get(route).json()
        assert info["model_path"] == path and info["served_model_name"] == path and info["tokenizer_path"] == path
        assert info["is_generation"] is True and info["has_image_understanding"] is True
        assert info["model_type"] == "qwen2_5_vl" and info["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
        assert info["weight_version"] == "0"
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and len(models["data"]) == 1
    card = models["data"][0]
    assert card["id"] == path and card["object"] == "model" and card["root"] == path and card["parent"] is None
    assert card["max_model_len"] == 256 and isinstance(card["created"], int)


def test_server_info(client):
    for route in ("/get_server_info", "/server_info"):
        info = client.get(route).json()
        assert info["context_length"] == 256 and info["max_running_requests"] == 16
        assert info["max_total_num_tokens"] == 4096 and info["api_key"] == "<redacted>"
        assert info["version"] and info["frontend"] == "python" and info["startup_time"] > 0
        [state] = info["internal_states"]
        assert state["effective_max_running_requests_per_dp"] == 16 and state["num_running_reqs"] == 0


def test_flush_cache(client):
    for method in ("GET", "POST"):
        r = client.request(method, "/flush_cache")
        assert r.status_code == 200 and r.text.startswith("Cache flushed.")
        assert r.headers["content-type"].startswith("text/plain")
    r = client.post("/flush_cache", params={"timeout": -1})
    assert r.status_code == 400 and "timeout" in r.json()["error"]["message"]


def test_they_need_the_key_and_are_counted(server, client):
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        for route in ("/health_generate", "/get_model_info", "/get_server_info", "/flush_cache", "/v1/models"):
            assert anon.get(route).status_code == 401, route
        assert anon.get("/health").status_code == 200
    text = client.get("/metrics").text
    assert 'route="/v1/models",status="401"' in text and 'route="/flush_cache",status="401"' in text
