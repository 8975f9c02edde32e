"""ReMax over HTTP: a server started with --adv-estimator remax rolls out each prompt's greedy response in
the same /rollout (returned as `greedy`), and /train_step takes their rewards from the client
(`greedy_rewards`) or scores them with its reward function."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import wire_rows

from rollplex.engine import EngineConfig
from rollplex.rl.config import RLConfig
from rollplex.server import ServerConfig, serve_in_thread
from rollplex.tiny import write_tiny


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tiny = write_tiny(tmp_path_factory.mktemp("tiny-remax"), seed=0)
    rl = RLConfig(n=2, lr=1e-3, kl_coef=0.0, max_new_tokens=4, adv_estimator="remax")
    srv = serve_in_thread(ServerConfig(model=str(tiny), device="cpu", rl=rl,
                                       engine=EngineConfig(max_model_len=256, kv_cache_tokens=8192, max_num_seqs=64)))
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c
    srv.stop()


def test_remax_rollout_and_train_step(client):
    ro = client.post("/rollout", json={"prompts": wire_rows(2), "n": 2}).json()
    assert ro["num_samples"] == 4 and [g["prompt_index"] for g in ro["greedy"]] == [0, 1]
    assert all(len(g["token_ids"]) == len(g["logprobs"]) >= 1 for g in ro["greedy"])
    # client rewards: the greedy responses' rewards are the baselines (one per prompt)
    bad = client.post("/train_step", json={"rollout_id": ro["rollout_id"], "rewards": [1, 0, 0, 0],
                                           "greedy_rewards": [0.5]})
    assert bad.status_code == 400 and "one greedy reward per prompt" in bad.text
    m = client.post("/train_step", json={"rollout_id": ro["rollout_id"], "rewards": [1, 0, 0, 0],
                                         "greedy_rewards": [0.5, 0.0]})
    assert m.status_code == 200, m.text
    # per-token advantages: 1 - 0.5 and 0 - 0.5 on the first prompt's tokens, 0 on the second's
    assert m.json()["critic/advantages/max"] == pytest.approx(0.5)
    # the server's reward scores the greedy responses itself
    ro = client.post("/rollout", json={"prompts": wire_rows(2), "n": 2}).json()
    m = client.post("/train_step", json={"rollout_id": ro["rollout_id"], "reward": "shape_color"})
    assert m.status_code == 200, m.text
    # without greedy rewards a client's rewards leave ReMax no baseline: 400, the rollout kept
    ro = client.post("/rollout", json={"prompts": wire_rows(2), "n": 2}).json()
    m = client.post("/train_step", json={"rollout_id": ro["rollout_id"], "rewards": [1, 0, 0, 0]})
    assert m.status_code == 400 and "greedy" in m.text
    m = client.post("/train_step", json={"rollout_id": ro["rollout_id"], "rewards": [1, 0, 0, 0],
                                         "adv_estimator": "grpo"})  # the rollout was still retained
    assert m.status_code == 200, m.text
