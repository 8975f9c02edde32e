"""Command-line flags generated from a config dataclass (SystemConfig, ServerConfig): one generator for the
server, the demo and the benchmarks, so an option has the same flag everywhere.

    ap = ConfigParser(SystemConfig, defaults={"rl": RLConfig(n=16)}, prog=...)   # flags from the config
    ap.add_argument("--steps", ...)                                               # the program's own
    args = ap.parse_args(argv)
    cfg = ap.config(args)                                                         # ValueError if invalid

Every field is a flag named after it (`--kl-coef`, `--max-model-len`; booleans `--x/--no-x`; `X | None`
numbers also take `none`): the top-level fields of the config class, then one argument group per
nested config (`rl`, `engine`, ...). The fields named `seed` of every nested config share one
`--seed`. A new config field is a new flag with nothing restated. Help comes from HELP (what a field
means where its name alone does not say it) and the field's class, choices from CHOICES.

Flags a program keeps from before (the benchmarks' `--micro-prompts`, the demo's `--warmup-steps`, the
driver's OpenRLHF-style `--n-samples`) are aliases: ALIASES for every program, `aliases=` for one.
`skip=` leaves fields (or whole sections) without a flag, e.g. where the program sets them itself.

A flag that is not given leaves its field at the program's default (`defaults=`, a dict of the config's
fields, nested configs as instances), so `ap.given(args)` tells the fields given from the defaults
kept and a program can fill in defaults of its own (a workload's micro-batch size). The config is built
once, from the given values and the defaults, so its `__post_init__` (device resolution, checks
across components) sees the final values.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

# What a flag means, where the field name alone does not say it (programs may override per flag).
HELP = {
    "model": "HF checkpoint dir, HF model id from the local cache, or preset name (qwen2.5-vl-3b/7b/32b: RANDOM "
             "weights, for benchmarks only) (default: the embedded tiny model)",
    "device": "default: cuda if available",
    "dtype": "default: bfloat16 on cuda, float32 on cpu",
    "compile": "torch.compile the policy's forward (prefill, training); default: on cuda",
    "format_warmup_steps": "supervised answer-format steps on the shape-colour task at startup (tiny demo)",
    "mode": "rollplex: shared-prefix scoring and training; serial: verl's per-sample order",
    "n": "samples per prompt (GRPO group size)",
    "kl_coef": "> 0 keeps a frozen reference model",
    "dual_clip": "verl's clip_ratio_c (caps a negative-advantage token's loss at c*|A|); 'none' turns it off",
    "singleton_adv": "advantage of a group of one sample: reward (verl: the reward itself) or zero",
    "gamma": "discount of reinforce_plus_plus's and gae's per-token return",
    "lam": "GAE's lambda (adv_estimator gae)",
    "cliprange_value": "the critic's value loss clips its predictions to the scored values +- this (gae)",
    "critic_lr": "the critic's AdamW lr (gae)",
    "critic_warmup": "the first steps train the critic only (gae)",
    "critic_model_path": "HF directory of the critic (gae; default: a copy of the policy and a fresh value head)",
    "clip_ratio_high": "PPO clip range above 1 (DAPO's clip-higher: 0.28)",
    "loss_agg_norm": "seq-mean-token-sum-norm's constant divisor of a sequence's token sum (default: max_new_tokens)",
    "tis_imp_ratio_cap": "truncated importance sampling: the pg loss times min(exp(old - rollout logprob), cap) "
                         "(--rollout-is token with this threshold)",
    "rollout_is": "rollout correction's IS weights (verl's rollout_is): token or sequence, truncated at "
                  "--rollout-is-threshold (default: off)",
    "rollout_is_batch_normalize": "rollout correction: the IS weights divided by their batch mean",
    "rollout_rs": "rollout correction's rejection (verl's rollout_rs): token (IcePop's mask), sequence or geometric "
                  "weights outside [--rollout-rs-threshold-lower, --rollout-rs-threshold] leave the loss "
                  "(default: off)",
    "rollout_rs_threshold_lower": "default: 1 / --rollout-rs-threshold",
    "rollout_token_veto_threshold": "rollout correction: a sequence with a token weight under this leaves the loss "
                                    "(default: off)",
    "kl_ctrl": "KL-in-reward coefficient: fixed (kl_coef) or adaptive (verl's controller, from kl_coef towards "
               "kl_target over kl_horizon samples)",
    "lr_schedule_unit": "what advances the LR schedule: step (one train step, verl) or optimizer_step (each "
                        "mini-batch)",
    "overlong_buffer_len": "DAPO's overlong reward shaping: the last tokens before max_new_tokens over which a "
                           "response loses up to overlong_penalty_factor from its score (0: off)",
    "overlong_penalty_factor": "the overlong penalty at max_new_tokens (verl's overlong_buffer.penalty_factor)",
    "filter_groups": "DAPO's dynamic sampling: drop the groups whose samples all have the same "
                     "filter_groups_metric and roll out more prompts until the step is full",
    "filter_groups_metric": "seq_reward: the reward trained on (after overlong shaping); score: the reward "
                            "function's score before it; or a key of the reward function's dict, e.g. acc",
    "max_num_gen_batches": "rollouts per step at most with --filter-groups (0: unbounded; verl's recipe: 10)",
    "filter_groups_partial": "at --max-num-gen-batches train on the groups kept instead of stopping with an error",
    "micro_batch_prompts": "prompts (x n samples) per forward/backward",
    "micro_batch_samples": "serial mode: sequences per forward/backward",
    "micro_batch_max_tokens": "token budget per forward/backward instead of the two counts (verl's dynamic batch size)",
    "packed": "rollplex mode: prompts and responses packed into one pass; --no-packed: a prefix pass, then padded "
              "responses",
    "freeze_vision_tower": "no gradient into the vision tower; the engine's prefill encodings are reused",
    "cosched": "run the reference's prefix beside the rollout's decode steps (needs --kl-coef > 0; on an H200 it "
               "made steps no faster: docs/ARCHITECTURE.md)",
    "schedule": "fused: train each prompt group beside the rest of the rollout (rl/pipeline.py)",
    "seed": "seeds the model init, the warm-up, the trainer and the engine",
    "block_size": "tokens per KV block; default: 64 on CUDA, 16 on CPU",
    "kv_cache_tokens": "default: 65536 on CPU, profiled on GPU",
    "memory_plan": "auto: the cheapest residency plan that fits; release: KV cache and gradients released when idle; "
                   "resident: nothing moves",
    "memory_overrides": "tag:phase=residency,... on top of the plan, e.g. ref_weights:*=offloaded",
    "optimizer_offload": "AdamW state in pinned host memory: paged through the GPU in the optimizer step "
                         "(moments, all) or stepped on the CPU (cpu); auto: none, unless the memory plan needs "
                         "moments or all to fit the device",
    "gradient_checkpointing": "per-layer activation checkpointing of the decoder (default: on only when the memory "
                              "plan needs it to fit the device)",
    "vision_gradient_checkpointing": "the same for the vision blocks (default: on when the memory plan turns "
                                     "checkpointing on)",
    "device_capacity_gib": "device memory the memory plan fits the step into (default: the GPU's total memory "
                           "less what an SGLang rollout backend took at its start; unchecked on CPU)",
    "decode_split_k": "S_o S_down K slices of the graphed decode's o/down projections; default: timed per bucket",
    "tuning_cache_dir": "keeps the decode-kernel tuning between starts; auto: $ROLLPLEX_CACHE_DIR/tuning or "
                        "~/.cache/rollplex/tuning; '' turns it off",
    "rollout_backend": "native: Rollplex's engine decodes with the trainer's weights; sglang: SGLang decodes "
                       "(pip install 'rollplex[sglang]'; CUDA), the policy copied in before each rollout; "
                       "/generate is then not served",
    "sglang_mem_fraction_static": "share of device memory SGLang takes for its weights and KV cache; the trainer "
                                  "uses the rest",
    "sglang_release_weights": "release SGLang's weights outside the rollout (copied in again before it)",
    "sglang_weights_cpu_backup": "SGLang keeps a host copy of released weights",
    "sglang_weight_bucket_mb": "MiB per update_weights_from_tensor call when the policy is copied in",
    "sglang_args": "further SGLang server arguments as a JSON object, e.g. '{\"attention_backend\": \"fa3\"}'",
    "reshard_after_forward": "free each FSDP unit's gathered parameters after its forward (ZeRO-3); "
                             "--no-reshard-after-forward keeps them to backward",
    "param_dtype": "FSDP2 mixed precision: the layers compute in this dtype from the shards",
    "reduce_dtype": "FSDP2 mixed precision: gradients are reduced in this dtype",
    "activation_checkpointing": "per-layer activation checkpointing inside each FSDP unit (as "
                                "--gradient-checkpointing)",
    "vision_activation_checkpointing": "the same for the vision blocks",
    "share_policy_storage": "the trainer's shards are windows of the policy's tensors (no second copy)",
    "shard_reference": "the frozen reference sharded by FSDP2; --no-shard-reference keeps it whole on every rank",
    "layers_per_unit": "decoder layers / vision blocks per FSDP unit: fewer, larger gathers and less hook time",
    "tensor_parallel_vision": "under --tensor-parallel, split the vision tower's blocks over the engine's ranks too "
                              "(default: the tower runs whole on every rank)",
    "vocab_parallel_sampling": "under --tensor-parallel, decode draws from each rank's vocabulary shard instead of "
                               "gathering the [B, V] logits (batches with top-k/top-p/min-p gather them anyway)",
    "reduce_every_pass": "reduce-scatter gradients after every micro-batch; --no-reduce-every-pass: once per "
                         "mini-batch, the units kept gathered between its passes (faster, more memory); default: "
                         "once per mini-batch when that fits every rank's free memory",
    "job_prompts": "co-scheduler: prompts per prefix job (one batched forward)",
    "side_sms": "co-scheduler: 0 shares every SM with decode, N > 0 confines the admitted work to a green context "
                "of N SMs",
}

# Other names a flag answers to in every program: the driver's OpenRLHF-style names (examples/train_grpo.py).
ALIASES = {"rl.n": ("--n-samples",)}

TITLES = {"rl": "RL step (RLConfig)", "engine": "engine (EngineConfig)",
          "memory": "phase-aware memory (MemoryConfig)", "backend": "rollout backend (BackendConfig)",
          "fsdp": "FSDP2 training over a torchrun group (FSDPConfig; one process ignores it)",
          "cosched": "prefix co-scheduler (CoschedConfig; with --cosched)",
          "tp": "tensor-parallel rollout over a torchrun group (TPConfig)",
          "limits": "request limits (ServerLimits): over them a request is 413 (body) or 400"}


def algorithm_help() -> dict[str, str]:
    """The help of the algorithm flags, listing every option of rl/algos.py's menus (so it cannot go stale)."""
    from .rl.algos import ADV_ESTIMATOR_HELP, AGG_MODE_HELP, POLICY_LOSS_HELP, describe, kl_help

    return {"adv_estimator": describe(ADV_ESTIMATOR_HELP), "policy_loss": describe(POLICY_LOSS_HELP),
            "loss_agg_mode": describe(AGG_MODE_HELP), "kl_loss_type": "estimator of the KL loss (use_kl_loss): "
            + kl_help(), "kl_penalty": "estimator of the KL-in-reward penalty (use_kl_loss false; verl's default kl): "
            + kl_help()}


