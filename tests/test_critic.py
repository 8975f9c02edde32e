"""PPO with a critic (`adv_estimator="gae"`, rl/critic.py) on the tiny model (CPU, fp32): GAE and the
clipped value loss against numbers worked out by hand; `serial` and `rollplex` make the same update of
the actor and the critic; critic_warmup trains the critic only; the critic's memory regions follow the
phase plan (accounting backend: a released region reads as NaN); checkpoint / resume of the critic;
the server's flags and bounded overrides."""

import copy
import math

import pytest
import torch
from helpers import assert_weights_close

from rollplex.engine import Engine, EngineConfig
from rollplex.memory import MemoryConfig, MemoryManager, PhasePlan
from rollplex.models import load_model
from rollplex.rl.activation_checkpointing import activation_checkpointing
from rollplex.rl.algos import compute_advantages, gae_advantages, value_loss
from rollplex.rl.config import RLConfig
from rollplex.rl.critic import ValueModel, build_value_model, save_value_model
from rollplex.rl.errors import TrainOOM
from rollplex.rl.optimizer import OptimizerStepOOM
from rollplex.rl.pipeline import fused_unsupported
from rollplex.rl.run_state import load_checkpoint, save_checkpoint
from rollplex.rl.step import RLStep
from rollplex.tiny import shape_color

ROWS = shape_color.make_rows(2, seed=3)


