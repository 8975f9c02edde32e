"""One rank of the data-parallel RL step test: the full step (rollout, rewards, reference scoring,
update, weight sync) under RLStep's distributed path over gloo, against the single-process steps."""

from __future__ import annotations

import gc
import weakref

import torch
import torch.distributed as dist
from helpers import assert_fp32_close, assert_weights_close
from parallel_helpers import init_group

from rollplex.cosched import CoschedConfig
from rollplex.engine import Engine, EngineConfig
from rollplex.models import load_model
from rollplex.parallel import data_parallel, full_tensor
from rollplex.processor import VLProcessor
from rollplex.rl.config import RLConfig
from rollplex.rl.step import RLStep


def parity_reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """Varies within a group on the untrained tiny model (the task's own reward is 0 for every sample)."""
    return float(sum(map(ord, solution_str)) % 2)


# admit eagerly: on CPU the chunks run inline, so every loaded step is "slow"; the tests are about exactness.
# One prompt per job: a rank's jobs then batch their prefixes as one process does (same rounding)
EAGER = CoschedConfig(slowdown_bound=0.9, baseline_samples=1, initial_budget=50.0, max_chunk_ms=1e6,
                      max_in_flight=2, serial_after=1000, reprobe_every=0, job_prompts=1)


def build(tiny_dir, cfg: RLConfig, rollout: str = "data", memory_cfg=None, group="auto", fsdp=None) -> RLStep:
    """The RL step on the tiny checkpoint: the engine decodes the policy, or (rollout="tensor") a copy
    of it tensor-parallel over the default group."""
    model = load_model(tiny_dir)
    proc = VLProcessor.from_pretrained(tiny_dir)
    mm = None
    if memory_cfg is not None:
        from rollplex.memory import MemoryManager, PhasePlan

        mm = MemoryManager(PhasePlan.releases_only(), backend="accounting")
    ecfg = EngineConfig(max_num_seqs=64, max_model_len=256)
    roll, tp = model, None
    if rollout.startswith("tensor"):  # "tensor": one engine over the group; "tensor:N": blocks of N ranks;
        # "tensor:N:strided": engines of every (world / N)-th rank; "tensor+vision": the tower's blocks split too
        from rollplex.parallel import tensor_parallel_copy

        world = dist.get_world_size()
        size = int(rollout.split(":")[1]) if ":" in rollout else world
        if rollout.endswith(":strided"):
            engines = [[g + k * (world // size) for k in range(size)] for g in range(world // size)]
            block = dist.new_subgroups_by_enumeration(engines)[0]
        else:
            block = None if size == world else dist.new_subgroups(size)[0]
        roll, tp = tensor_parallel_copy(model, block, vision=rollout.startswith("tensor+vision"))
        assert tp.size == size
    engine = Engine(roll, proc, ecfg, memory=mm, tp=tp)
    rl = RLStep(model, engine, cfg, proc, reward_fn=parity_reward, memory=mm, memory_cfg=memory_cfg,
                cosched=EAGER if cfg.cosched else None, parallel=data_parallel(model, engine, cfg, group, fsdp))
    # what outlives `model` once this returns: under a tensor-parallel engine, none of its text weights
    rl.whole_text_weights = [weakref.ref(model.model.layers[0].mlp.down_proj.weight),
                             weakref.ref(model.model.embed_tokens.weight)]
    return rl


def capture_grads(rl: RLStep) -> list[dict]:
    """Filled with the full gradients each optimizer step reads (gathered from FSDP shards)."""
    grads: list[dict] = []
    step = rl.actor.optimizer.step

    def capture():
        # (in the parameters' own row order: the trainer may store fused projections blocked)
        order = rl.parallel.weights.natural if rl.parallel is not None else (lambda n, t: t)
        grads.append({n: order(n, full_tensor(p.grad)).clone() for n, p in rl.actor.model.named_parameters()
                      if p.grad is not None})
        step()

    rl.actor.optimizer.step = capture
    return grads


def run_steps(rl: RLStep, rows: list[dict], steps: int) -> list[dict]:
    """Per step: the rollout's tokens, the metrics, the gradients and the policy's weights after it."""
    grads = capture_grads(rl)
    out = []
    generate = rl.generate
    tokens: list = []

    def recording(prompts, params, **kw):
        batch = generate(prompts, params, **kw)
        tokens.append(batch.responses.clone())
        return batch

    rl.generate = recording
    for _ in range(steps):
        metrics = rl.step(rows)
        if rl.cfg.cosched:  # the old policy's prefixes ran beside this process's decode
            metrics["rollout_metrics"] = dict(rl.rollout_metrics)
        out.append(dict(tokens=tokens[-1], metrics=metrics, grads=list(grads),
                        weights={n: p.clone() for n, p in rl.policy_state().items()}))
        if rl.critic is not None:  # PPO's critic, gathered from its shards
            out[-1]["critic"] = {n: full_tensor(p.detach()).clone() for n, p in rl.critic.model.named_parameters()}
        grads.clear()
    return out


def compare(got: list[dict], want: list[dict]) -> None:
    """The same rollout tokens (seeded sampling: exact), and metrics, gradients and weights equal up to
    fp32 summation order (helpers.fp32_rtol)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g["tokens"], w["tokens"]), "the rollouts differ"
        for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "critic/score/mean",
                  "training/rollout_probs_diff_mean"):
            # losses are means of O(1) terms that may cancel: rounding is relative to 1, not to the mean
            assert_fp32_close(g["metrics"][k], w["metrics"][k], k, scale=1.0)
        assert len(g["grads"]) == len(w["grads"]) > 0
        for mine, ref in zip(g["grads"], w["grads"]):
            assert mine.keys() == ref.keys()
            for n, t in ref.items():
                assert_fp32_close(mine[n], t, f"grad {n}")
        for n, t in w["weights"].items():
            assert_weights_close(g["weights"][n], t, f"weight {n}")
        assert ("critic" in g) == ("critic" in w)
        if "critic" in w:  # the critic's values, loss and updated weights
            for k in ("critic/vf_loss", "critic/grad_norm", "critic/values/mean", "critic/advantages/mean"):
                assert_fp32_close(g["metrics"][k], w["metrics"][k], k, scale=1.0)
            assert g["critic"].keys() == w["critic"].keys()
            for n, t in w["critic"].items():
                assert_weights_close(g["critic"][n], t, f"critic {n}")


def inject_oom(kind: str) -> None:
    """Out of memory in multi-prompt training passes: predicted on rank 1 ("predicted": the
    placement's check before a mini-batch), raised inside the second such pass, after the first
    one's backward ("in_pass"), or inside rank 1's first such pass only ("in_pass_rank1")."""
    if kind == "predicted":
        from rollplex.parallel.data_parallel import DataParallel

        DataParallel.fits = lambda self, mb, mode, extra=0: not (self.rank == 1 and mb.num_prompts > 1)
        return
    from rollplex.rl import actor as actor_mod

    real = actor_mod.token_logprobs
    calls = [0]

    def fake(model, mb, *a, **k):
        if mb.num_prompts > 1 and torch.is_grad_enabled():
            calls[0] += 1
            if calls[0] > 1 if kind == "in_pass" else dist.get_rank() == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(model, mb, *a, **k)

    actor_mod.token_logprobs = fake


def worker(rank: int, world: int, init: str, tiny_dir, rows, cfg: RLConfig, rollout: str, steps: int,
           memory_cfg, want: list[dict], oom: str | None = None, fsdp=None) -> None:
    init_group(rank, world, init)
    try:
        rl = build(tiny_dir, cfg, rollout, memory_cfg, group=dist.group.WORLD, fsdp=fsdp)  # world size 1 included
        assert rl.parallel is not None and rl.parallel.world == world
        if oom is not None:
            inject_oom(oom)
        if cfg.uses_critic:  # the critic's value model is sharded over the group, its passes dealt like the actor's
            from torch.distributed.tensor import DTensor

            from rollplex.parallel import DataParallel

            assert isinstance(rl.critic.placement, DataParallel) and rl.critic.placement.world == world
            assert all(isinstance(p, DTensor) for p in rl.critic.model.parameters())
        got = run_steps(rl, rows, steps)
        # (old logprobs scored on the trainer's shards pack the prompts otherwise than the update's passes,
        # and co-scheduled prefixes are batched per job: other summation orders, within the same bound)
        compare(got, want)
        if cfg.cosched:  # every rank co-scheduled the prefixes of its share beside its decode
            # the old policy's and the reference's: alone on a model it holds whole, as a sweep in lockstep
            # with the other ranks' on a sharded one (whose rest runs at the end of the rollout)
            sharded = (fsdp is None or fsdp.shard_reference) or not rl.parallel.holds_policy
            for g in got:
                rm = g["metrics"]["rollout_metrics"]
                assert rm["rollplex/cosched_chunks"] > 0 and rm["rollplex/prefix_hidden_s"] > 0, rm
                assert ("rollplex/prefix_sweep_rollout_end_s" in rm) == sharded, rm
                assert "rollplex/prefix_ref_normal_phase_s" in g["metrics"], g["metrics"].keys()
        # the default on CPU: every mini-batch of several passes (where there are any) reduced its gradients once
        reduced = [g["metrics"]["perf/fsdp_reduced_once"] for g in got if "perf/fsdp_reduced_once" in g["metrics"]]
        want_once = 0.0 if fsdp is not None and fsdp.reduce_every_pass else 1.0
        assert all(r == want_once for r in reduced), reduced
        shares = rl.parallel.weights.report()  # the trainer's shards are windows of the engine's tensors
        assert shares["shared_bytes"] > 0 and (world > 1 or shares["separate_bytes"] == shares["rebuilt_bytes"] == 0)
        if rollout.startswith("tensor"):  # and rebuilt where they are not: separate shards and rebuilt bytes
            # (one engine over the group, vision tower whole: every trainer shard is inside an engine tensor,
            # by blocked order and column shards; what the engine replicates, the tower and norms, is rebuilt;
            # a split tower's blocks are trained by rows, not in the engine's order)
            one = rl.engine.tp.size == world and not rollout.startswith("tensor+vision")
            assert (shares["separate_bytes"] == 0) == one and shares["rebuilt_bytes"] > 0, shares
        assert got[-1]["metrics"]["perf/weights_shared_gib"] == shares["shared_bytes"] / 2**30
        if oom is not None:  # every rank backed off to one prompt per pass
            assert rl.actor._plan(rl.cfg).prompts == 1
        if memory_cfg is not None:  # the rank's regions hold its shards and moved between phases
            sizes = rl.memory.report()["region_bytes"]
            assert min(sizes["ref_weights"], sizes["optimizer"], sizes["grads"], sizes["kv_cache"]) > 0, sizes
            assert got[-1]["metrics"]["memory/offload_copy_gib"] > 0
            assert rl.memory.state["kv_cache"] == "released" and rl.memory.state["ref_weights"] == "offloaded"
        if rollout.startswith("tensor"):  # the engine's shards hold the updated weights, and nothing whole
            from rollplex.parallel.fsdp import local_tensor
            tp = rl.engine.tp
            assert rl.model is rl.engine.model and rl.parallel.tp is tp
            gc.collect()  # the whole policy the step was built from is gone: no rank holds it
            assert all(ref() is None for ref in rl.whole_text_weights)
            engine_params = dict(rl.engine.model.named_parameters())
            full = rl.policy_state()
            vision_tp = rollout.startswith("tensor+vision")
            assert tp.vision == vision_tp
            for n, t in tp.shard(full, rl.model.cfg).items():
                assert torch.equal(engine_params[n], t), n
            # the shared trainer shards are windows of the engine's tensors: what the vision tower (whole in
            # the engine) holds, and with one engine over the group the vocab-parallel embedding shard and the
            # row-parallel o / down shards (the trainer shards those by columns there)
            trainer = dict(rl.actor.model.named_parameters())
            one_engine = tp.size == world
            shared = ["model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight"] if one_engine else []
            shared.append("visual.blocks.0.norm1.weight" if vision_tp else "visual.blocks.0.attn.qkv.weight")
            if vision_tp:  # a split vision qkv is [q_t; k_t; v_t]: not one window of an FSDP row chunk
                assert "visual.blocks.0.attn.qkv.weight" not in rl.parallel.weights.shared
            for n in shared:
                assert n in rl.parallel.weights.shared, n
                storage = engine_params[n].untyped_storage()
                assert local_tensor(trainer[n]).untyped_storage().data_ptr() == storage.data_ptr(), n
            # under several engines a row-parallel shard is a column window of FSDP's whole rows: kept apart
            assert ("model.layers.0.mlp.down_proj.weight" in rl.parallel.weights.shared) == one_engine
        dist.barrier()
    finally:
        dist.destroy_process_group()


def checkpoint_worker(rank: int, world: int, init: str, tiny_dir, rows, cfg: RLConfig, ckpt: str,
                      rollout: str = "data") -> None:
    """Two steps straight through, against one step + save, then a fresh group step that loads and runs
    the second step: the same rollout, metrics and weights (with a tensor-parallel engine the policy is
    gathered from the trainer's shards to be written, and the engine's shards rebuilt on load)."""
    import shutil
    from pathlib import Path

    import pytest

    from rollplex.models import load_model
    from rollplex.rl.run_state import load_checkpoint, save_checkpoint

    init_group(rank, world, init)
    try:
        first = build(tiny_dir, cfg, rollout, group=dist.group.WORLD)
        first.step(rows)
        after_one = {n: p.clone() for n, p in first.policy_state().items()}
        critic_one = {n: full_tensor(p.detach()).clone() for n, p in first.critic.model.named_parameters()} \
            if first.critic is not None else None
        save_checkpoint(first, ckpt, data_state={"epoch": 3})
        want = run_steps(first, rows, 1)
        del first
        second = build(tiny_dir, cfg, rollout, group=dist.group.WORLD)
        assert load_checkpoint(second, ckpt) == {"epoch": 3} and second.step_idx == 1
        got = run_steps(second, rows, 1)
        compare(got, want)
        # the HF directory holds the policy as it was saved, readable by one process
        saved = dict(load_model(ckpt).named_parameters())
        assert all(torch.equal(saved[n], w) for n, w in after_one.items())
        if critic_one is not None:  # and the critic gathered from its shards, readable as critic_model_path
            from rollplex.rl.critic import build_value_model

            vm = dict(build_value_model(load_model(ckpt), Path(ckpt) / "critic").named_parameters())
            assert vm.keys() == critic_one.keys() and all(torch.equal(vm[n], w) for n, w in critic_one.items())
        single = Path(ckpt).parent / "single"  # the same checkpoint as one process would have written it
        if rank == 0:
            shutil.copytree(ckpt, single)
            for f in single.glob("trainer_state.rank*"):
                f.rename(single / "trainer_state.pt")
        dist.barrier()
        with pytest.raises(ValueError, match="written by one process"):  # refused on every rank alike
            load_checkpoint(second, single)
        dist.barrier()
    finally:
        dist.destroy_process_group()