def choices() -> dict[str, tuple]:
    """Allowed values per field path (section.field, or field at the top)."""
    from .backends import ROLLOUT_BACKENDS
    from .memory.config import PLANS
    from .memory.fit import OPTIMIZER_OFFLOADS
    from .parallel.fsdp import DTYPES
    from .rl import config as rl
    from .rl.algos import AGG_MODES, KL_KINDS, POLICY_LOSSES, SINGLETON_ADV
    from .rl.rollout_correction import IS_LEVELS, RS_LEVELS
    from .system import DEVICES
    from .system import DTYPES as SYSTEM_DTYPES

    out = {"device": DEVICES, "dtype": SYSTEM_DTYPES, "memory.memory_plan": PLANS,
           "memory.memory_backend": ("auto", "tms", "accounting"), "memory.optimizer_offload": OPTIMIZER_OFFLOADS,
           "backend.rollout_backend": ROLLOUT_BACKENDS, "fsdp.param_dtype": tuple(DTYPES),
           "fsdp.reduce_dtype": tuple(DTYPES)}
    rl_choices = {"mode": rl.MODES, "adv_estimator": rl.ADV_ESTIMATORS, "loss_agg_mode": AGG_MODES,
                  "kl_loss_type": KL_KINDS, "kl_penalty": KL_KINDS, "lr_schedule": rl.LR_SCHEDULES,
                  "lr_schedule_unit": rl.LR_SCHEDULE_UNITS, "kl_ctrl": rl.KL_CTRLS, "policy_loss": POLICY_LOSSES,
                  "singleton_adv": SINGLETON_ADV,
                  "schedule": rl.SCHEDULES, "fuse_admission": rl.FUSE_ADMISSIONS, "rollout_is": IS_LEVELS,
                  "rollout_rs": RS_LEVELS}
    out.update({f"rl.{k}": v for k, v in rl_choices.items()})
    return out


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None: such a flag's help says what leaving it out means."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def flag_kwargs(tp) -> dict:
    """argparse keywords for a config field of type `tp` (its resolved annotation)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args and len(args) == 2:
        tp = next(a for a in args if a is not type(None))  # X | None: None is "not given"
        if tp in (int, float):  # 'none' gives None where the default is a value (e.g. --dual-clip none)
            def optional(v: str, tp=tp):
                return None if v.lower() == "none" else tp(v)

            optional.__name__ = tp.__name__  # argparse names the type in its errors
            return {"type": optional}
    if tp is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(tp) is tuple:
        elems = typing.get_args(tp)
        if len(elems) == 2 and elems[1] is Ellipsis:
            return {"type": elems[0], "nargs": "+"}
        if len(set(elems)) == 1 and elems[0] in (int, float, str):
            return {"type": elems[0], "nargs": len(elems)}
    if tp in (int, float, str):
        return {"type": tp}
    raise TypeError(f"no command-line form for a field of type {tp}")


class _Unset:
    def __repr__(self) -> str:
        return "<not given>"


UNSET = _Unset()


class ConfigParser(argparse.ArgumentParser):
    """An ArgumentParser with one flag per field of `cls` and of the configs it nests (see the module
    docstring). defaults: the program's defaults, {field: value} with nested configs as instances;
    skip: field paths ("rl.mode") or sections ("cosched") without a flag; aliases: {path: (flag, ...)}
    added to ALIASES; help: {field name or path: text} over HELP; kwargs: {path: argparse keywords}
    replacing the generated ones (e.g. an append action); flags: {path: flag} renaming a field's own flag
    (the old name of a server flag)."""

    def __init__(self, cls, defaults: dict | None = None, *, skip=(), aliases: dict | None = None,
                 help: dict | None = None, kwargs: dict | None = None, flags: dict | None = None,
                 titles: dict | None = None, **parser_kw):
        parser_kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(**parser_kw)
        self.config_cls, self.config_defaults = cls, dict(defaults or {})
        self.config_dests: dict[str, tuple[str, ...]] = {}  # argparse dest -> field paths it sets
        self._append: set[str] = set()
        self._help = {**HELP, **algorithm_help(), **(help or {})}
        self._aliases = {**ALIASES, **(aliases or {})}
        self._kwargs, self._flags, self._skip = kwargs or {}, flags or {}, set(skip)
        self._choices = choices()
        titles = {**TITLES, **(titles or {})}
        hints = typing.get_type_hints(cls)
        top = [f for f in dataclasses.fields(cls) if f.init and not dataclasses.is_dataclass(hints[f.name])]
        nested = [f for f in dataclasses.fields(cls) if f.init and dataclasses.is_dataclass(hints[f.name])]
        for f in top:
            self._add(self, f.name, f.name, hints[f.name], self._default(f), cls.__name__)
        seeds = {self._default(f).seed for f in nested
                 if f.name not in self._skip and "seed" in hints[f.name].__dataclass_fields__}
        if seeds:
            assert len(seeds) == 1, "the nested configs' defaults must agree on the seed --seed sets"
            self.add_argument("--seed", dest="seed", type=int, default=seeds.pop(), help=self._help["seed"])
            self.config_dests["seed"] = ()
        for f in nested:
            if f.name in self._skip:
                continue
            sub, default = hints[f.name], self._default(f)
            group = self.add_argument_group(titles.get(f.name, f.name))
            sub_hints = typing.get_type_hints(sub)
            for g in dataclasses.fields(sub):
                if not g.init:
                    continue
                if g.name == "seed":
                    self.config_dests["seed"] += (f"{f.name}.seed",)
                    continue
                self._add(group, f"{f.name}.{g.name}", g.name, sub_hints[g.name], getattr(default, g.name),
                          sub.__name__)

    def _default(self, f: dataclasses.Field):
        if f.name in self.config_defaults:
            return self.config_defaults[f.name]
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default

    def _add(self, group, path: str, name: str, tp, default, owner: str) -> None:
        if path in self._skip:
            return
        names = [self._flags.get(path, f"--{name.replace('_', '-')}"), *self._aliases.get(path, ())]
        kw = flag_kwargs(tp)
        kw.update(self._kwargs.get(path, {}))
        text = self._help.get(path, self._help.get(name))
        kw["help"] = " ".join(x for x in (text, f"[{owner}.{name}]") if x)
        if path in self._choices:
            kw["choices"] = self._choices[path]
        elif "action" not in kw or kw["action"] is not argparse.BooleanOptionalAction:
            kw.setdefault("metavar", name.upper())
        if kw.get("action") == "append":
            self._append.add(path)
        group.add_argument(*names, dest=path, default=default, **kw)
        self.config_dests[path] = (path,)

    def parse_known_args(self, args=None, namespace=None):
        # a flag not given keeps this marker (argparse sets a default only where the namespace has none), so
        # `given` tells it from a flag given with its default value
        namespace = namespace if namespace is not None else argparse.Namespace()
        for dest in self.config_dests:
            if not hasattr(namespace, dest):
                setattr(namespace, dest, None if dest in self._append else UNSET)
        return super().parse_known_args(args, namespace)

    def given(self, args) -> dict[str, object]:
        """{field path: value} of the config flags given on the command line (`seed`: every nested seed)."""
        out = {}
        for dest, paths in self.config_dests.items():
            value = getattr(args, dest, UNSET)
            if value is UNSET or (dest in self._append and value is None):
                continue
            value = tuple(value) if isinstance(value, list) else value
            for path in paths:
                out[path] = value
        return out

    def config(self, args, **values):
        """The config: the given flags, then `values` ({field path: value}, the program's own choices), over
        the defaults. ValueError (from the configs' checks) when invalid."""
        given = {**self.given(args), **values}
        hints = typing.get_type_hints(self.config_cls)
        kw = {}
        for f in dataclasses.fields(self.config_cls):
            if not f.init:
                continue
            if dataclasses.is_dataclass(hints[f.name]):
                prefix = f.name + "."
                sub = {p[len(prefix):]: v for p, v in given.items() if p.startswith(prefix)}
                default = self._default(f)
                kw[f.name] = dataclasses.replace(default, **sub) if sub else default
            elif f.name in given:
                kw[f.name] = given[f.name]
            elif f.name in self.config_defaults:
                kw[f.name] = self.config_defaults[f.name]
        return self.config_cls(**kw)