def test_gae_by_hand():
    # two responses, the second one token shorter (its padding carries a value and a reward that must be ignored)
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]])
    values = torch.tensor([[0.5, 0.2, 0.4], [0.1, 0.3, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, returns = gae_advantages(rewards, values, mask, gamma=0.5, lam=0.5)
    # sample 0, backwards: delta_2 = 1 - 0.4 = 0.6 = A_2; delta_1 = 0.5*0.4 - 0.2 = 0, A_1 = 0.25*0.6 = 0.15;
    # delta_0 = 0.5*0.2 - 0.5 = -0.4, A_0 = -0.4 + 0.25*0.15 = -0.3625
    # sample 1: A_1 = delta_1 = 2 - 0.3 = 1.7; delta_0 = 0.5*0.3 - 0.1 = 0.05, A_0 = 0.05 + 0.25*1.7 = 0.475
    torch.testing.assert_close(returns, torch.tensor([[0.1375, 0.35, 1.0], [0.575, 2.0, 0.0]]))
    # whitened over the 5 response tokens: mean 0.5125, unbiased variance 2.31625 / 4 = 0.5790625
    expect = torch.tensor([[-1.14986096, -0.47637097, 0.11498610], [-0.04927976, 1.56052559, 0.0]])
    torch.testing.assert_close(adv, expect)
    with pytest.raises(ValueError, match="critic's values"):
        compute_advantages("gae", torch.ones(2), torch.zeros(2, dtype=torch.long), mask)


def test_value_loss_by_hand():
    v = torch.tensor([[1.0, 0.0, 5.0]])
    old = torch.tensor([[0.5, 0.5, 0.0]])
    ret = torch.tensor([[2.0, 0.2, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, clipfrac = value_loss(v, old, ret, mask, cliprange_value=0.2)
    # token 0: (1 - 2)^2 = 1 against clip(1, 0.3, 0.7) = 0.7: (0.7 - 2)^2 = 1.69, the clipped term
    # token 1: (0 - 0.2)^2 = 0.04 against clip(0, 0.3, 0.7) = 0.3: (0.3 - 0.2)^2 = 0.01; token 2 is padding
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.04) / 2)
    assert clipfrac.item() == pytest.approx(0.5)
    # seq-mean-token-sum over the one sequence: 0.5 * (1.69 + 0.04)
    loss, _ = value_loss(v, old, ret, mask, 0.2, "seq-mean-token-sum")
    assert loss.item() == pytest.approx(0.5 * 1.73)


def _step(tiny_dir, proc, memory=None, memory_cfg=None, **cfg):
    model = load_model(tiny_dir)
    engine = Engine(model, proc, EngineConfig(max_num_seqs=64, max_model_len=256), memory=memory)
    base = dict(n=4, max_new_tokens=4, lr=1e-4, critic_lr=1e-4, kl_coef=0.05, use_kl_loss=False,
                adv_estimator="gae", gamma=0.9, lam=0.8, micro_batch_prompts=2, micro_batch_samples=3)
    return RLStep(model, engine, RLConfig(**{**base, **cfg}), proc, reward_fn="shape_color", memory=memory,
                  memory_cfg=memory_cfg)


def _batch(rl, rows=ROWS):
    batch = rl.rollout(rows)
    batch.rewards = torch.tensor([float(i % 3 == 0) for i in range(batch.num_samples)])  # varied advantages
    return batch


def _weights(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer\.step\(\)`")
def test_serial_and_rollplex_make_the_same_actor_and_critic_update(tiny_dir, proc):
    batch = _batch(_step(tiny_dir, proc))
    out = {}
    for mode in ("rollplex", "serial"):
        rl = _step(tiny_dir, proc, mode=mode, ppo_mini_batches=2)
        actor0, critic0 = _weights(rl.model), _weights(rl.critic.model)
        images = []  # the critic's vision-tower inputs: its prompt prefix is computed once per group in rollplex mode
        rl.critic.model.backbone.visual.register_forward_pre_hook(lambda _m, a, seen=images: seen.append(len(a[1])))
        m = rl.train(copy.deepcopy(batch))
        # scoring the values, then the update (one pass per prompt's mini-batch): each image twice, or per sample
        assert sum(images) == 2 * (batch.num_prompts if mode == "rollplex" else batch.num_samples)
        out[mode] = m, _weights(rl.model), _weights(rl.critic.model)
        # both moved: the test compares updates, not two copies of the initial weights
        assert any(not torch.equal(actor0[k], v) for k, v in out[mode][1].items())
        assert all(not torch.equal(critic0[k], v) for k, v in out[mode][2].items() if "score" in k)
    (m1, a1, c1), (m2, a2, c2) = out["rollplex"], out["serial"]
    for name in a1:
        assert_weights_close(a1[name], a2[name], f"actor {name}")
    for name in c1:
        assert_weights_close(c1[name], c2[name], f"critic {name}")
    for k in ("critic/vf_loss", "critic/values/mean", "critic/returns/mean", "critic/grad_norm"):
        assert m1[k] == pytest.approx(m2[k], rel=1e-4, abs=1e-6), k
    assert m1["critic/lr"] == 1e-4 and 0.0 <= m1["critic/vf_clipfrac"] <= 1.0
    assert "timing_s/update_critic" in m1 and "timing_s/values" in m1


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer\.step\(\)`")
def test_critic_warmup_trains_the_critic_only(tiny_dir, proc):
    rl = _step(tiny_dir, proc, critic_warmup=1)
    batch = _batch(rl)
    actor0, critic0 = _weights(rl.model), _weights(rl.critic.model)
    m = rl.train(copy.deepcopy(batch))
    assert all(torch.equal(actor0[k], v) for k, v in _weights(rl.model).items())
    assert rl.actor.scheduler.last_epoch == 0 and "actor/pg_loss" not in m
    assert any(not torch.equal(critic0[k], v) for k, v in _weights(rl.critic.model).items())
    assert rl.step_idx == 1 and m["critic/vf_loss"] > 0
    m = rl.train(copy.deepcopy(batch))  # past the warm-up: the actor moves too
    assert any(not torch.equal(actor0[k], v) for k, v in _weights(rl.model).items())
    assert "actor/pg_loss" in m


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer\.step\(\)`")
def test_an_actor_update_failing_before_its_optimizer_step_leaves_the_critic(tiny_dir, proc, monkeypatch):
    rl = _step(tiny_dir, proc)
    batch = _batch(rl)
    rl.train(copy.deepcopy(batch))  # the critic's AdamW moments exist: the check covers them too
    actor0, critic0 = _weights(rl.model), _weights(rl.critic.model)
    opt0 = copy.deepcopy(rl.critic.optimizer.state_dict())

    def oom(*_a, **_k):  # out of memory in the actor's first optimizer step, before any chunk was written
        raise OptimizerStepOOM(0, len(rl.actor.optimizer.chunks), False)

    monkeypatch.setattr(rl.actor.optimizer, "step", oom)
    with pytest.raises(TrainOOM) as err:
        rl.train(copy.deepcopy(batch))
    assert not err.value.weights_changed and rl.step_idx == 1
    assert all(torch.equal(actor0[k], v) for k, v in _weights(rl.model).items())
    assert all(torch.equal(critic0[k], v) for k, v in _weights(rl.critic.model).items())
    opt = rl.critic.optimizer.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(opt["master"], opt0["master"]))
    for i, st in opt0["opt"]["state"].items():
        assert all(torch.equal(opt["opt"]["state"][i][k], v) for k, v in st.items())


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer\.step\(\)`")
def test_critic_passes_back_off_on_out_of_memory(tiny_dir, proc, monkeypatch):
    """A critic pass over more than one prompt runs out of memory: scoring and the update retry with one
    prompt per pass, keep it for later steps, and update as a critic planned that way does. Out of memory
    at one prompt per pass, with activation checkpointing: TrainOOM after the actor's update (the step
    counts), the critic as it was."""
    batch = _batch(_step(tiny_dir, proc))
    small = _step(tiny_dir, proc, micro_batch_prompts=1)
    small.train(copy.deepcopy(batch))
    values = ValueModel.values

    def tight(self, mb, mode, packed):
        if mb.num_prompts > 1 or (self.training and always):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return values(self, mb, mode, packed)

    monkeypatch.setattr(ValueModel, "values", tight)
    always = False
    rl = _step(tiny_dir, proc)  # two prompts per pass
    rl.train(copy.deepcopy(batch))
    assert rl.critic.score_backoff.cap.prompts == 1 and rl.critic.train_backoff.cap.prompts == 1
    for name, w in _weights(small.critic.model).items():
        assert_weights_close(_weights(rl.critic.model)[name], w, f"critic {name}")
    always = True
    critic0 = _weights(rl.critic.model)
    with pytest.raises(TrainOOM, match="critic's update ran out of device memory at one prompt"):
        rl.train(copy.deepcopy(batch))
    assert rl.step_idx == 2 and activation_checkpointing(rl.critic.model) == (True, True)
    assert all(torch.equal(critic0[k], v) for k, v in _weights(rl.critic.model).items())


def test_critic_lr_warms_up_over_its_own_steps(tiny_dir, proc):
    """critic_lr_warmup_steps=2: the critic's lr is critic_lr x 1/2, then x 2/2, one step at a time (the actor's
    has no warm-up); the step index sets it, so a resumed run continues the schedule."""
    rl = _step(tiny_dir, proc, critic_lr=2e-4, critic_lr_warmup_steps=2)
    batch = _batch(rl)
    lrs = [rl.train(copy.deepcopy(batch))["critic/lr"] for _ in range(3)]
    assert lrs == pytest.approx([1e-4, 2e-4, 2e-4])
    assert [g["lr"] for g in rl.critic.optimizer.param_groups] == pytest.approx([2e-4])
    with pytest.raises(ValueError, match="critic_lr_warmup_steps"):
        RLConfig(adv_estimator="gae", critic_lr_warmup_steps=-1)


def test_config_and_fused_fallback():
    for bad in (dict(lam=1.5), dict(cliprange_value=0.0), dict(critic_lr=0.0), dict(critic_warmup=-1),
                dict(critic_lr=float("nan"))):
        with pytest.raises(ValueError):
            RLConfig(adv_estimator="gae", **bad)
    assert "gae" in fused_unsupported(RLConfig(adv_estimator="gae", schedule="fused"))


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer\.step\(\)`")
def test_critic_regions_follow_the_phase_plan(tiny_dir, proc):
    """Released or offloaded regions read as NaN under the accounting backend: the same weights as without
    memory management mean each trainer was read only where the plan keeps it — the critic trains in a phase
    of its own, with the actor's gradients released and its optimizer state offloaded."""
    moves = "critic_weights:rollout=offloaded,critic_optimizer:*=offloaded,optimizer:update_critic=offloaded"
    mm = MemoryManager(PhasePlan.releases_only(), backend="accounting")
    managed = _step(tiny_dir, proc, memory=mm, memory_cfg=MemoryConfig(memory_plan="release", memory_overrides=moves))
    plain = _step(tiny_dir, proc)
    plan = managed.memory.plan
    phases = ("rollout", "ref", "update", "update_critic")
    assert [plan.get(p, "critic_grads") for p in phases] == ["released", "released", "released", "resident"]
    assert [plan.get(p, "grads") for p in phases] == ["released", "released", "resident", "released"]
    assert plan.get("rollout", "critic_weights") == "offloaded" and plan.get("ref", "critic_weights") == "resident"
    assert plan.get("update", "critic_optimizer") == "offloaded"
    sizes = managed.memory_sizes()
    n = sum(p.numel() for p in managed.critic.model.parameters())
    assert sizes["critic_grads"] == 4 * n and sizes["critic_optimizer"] == 8 * n  # fp32: masters are the weights
    for _ in range(2):  # the second step resumes the offloaded critic and its moments
        m_managed, m_plain = managed.step(ROWS), plain.step(ROWS)
        assert m_managed["critic/vf_loss"] == m_plain["critic/vf_loss"]
    for (k, a), b in zip(_weights(plain.critic.model).items(), _weights(managed.critic.model).values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)
    for (k, a), b in zip(_weights(plain.model).items(), _weights(managed.model).values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)
    report = managed.memory.report()
    assert report["region_bytes"]["critic_weights"] > 0
    assert "critic_weights" not in report["phases"]["rollout"]["resident_bytes"]
    resident = {p: report["phases"][p]["resident_bytes"] for p in phases}
    assert "critic_grads" in resident["update_critic"] and "critic_grads" not in resident["update"]
    assert "critic_optimizer" not in resident["update"] and "critic_grads" not in resident["ref"]
    assert "grads" not in resident["update_critic"] and "optimizer" not in resident["update_critic"]
    # a new step built over the same engine in `update_critic`, where the actor's regions are paused: the step
    # resumes the regions it allocates in while it is built
    assert mm.current == "update_critic" and mm.state["optimizer"] == "offloaded"
    for tag in ("optimizer", "grads", "critic_weights", "critic_optimizer", "critic_grads"):
        mm.forget(tag)
    again = RLStep(managed.model, managed.engine, managed.cfg, proc, reward_fn="shape_color", memory=mm,
                   memory_cfg=MemoryConfig(memory_plan="release", memory_overrides=moves))
    assert mm.state["optimizer"] == "offloaded" and mm.state["critic_grads"] == "resident"
    assert math.isfinite(again.step(ROWS)["critic/vf_loss"])


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer\.step\(\)`")
def test_critic_checkpoint_resume_and_init_from_a_directory(tiny_dir, proc, tmp_path):
    rl = _step(tiny_dir, proc)
    batch = _batch(rl)
    rl.train(copy.deepcopy(batch))
    save_checkpoint(rl, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "critic" / "config.json").exists()
    m_next = rl.train(copy.deepcopy(batch))
    resumed = _step(tiny_dir, proc)
    load_checkpoint(resumed, tmp_path / "ckpt")
    m_resumed = resumed.train(copy.deepcopy(batch))
    assert m_resumed["critic/vf_loss"] == pytest.approx(m_next["critic/vf_loss"], rel=1e-6)
    for (k, a), b in zip(_weights(rl.critic.model).items(), _weights(resumed.critic.model).values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=k)
    # a critic read from a directory: its saved head, or a fresh one from a policy checkpoint (no score.*)
    save_value_model(rl.critic.model, tmp_path / "critic")
    vm = build_value_model(rl.model, tmp_path / "critic")
    for (k, a), b in zip(_weights(rl.critic.model).items(), _weights(vm).values()):
        assert torch.equal(a, b), k
    fresh = build_value_model(rl.model, tiny_dir, seed=7)
    assert torch.equal(fresh.backbone.model.embed_tokens.weight, load_model(tiny_dir).model.embed_tokens.weight)
    assert fresh.score.bias.item() == 0.0 and fresh.score.weight.abs().max() > 0
    plain = _step(tiny_dir, proc, adv_estimator="grpo")
    with pytest.raises(ValueError, match="critic"):
        plain.train(copy.deepcopy(batch), RLConfig(**{**plain.cfg.__dict__, "adv_estimator": "gae"}))


def test_server_flags_and_bounded_overrides(tiny_dir):
    import httpx
    from server_helpers import wire_rows

    from rollplex.engine import EngineConfig as EC
    from rollplex.server import ServerConfig, serve_in_thread
    from rollplex.server.__main__ import config_from_args, parser

    args = parser().parse_args(["--device", "cpu", "--adv-estimator", "gae", "--critic-lr", "3e-4", "--lam", "0.9",
                                "--cliprange-value", "0.3", "--critic-warmup", "2", "--critic-model-path", "/c"])
    rl = config_from_args(args).rl
    assert (rl.adv_estimator, rl.critic_lr, rl.lam, rl.cliprange_value, rl.critic_warmup, rl.critic_model_path) == \
        ("gae", 3e-4, 0.9, 0.3, 2, "/c")
    with pytest.raises(ValueError, match="lam"):
        config_from_args(parser().parse_args(["--device", "cpu", "--lam", "2"]))
    cfg = ServerConfig(model=str(tiny_dir), device="cpu", engine=EC(max_model_len=256, kv_cache_tokens=4096),
                       rl=RLConfig(n=2, lr=1e-3, max_new_tokens=4, adv_estimator="gae", critic_lr=1e-3))
    srv = serve_in_thread(cfg)
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            ro = c.post("/rollout", json={"prompts": wire_rows(2), "n": 2}).json()
            bad = c.post("/train_step", json={"rollout_id": ro["rollout_id"], "rewards": [1, 0, 0, 1],
                                              "critic_lr": 1.0})
            assert bad.status_code == 400 and "critic_lr" in bad.text
            m = c.post("/train_step", json={"rollout_id": ro["rollout_id"], "rewards": [1, 0, 0, 1],
                                            "critic_lr": 1e-4, "lam": 0.5, "cliprange_value": 0.2})
            assert m.status_code == 200, m.text
            m = m.json()
            assert m["critic/lr"] == 1e-4 and m["critic/vf_loss"] > 0 and "critic/returns/mean" in m
            assert srv.state.rl.cfg.critic_lr == 1e-3  # that step's only
    finally:
        srv.stop()


def test_demo_runs_ppo_with_a_critic(tmp_path):
    import json

    from rollplex.demo.train import main
    from rollplex.tiny import write_tiny

    out = tmp_path / "demo"
    main(["--model", str(write_tiny(tmp_path / "tiny", seed=0)), "--steps", "2", "--target", "2", "--prompts", "2",
          "--n", "2", "--warmup-steps", "1", "--adv-estimator", "gae", "--critic-lr", "2e-4", "--critic-warmup", "1",
          "--lam", "0.9", "--progress", "off", "--out", str(out)])
    first, second = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert first["critic/lr"] == 2e-4 and first["rollplex/critic_warmup"] == 1.0 and "actor/pg_loss" not in first
    assert "actor/pg_loss" in second and "critic/vf_loss" in second and second["critic/vf_explained_var"] <= 1.0
