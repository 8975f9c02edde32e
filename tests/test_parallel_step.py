"""The RL step under torch.distributed (gloo, spawned ranks) computes the single-process step: same
rollout tokens (sampling is seeded per prompt and sample), same metrics, gradients and updated
weights, over two steps (the second rolls out with the synced weights); per-rank and tensor-parallel
rollout; world size 1 through the distributed path too."""

import pytest
from parallel_helpers import spawn
from parallel_step_worker import build, run_steps, worker

from rollplex.memory import MemoryConfig
from rollplex.parallel import FSDPConfig
from rollplex.rl.config import RLConfig
from rollplex.tiny import shape_color

ROWS = shape_color.make_rows(5, seed=3)
# a small lr: Adam's first step is ~lr * sign(grad), so rounding noise in a near-zero gradient would
# move a weight by up to 2 lr
BASE = dict(n=4, max_new_tokens=6, lr=1e-4, kl_coef=0.05, micro_batch_prompts=2)


def _spawn(tmp_path, tiny_dir, world, cfg, rollout="data", steps=2, memory_cfg=None, oom=None, fsdp=None):
    want = run_steps(build(tiny_dir, cfg, group=None), ROWS, steps)
    spawn(worker, args=(world, f"file://{tmp_path}/store", tiny_dir, ROWS, cfg, rollout, steps, memory_cfg, want,
                           oom, fsdp), nprocs=world)


@pytest.mark.slow
@pytest.mark.parametrize("world,rl,fsdp", [
    (1, dict(), None),
    # two mini-batches (old logprobs scored data-parallel first), entropy bonus, sequence-mean loss
    (2, dict(ppo_mini_batches=2, entropy_coeff=0.01, loss_agg_mode="seq-mean-token-mean"), None),
    (4, dict(mode="serial", micro_batch_samples=3), None),
    # a frozen vision tower: the per-rank rollout drops the engine's encodings, the towers run frozen
    (2, dict(freeze_vision_tower=True), None),
    # the co-scheduler per rank: each rank's old-policy prefixes beside its own decode, scored by it
    (2, dict(cosched=True, ppo_mini_batches=2), None),
    # and with the reference whole on every rank, its prefixes too (the frozen tower's encodings from the
    # rank's own prefill)
    (2, dict(cosched=True, ppo_mini_batches=2, freeze_vision_tower=True), FSDPConfig(shard_reference=False)),
    # PPO with a critic: the value model sharded like the trainer, its values and update data-parallel
    (2, dict(adv_estimator="gae", critic_lr=1e-4, ppo_mini_batches=2, use_kl_loss=False), None),
])
def test_data_parallel_step_equals_single_process(tmp_path, tiny_dir, world, rl, fsdp):
    _spawn(tmp_path, tiny_dir, world, RLConfig(**{**BASE, **rl}), fsdp=fsdp)


@pytest.mark.slow
@pytest.mark.parametrize("rl,fsdp", [
    (dict(), None),
    # frozen: every rank prefilled every prompt, so the engine's encodings stand in for both towers
    (dict(freeze_vision_tower=True), None),
    # no rank holds the policy whole: the old logprobs are scored data-parallel on the trainer's shards; a
    # reference held whole is co-scheduled per rank beside the tensor-parallel decode
    (dict(cosched=True, ppo_mini_batches=2), FSDPConfig(shard_reference=False)),
    # the vision tower's blocks split over the engine's ranks too, its shards rebuilt after each update
    (dict(vision_tp=True), None),
])
def test_tensor_parallel_rollout_step_equals_single_process(tmp_path, tiny_dir, rl, fsdp):
    rl = dict(rl)
    vision = rl.pop("vision_tp", False)
    _spawn(tmp_path, tiny_dir, 2, RLConfig(**{**BASE, **rl}), rollout="tensor+vision" if vision else "tensor",
           steps=1 if vision else 2, fsdp=fsdp)


@pytest.mark.slow
@pytest.mark.parametrize("rollout,rl", [("tensor:2", dict(freeze_vision_tower=True)),
                                        ("tensor:2:strided", dict(ppo_mini_batches=2))])
