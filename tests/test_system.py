"""SystemConfig, build() and the generated command lines (rollplex/system.py, rollplex/cli.py): a tiny config
builds a system that trains, flags round-trip to the config they name, checks across components
fail early, and every entry point assembles through build and parses through the generator."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from rollplex.backends import BackendConfig
from rollplex.cli import ConfigParser
from rollplex.cosched import CoschedConfig
from rollplex.engine import EngineConfig
from rollplex.memory import MemoryConfig
from rollplex.parallel.fsdp import FSDPConfig
from rollplex.parallel.tp import TPConfig
from rollplex.rl.config import RLConfig
from rollplex.system import SystemConfig, build, check_group
from rollplex.tiny import shape_color

ROOT = Path(__file__).resolve().parents[1]
ENGINE = EngineConfig(max_model_len=256, kv_cache_tokens=2048, max_num_seqs=8)


def test_build_gives_a_system_that_trains_one_step(tiny_dir):
    cfg = SystemConfig(model=str(tiny_dir), device="cpu", rl=RLConfig(n=4, max_new_tokens=4, lr=1e-3, kl_coef=0.01),
                       engine=ENGINE)
    # a reward that differs within a group (the untrained tiny model answers no question right)
    system = build(cfg, reward_fn=lambda source, text, truth, extra=None: float(sum(map(ord, text)) % 2))
    assert system.processor is not None and Path(system.model_path) == Path(tiny_dir)
    # one engine, one memory manager (the default plan is managed), shared by the step
    assert system.rl.engine is system.engine and system.engine.memory is system.memory is system.rl.memory
    assert system.rl.model is system.model and system.rl.ref is not None and system.config is cfg
    assert list(system.startup_s)[:1] == ["weights"] and "trainer" in system.startup_s
    before = [p.detach().clone() for p in system.model.parameters()]
    m = system.rl.step(shape_color.make_rows(2, seed=0))
    assert system.rl.step_idx == 1 and m["actor/grad_norm"] > 0, m["critic/score/mean"]
    assert any(not torch.equal(a, b) for a, b in zip(before, system.model.parameters()))
    # another step over the same policy and engine, with its own RLConfig
    other = system.rl_step(dataclasses.replace(cfg.rl, mode="serial"), rollout=False, reward_fn="exact")
    assert other.model is system.model and other.engine is None and other.cfg.mode == "serial"
    system.close()


def test_build_without_a_memory_plan_has_no_manager(tiny_dir):
    cfg = SystemConfig(model=str(tiny_dir), device="cpu", format_warmup_steps=1, engine=ENGINE,
                       memory=MemoryConfig(memory_plan="resident"), rl=RLConfig(max_new_tokens=4))
    system = build(cfg, step=False)
    assert system.memory is None and system.rl is None and system.engine.memory is None
    assert system.warmup_loss is not None and not system.model.training
    # a caller's engine (the parallel bench shares one across its paths) is used as is
    again = build(dataclasses.replace(cfg, format_warmup_steps=0), model=system.model, engine=system.engine, group=None)
    assert again.engine is system.engine is again.rl.engine and again.model is system.model and again.rl.ref is None
    # one part of the system (the disaggregated layout's ranks): the step without a rollout backend, or the engine
    cfg = dataclasses.replace(cfg, format_warmup_steps=0)
    trainer = build(cfg, model=system.model, group=None, part="trainer")
    assert trainer.engine is trainer.rollout is None and trainer.rl.engine is None and trainer.rl.backend is None
    rollout = build(cfg, model=system.model, group=None, part="rollout")
    assert rollout.rl is None and rollout.engine is not None and rollout.engine.model is system.model


def _argv(cfg, default) -> list[str]:
    """Flags naming every field of `cfg` that differs from `default` (the inverse of the generated parser)."""
    out = []

    def put(name: str, value) -> None:
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif value is None:
            out.extend([flag, "none"])
        elif isinstance(value, tuple):
            out.extend([flag, *map(str, value)])
        else:
            out.extend([flag, str(value)])

    for f in dataclasses.fields(cfg):
        value, base = getattr(cfg, f.name), getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            for g in dataclasses.fields(value):
                if g.name != "seed" and getattr(value, g.name) != getattr(base, g.name):
                    put(g.name, getattr(value, g.name))
        elif value != base:
            put(f.name, value)
    if cfg.rl.seed != default.rl.seed:
        put("seed", cfg.rl.seed)
    return out


def test_generated_flags_round_trip_a_config():
    cfg = SystemConfig(device="cpu", format_warmup_steps=3, compile=False,
                       rl=RLConfig(n=4, kl_coef=0.02, dual_clip=None, packed=False, betas=(0.8, 0.9),
                                   micro_batch_prompts=2, micro_batch_max_tokens=512, seed=5),
                       engine=EngineConfig(max_model_len=1024, decode_split_k=(2, 4), overlap_schedule=False, seed=5),
                       memory=MemoryConfig(memory_plan="release", optimizer_offload="moments"),
                       fsdp=FSDPConfig(layers_per_unit=2, reshard_after_forward=False),
                       cosched=CoschedConfig(job_prompts=2, buckets=(1, 8, 64)))
    default = SystemConfig(device="cpu")
    ap = ConfigParser(SystemConfig)
    argv = _argv(cfg, default)
    assert "--no-packed" in argv and "--buckets" in argv and "--seed" in argv
    assert ap.config(ap.parse_args(argv)) == cfg
    assert ap.config(ap.parse_args(["--device", "cpu"])) == default
    # the driver's OpenRLHF-style name and a program's alias set the same field
    assert ap.config(ap.parse_args(["--device", "cpu", "--n-samples", "3"])).rl.n == 3
    assert set(ap.given(ap.parse_args(["--device", "cpu", "--n", "8"]))) == {"device", "rl.n"}


def test_entry_points_keep_their_flags_and_defaults():
    from rollplex.bench import memory, parallel_step, step
    from rollplex.bench import parallel as bench_parallel
    from rollplex.demo import train
    from rollplex.server import __main__ as server

    demo = train.parser()
    cfg = train.config(demo, demo.parse_args(["--device", "cpu", "--warmup-steps", "2", "--n", "4", "--seed", "3",
                                              "--adv-estimator", "dr_grpo", "--filter-groups"]))
    # dr_grpo and DAPO's filter_groups bring their demo defaults (a KL loss, 4 mini-batches per rollout)
    want_rl = dataclasses.replace(train.DEFAULTS["rl"], n=4, seed=3, adv_estimator="dr_grpo", filter_groups=True,
                                  loss_agg_mode="seq-mean-token-sum-norm", kl_coef=0.1, ppo_mini_batches=4)
    assert cfg == SystemConfig(device="cpu", dtype="float32", format_warmup_steps=2, rl=want_rl,
                               engine=dataclasses.replace(train.DEFAULTS["engine"], seed=3),
                               memory=MemoryConfig(memory_plan="resident"))
    # rloo and reinforce_plus_plus bring their KL loss to the reference (and lr) unless the flags are given
    rl = [train.config(demo, demo.parse_args(["--device", "cpu", "--adv-estimator", est, *flags])).rl
          for est, flags in [("rloo", []), ("rloo", ["--kl-coef", "0"]), ("reinforce_plus_plus", []),
                             ("reinforce_plus_plus", ["--lr", "1e-3"])]]
    assert [(r.kl_coef, r.use_kl_loss, r.lr) for r in rl] == [(0.1, True, 1e-3), (0.0, True, 1e-3),
                                                              (0.1, True, 1.5e-3), (0.1, True, 1e-3)]
    bench = step.parser()
    args = bench.parse_args(["--device", "cpu", "--micro-prompts", "3", "--micro-tokens", "64", "--no-packed"])
    got = bench.config(args).rl
    assert (got.micro_batch_prompts, got.micro_batch_max_tokens, got.packed, got.kl_coef) == (3, 64, False, 0.01)
    mem = memory.parser()
    tiny = memory.system_config(mem, mem.parse_args(["--device", "cpu"]), "tiny")
    assert (tiny.rl.n, tiny.rl.max_new_tokens, tiny.rl.micro_batch_prompts) == memory.WORKLOADS["tiny"][2:]
    assert tiny.memory.memory_backend == "accounting" and tiny.engine.kv_cache_tokens == 16384
    given = memory.system_config(mem, mem.parse_args(["--device", "cpu", "--micro-prompts", "1"]), "tiny")
    assert given.rl.micro_batch_prompts == 1
    # the same option has the same flag everywhere: a flag that two programs share names the same field, but
    # for the demo's --warmup-steps, its format warm-up's name from before the flags were generated (the LR
    # warm-up's everywhere else)
    seen: dict[str, str] = {}
    for ap in [server.parser(), demo, bench, mem, bench_parallel.parser(), parallel_step.parser()]:
        for action in ap._actions:
            if action.dest in ap.config_dests:
                for flag in action.option_strings:
                    if (ap, flag) != (demo, "--warmup-steps"):
                        assert seen.setdefault(flag, action.dest) == action.dest, flag
    assert seen["--warmup-steps"] == "rl.warmup_steps" and cfg.rl.warmup_steps == 0
    assert seen["--n-samples"] == seen["--n"] == "rl.n" and seen["--micro-prompts"] == "rl.micro_batch_prompts"


@pytest.mark.parametrize("kw,match", [
    (dict(rl=RLConfig(cosched=True, kl_coef=0.01), backend=BackendConfig("sglang")), "cosched needs the native"),
    (dict(rl=RLConfig(cosched=True)), "needs kl_coef > 0"),
    (dict(tp=TPConfig(tensor_parallel=2), backend=BackendConfig("sglang")), "shards the native engine"),
], ids=["cosched-sglang", "cosched-nothing-to-move", "tp-sglang"])
def test_invalid_combinations_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        SystemConfig(device="cpu", **kw)


def test_invalid_combinations_fail_the_command_line_and_the_group_check():
    from rollplex.demo import train

    with pytest.raises(SystemExit) as e:  # before anything is loaded
        train.main(["--device", "cpu", "--cosched"])
    assert e.value.code == 2
    SystemConfig(device="cpu", rl=RLConfig(cosched=True, ppo_epochs=2))  # the old policy's prefix moves
    check_group(SystemConfig(device="cpu", tp=TPConfig(tensor_parallel=2)), 4)
    with pytest.raises(ValueError, match="must divide 3"):
        check_group(SystemConfig(device="cpu", tp=TPConfig(tensor_parallel=2)), 3)
    with pytest.raises(ValueError, match="packed=True"):
        check_group(SystemConfig(device="cpu", rl=RLConfig(packed=False)), 2)


ENTRY_POINTS = ["rollplex/server/state.py", "rollplex/demo/train.py", "rollplex/bench/step.py",
                "rollplex/bench/memory.py"]
PARSERS = ["rollplex/server/__main__.py", "rollplex/demo/train.py", "rollplex/bench/step.py",
           "rollplex/bench/memory.py", "rollplex/bench/parallel.py", "rollplex/bench/parallel_step.py"]


def _calls(path: str) -> set[str]:
    tree = ast.parse((ROOT / path).read_text())
    return {n.func.id if isinstance(n.func, ast.Name) else n.func.attr for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))}


@pytest.mark.parametrize("path", ENTRY_POINTS)
def test_entry_points_assemble_through_build(path):
    calls = _calls(path)
    assert "build" in calls and not calls & {"Engine", "RLStep", "MemoryManager", "data_parallel"}, path


def test_the_parallel_bench_places_its_steps_through_build():
    # its paths share one engine (built by the bench, tensor-parallel over a rollout group or not): build
    # takes it and makes the step with the path's placement
    calls = _calls("rollplex/bench/parallel_paths.py")
    assert "build" in calls and not calls & {"RLStep", "data_parallel", "MemoryManager"}
    # the disaggregated step is given its rank's part, built from one config by build_disaggregated
    assert {"build_disaggregated"} <= calls & _calls("rollplex/bench/parallel.py")
    assert not _calls("rollplex/parallel/disaggregated_step.py") & {"Engine", "RLStep", "data_parallel",
                                                                    "apply_tensor_parallel"}


@pytest.mark.parametrize("path", PARSERS)
def test_entry_points_parse_through_the_generator(path):
    calls = _calls(path)
    assert "ConfigParser" in calls and "ArgumentParser" not in calls, path
