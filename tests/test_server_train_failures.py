"""/train_step on the tiny model (CPU, fp32, one in-process server) when an update fails after an
optimizer step with an error that is neither out of memory nor a non-finite loss: the answer says what
was applied, global_step, weights_version and the LR schedule count it, and the retained rollout is
stale (off-policy only)."""

from __future__ import annotations

import httpx
import pytest

from rollplex.engine import EngineConfig
from rollplex.rl import actor as actor_mod
from rollplex.rl.config import RLConfig
from rollplex.server import ServerConfig, serve_in_thread

REWARDS = [1.0, 0.0, 0.0, 1.0]
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]  # token-id prompts: no vision pass, a fast step


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    rl = RLConfig(n=2, lr=1e-3, kl_coef=0.05, max_new_tokens=4, micro_batch_prompts=4, micro_batch_samples=8)
    cfg = ServerConfig(model=str(tiny_dir), device="cpu", rl=rl,
                       engine=EngineConfig(max_model_len=128, kv_cache_tokens=2048, max_num_seqs=16),
                       checkpoint_root=str(tmp_path_factory.mktemp("failures-ckpt")))
    srv = serve_in_thread(cfg)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _rollout(c) -> str:
    r = c.post("/rollout", json={"prompts": [{"input_ids": p} for p in PROMPTS], "n": 2})
    assert r.status_code == 200, r.text
    return r.json()["rollout_id"]


def _train(c, rid, **kw) -> httpx.Response:
    return c.post("/train_step", json={"rollout_id": rid, "rewards": REWARDS, **kw})


@pytest.mark.parametrize("error", [RuntimeError, ValueError, KeyError])
def test_an_error_in_mini_batch_2_of_2_is_reported_with_what_was_applied(server, client, monkeypatch, error):
    opt = server.state.rl.actor.optimizer
    real_step, real_loss, steps = opt.step, actor_mod.ppo_policy_loss, [0]

    def counting_step():
        real_step()
        steps[0] += 1

    def fails_after_a_step(*a, **k):
        if steps[0] >= 1:
            raise error("injected")
        return real_loss(*a, **k)

    rid = _rollout(client)
    before = client.get("/checksum").json()
    monkeypatch.setattr(opt, "step", counting_step)
    monkeypatch.setattr(actor_mod, "ppo_policy_loss", fails_after_a_step)
    r = _train(client, rid, ppo_mini_batches=2)
    monkeypatch.undo()
    assert r.status_code == 500, r.text
    msg, after = r.json()["error"]["message"], client.get("/checksum").json()
    assert "injected" in msg and "1 optimizer step(s) of this train step were applied" in msg and "stale" in msg, msg
    assert after["global_step"] == before["global_step"] + 1 and f"global_step is now {after['global_step']}" in msg
    assert after["weights_version"] == before["weights_version"] + 1
    assert after["lr_schedule_step"] == before["lr_schedule_step"] + 1
    assert after["weights_checksum"] != before["weights_checksum"] and rid in after["retained_rollouts"]
    assert _train(client, rid).status_code == 409  # sampled before the weights it changed
    assert _train(client, rid, off_policy=True).status_code == 200