def test_rollout_groups_of_tensor_parallel_engines(tmp_path, tiny_dir, rollout, rl):
    # 4 ranks, two rollout groups of 2: each group's engines decode half the prompts with their shards
    # (frozen: the encodings of the other group's prompts are not on this rank, so the towers run); the
    # groups are consecutive blocks or strided ({0, 2}, {1, 3}: rank 1 is the second engine's TP rank 0;
    # with two mini-batches)
    _spawn(tmp_path, tiny_dir, 4, RLConfig(**{**BASE, **rl}), rollout=rollout)


@pytest.mark.slow
@pytest.mark.parametrize("rollout,overrides,rl,fsdp", [
    ("data", "ref_weights:*=offloaded,optimizer:*=offloaded", {}, None),
    ("tensor", "ref_weights:*=offloaded,optimizer:*=offloaded", {}, None),
    # a whole reference per rank, resident while its prefixes run beside decode and off the device for the
    # update: the phase-aware way to co-schedule it
    ("data", "ref_weights:update=offloaded,optimizer:*=offloaded", dict(cosched=True, ppo_mini_batches=2),
     FSDPConfig(shard_reference=False)),
])
def test_memory_manager_runs_per_rank(tmp_path, tiny_dir, rollout, overrides, rl, fsdp):
    # every idle region moves (released regions read as garbage with the accounting backend), the
    # optimizer pages its moments, layers are checkpointed: same step as one process without any of it;
    # per-rank engines, or one tensor-parallel engine whose KV cache holds each rank's KV heads
    mem = MemoryConfig(memory_plan="release", memory_overrides=overrides, optimizer_offload="moments")
    _spawn(tmp_path, tiny_dir, 2, RLConfig(**BASE, gradient_checkpointing=True, **rl), rollout=rollout,
           memory_cfg=mem, fsdp=fsdp)


@pytest.mark.slow
@pytest.mark.parametrize("world,oom,fsdp,rl", [
    (2, "predicted", None, {}), (2, "in_pass_rank1", None, {}),
    # a mini-batch of one pass per rank (4 prompts per pass): its gradients are reduced once too
    (2, "in_pass_rank1", None, dict(micro_batch_prompts=4)),
    (1, "in_pass", None, {}), (1, "in_pass", FSDPConfig(reduce_every_pass=True), {})])
def test_oom_backs_off_on_every_rank(tmp_path, tiny_dir, world, oom, fsdp, rl):
    # a pass predicted not to fit on one rank backs every rank off together; so does an OOM inside a pass
    # on one rank when the passes accumulate gradients (the default on CPU: they run no collective, and the
    # ranks agree before the reduce). With one rank an OOM inside a pass is retried as on one process,
    # also with gradients reduced after every pass (through FSDP's hooks). Same step as without the OOM.
    _spawn(tmp_path, tiny_dir, world, RLConfig(**{**BASE, **rl}), steps=1, oom=oom, fsdp=fsdp)


def test_what_a_process_group_refuses(tmp_path, tiny_dir):
    import torch.distributed as dist

    from rollplex.engine import Engine
    from rollplex.models import load_model
    from rollplex.parallel import data_parallel
    from rollplex.rl.step import RLStep

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        world = dist.group.WORLD  # a group of one rank, given explicitly
        with pytest.raises(ValueError, match="data-parallel"):
            build(tiny_dir, RLConfig(**{**BASE, "packed": False}), group=world)
        rl = build(tiny_dir, RLConfig(**BASE), group=world)
        assert rl.parallel is not None and rl.parallel.rollout == "data"
        other = Engine(load_model(tiny_dir), rl.processor)  # neither the policy nor its TP shard
        with pytest.raises(ValueError, match="tensor-parallel shard"):
            RLStep(rl.model, other, RLConfig(**BASE), rl.processor, reward_fn="exact",
                   parallel=data_parallel(rl.model, other, RLConfig(**BASE), world))
        assert build(tiny_dir, RLConfig(**BASE), group=None).parallel is None
        # group="auto" over a default group of one: the single-process step (nothing to shard or split)
        assert build(tiny_dir, RLConfig(**BASE)).parallel is None
    finally:
        dist.destroy_process_group()
