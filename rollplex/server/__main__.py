"""`python -m rollplex.server`: serve a policy for generation, rollouts and training steps over HTTP.

    python -m rollplex.server                                # the embedded tiny model, 127.0.0.1:30000
    python -m rollplex.server --model /ckpt/Qwen2.5-VL-3B-Instruct --api-key $KEY --n 8 --lr 1e-6
    python -m rollplex.server --model qwen2.5-vl-3b          # a preset: real shapes, RANDOM weights (benchmarks)

Flags fill ServerConfig (state.py): its own fields, then one flag per field of the RLConfig and the
EngineConfig it nests, named after the field (`--kl-coef`, `--max-model-len`, `--no-packed`), so a
new config field is a new flag with nothing restated here (except the few in NO_FLAG, which mean
nothing on a server). `--seed` seeds both. Defaults are ServerConfig's. One process per GPU; requests
share one continuous batch.

Under torchrun (WORLD_SIZE > 1) every rank joins the default process group (NCCL on cuda:LOCAL_RANK,
gloo on CPU) and builds the same state; rank 0 serves HTTP on --host/--port and the others follow its
commands (group.py). When rank 0 stops (SIGINT, SIGTERM, or the server ending) it stops the others:

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m rollplex.server --model DIR
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import time
import types
import typing

# What a flag means on the server, where the field name alone does not say it.
HELP = {
    "mode": "rollplex: shared-prefix scoring and training; serial: verl's per-sample order",
    "n": "samples per prompt in /rollout (GRPO group size)",
    "temperature": "default sampling temperature of /rollout",
    "top_p": "default top_p of /rollout",
    "max_new_tokens": "default for /generate and /rollout",
    "kl_coef": "> 0 keeps a frozen reference model",
    "dual_clip": "verl's clip_ratio_c (caps a negative-advantage token's loss at c*|A|); 'none' turns it off",
    "adv_estimator": "grpo, dr_grpo (no std; needs --loss-agg-mode seq-mean-token-sum-norm), rloo (leave-one-out "
                     "baseline), reinforce_plus_plus (discounted per-token return, batch-whitened), "
                     "reinforce_plus_plus_baseline (group mean subtracted, batch-whitened), gae (PPO with a critic: "
                     "the server builds a value model; /train_step may choose gae only on such a server)",
    "singleton_adv": "advantage of a group of one sample: reward (verl: the reward itself) or zero",
    "gamma": "discount of reinforce_plus_plus's and gae's per-token return",
    "lam": "GAE's lambda (adv_estimator gae)",
    "cliprange_value": "the critic's value loss clips its predictions to the scored values +- this (gae)",
    "critic_lr": "the critic's AdamW lr (gae)",
    "critic_warmup": "the first steps train the critic only (gae); not a /train_step override",
    "critic_model_path": "HF directory of the critic (gae; default: a copy of the policy and a fresh value head); "
                         "not a /train_step override",
    "policy_loss": "vanilla: PPO-clip per token; gspo: sequence-level ratio clipped per sequence (verl's recipe: "
                   "--clip-ratio-low 3e-4 --clip-ratio-high 4e-4)",
    "loss_agg_norm": "seq-mean-token-sum-norm's constant divisor of a sequence's token sum (default: max_new_tokens)",
    "tis_imp_ratio_cap": "truncated importance sampling: the pg loss times min(exp(old - rollout logprob), cap)",
    "kl_loss_type": "estimator of the KL loss (use_kl_loss)",
    "kl_penalty": "estimator of the KL-in-reward penalty (use_kl_loss false); verl's default kl (k1)",
    "kl_ctrl": "KL-in-reward coefficient: fixed (kl_coef) or adaptive (verl's controller, from kl_coef towards "
               "kl_target over kl_horizon samples); not a /train_step override",
    "lr_schedule_unit": "what advances the LR schedule: step (one train step, verl) or optimizer_step (each "
                        "mini-batch); not a /train_step override",
    "overlong_buffer_len": "DAPO's overlong reward shaping: the last tokens before max_new_tokens over which a "
                           "response loses up to overlong_penalty_factor from its score (0: off); applies to rewards "
                           "the server scores, against the rollout's max_new_tokens",
    "overlong_penalty_factor": "the overlong penalty at max_new_tokens (verl's overlong_buffer.penalty_factor)",
    "filter_groups": "DAPO's dynamic sampling: /train_step drops the groups whose samples all have the same "
                     "filter_groups_metric and trains the rest (the client refills its batches)",
    "filter_groups_metric": "seq_reward: the reward trained on (after overlong shaping); score: the reward "
                            "function's score before it (a client's rewards are both)",
    "micro_batch_max_tokens": "token budget per forward/backward instead of the two counts (verl's dynamic batch size)",
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
    "device_capacity_gib": "device memory the memory plan fits the step into (default: the GPU's total memory; "
                           "unchecked on CPU)",
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
    "max_prompt_chars": "characters of one text prompt, checked before tokenising; default: 32 x --max-model-len",
    "max_image_pixels": "width x height of one image or video frame, read from its header before decoding",
    "sglang_args": "further SGLang server arguments as a JSON object, e.g. '{\"attention_backend\": \"fa3\"}'",
}


# Config fields with no meaning on a server, so no flag: dynamic sampling's refill (a server rolls out no
# prompts of its own; its clients refill their batches).
NO_FLAG = {"rl": ("max_num_gen_batches", "filter_groups_partial")}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None: such a flag's help says what leaving it out means."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def _flag(tp) -> dict:
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
        if len(set(elems)) == 1:
            return {"type": elems[0], "nargs": len(elems)}
    if tp in (int, float, str):
        return {"type": tp}
    raise TypeError(f"no command-line form for a field of type {tp}")


def _nested() -> list[tuple[str, type, object]]:
    """(field name, config class, default instance) of each config ServerConfig nests."""
    from .state import ServerConfig

    hints = typing.get_type_hints(ServerConfig)
    return [(f.name, hints[f.name], f.default_factory()) for f in dataclasses.fields(ServerConfig)
            if dataclasses.is_dataclass(hints[f.name])]


def _config_flags(group, section: str, cls, default, choices: dict) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init or f.name == "seed" or f.name in NO_FLAG.get(section, ()):  # seed: one shared flag
            continue
        value = getattr(default, f.name)
        text = " ".join(x for x in (HELP.get(f.name), f"[{cls.__name__}.{f.name}]") if x)
        group.add_argument(f"--{f.name.replace('_', '-')}", dest=f"{section}.{f.name}", default=value,
                           metavar=None if f.name in choices else f.name.upper(), help=text,
                           choices=choices.get(f.name), **_flag(hints[f.name]))


def parser() -> argparse.ArgumentParser:
    from ..backends import ROLLOUT_BACKENDS
    from ..memory.config import PLANS
    from ..memory.fit import OPTIMIZER_OFFLOADS
    from ..parallel.fsdp import DTYPES
    from ..rl.algos import AGG_MODES, KL_KINDS, POLICY_LOSSES, SINGLETON_ADV
    from ..rl.config import ADV_ESTIMATORS, FILTER_GROUPS_METRICS, KL_CTRLS, LR_SCHEDULE_UNITS, LR_SCHEDULES, MODES
    from .state import KEEP_ALIVE_S

    ap = argparse.ArgumentParser(prog="python -m rollplex.server", description=__doc__.splitlines()[0],
                                 formatter_class=_HelpFormatter)
    ap.add_argument("--model", default=None, help="HF checkpoint dir, HF model id from the local cache, or preset "
                    "name (qwen2.5-vl-3b/7b/32b: RANDOM weights, for benchmarks only) (default: embedded tiny model)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on")
    ap.add_argument("--port", type=int, default=30000, help="port to listen on")
    ap.add_argument("--timeout-keep-alive", type=float, default=KEEP_ALIVE_S,
                    help="seconds an idle HTTP keep-alive connection stays open: a driver's pool of many connections "
                         "spends seconds of its own CPU between uses, and a connection the server closes meanwhile "
                         "fails its next request (uvicorn's default is 5)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                    help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--api-key", default=None,  # read after parsing: a default would print the key in --help
                    help="require 'Authorization: Bearer KEY' (default: $ROLLPLEX_API_KEY)")
    ap.add_argument("--reward", default="default", help="reward for /train_step without rewards (a built-in name, "
                    "module:function or FILE.py:function, imported at startup)")
    ap.add_argument("--reward-module", action="append", default=[], metavar="[NAME=]MODULE:FN",
                    help="register another reward /train_step requests may name (module:function or "
                    "FILE.py:function, imported at startup; under NAME when given); repeatable")
    ap.add_argument("--allow-client-reward-code", action="store_true",
                    help="let /train_step requests name module:function / FILE.py:function rewards, which the "
                    "server then imports and runs: only where every client may run code on this host")
    ap.add_argument("--media-root", default=None, help="requests may name local image / video files under this "
                    "folder (default: none; images come as base64 or data URLs)")
    ap.add_argument("--intake-threads", type=int, default=4,
                    help="threads that tokenise prompts and decode images, each with its own processor")
    ap.add_argument("--format-warmup-steps", type=int, default=0,
                    help="supervised answer-format steps on the shape-colour task at startup (tiny demo)")
    ap.add_argument("--rollout-ttl", type=float, default=600.0, help="seconds a training rollout is retained")
    ap.add_argument("--max-rollouts", type=int, default=16, help="retained rollouts (oldest evicted)")
    ap.add_argument("--checkpoint-root", default=None,
                    help="/save and /load only read and write under this folder (default: ./checkpoints)")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")
    nested = _nested()
    seeds = {default.seed for _, _, default in nested if hasattr(default, "seed")}
    assert len(seeds) == 1, "ServerConfig's nested defaults must agree on the seed --seed sets"
    ap.add_argument("--seed", type=int, default=seeds.pop(), help=HELP["seed"])
    choices = {"rl": {"mode": MODES, "adv_estimator": ADV_ESTIMATORS, "loss_agg_mode": AGG_MODES,
                      "kl_loss_type": KL_KINDS, "kl_penalty": KL_KINDS, "lr_schedule": LR_SCHEDULES,
                      "lr_schedule_unit": LR_SCHEDULE_UNITS, "kl_ctrl": KL_CTRLS, "policy_loss": POLICY_LOSSES,
                      "singleton_adv": SINGLETON_ADV, "filter_groups_metric": FILTER_GROUPS_METRICS},
               "memory": {"memory_plan": PLANS, "memory_backend": ("auto", "tms", "accounting"),
                          "optimizer_offload": OPTIMIZER_OFFLOADS},
               "backend": {"rollout_backend": ROLLOUT_BACKENDS},
               "fsdp": {"param_dtype": tuple(DTYPES), "reduce_dtype": tuple(DTYPES)}}
    titles = {"rl": "RL defaults (RLConfig; /train_step may override them per step)", "engine": "engine (EngineConfig)",
              "memory": "phase-aware memory (MemoryConfig)", "backend": "rollout backend (BackendConfig)",
              "fsdp": "FSDP2 training over a torchrun group (FSDPConfig; one process ignores it)",
              "limits": "request limits (ServerLimits): over them a request is 413 (body) or 400"}
    for section, cls, default in nested:
        _config_flags(ap.add_argument_group(titles.get(section, section)), section, cls, default,
                      choices.get(section, {}))
    return ap


def config_from_args(args):
    from .state import ServerConfig

    given = vars(args)
    nested = {}
    for section, cls, _ in _nested():
        kw = {}
        for f in dataclasses.fields(cls):
            if f.init and f.name not in NO_FLAG.get(section, ()):
                value = given["seed" if f.name == "seed" else f"{section}.{f.name}"]
                kw[f.name] = tuple(value) if isinstance(value, list) else value
        nested[section] = cls(**kw)
    api_key = args.api_key if args.api_key is not None else os.environ.get("ROLLPLEX_API_KEY")
    return ServerConfig(model=args.model, device=args.device, dtype=args.dtype, api_key=api_key,
                        reward=args.reward, reward_modules=tuple(args.reward_module),
                        allow_client_reward_code=args.allow_client_reward_code, media_root=args.media_root,
                        intake_threads=args.intake_threads, format_warmup_steps=args.format_warmup_steps,
                        rollout_ttl_s=args.rollout_ttl, max_rollouts=args.max_rollouts,
                        checkpoint_root=args.checkpoint_root, **nested)


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _join_group(cfg):
    """torchrun's process group for this rank (group.py), and the config with this rank's device."""
    from ..parallel.launch import init_from_env
    from .group import Commands, check_config

    check_config(cfg, _world_size())
    if cfg.device.startswith("cuda:"):
        raise ValueError("under torchrun every rank uses cuda:LOCAL_RANK: pass --device cuda")
    proc = init_from_env("cuda" if cfg.device == "cuda" else "cpu")
    if proc.device.type == "cuda":
        cfg = dataclasses.replace(cfg, device=str(proc.device))
    return cfg, Commands()


def _serve_group(app, host: str, port: int, log_level: str, keep_alive: float) -> None:
    """uvicorn.run for rank 0 of a group: ends on SIGINT/SIGTERM without re-raising the signal afterwards
    (uvicorn does, to die by it), so that rank 0 stops the other ranks and the group exits 0."""
    import uvicorn

    class GroupServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                try:
                    yield
                finally:
                    self._captured_signals.clear()

    server = GroupServer(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=keep_alive))
    server.run()
    if not server.started:
        raise SystemExit(f"rollplex.server: could not serve on {host}:{port}")


def main(argv=None) -> None:
    launched = time.perf_counter()  # the startup log counts the imports below from here
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvicorn

    from .app import create_app
    from .state import ServerState

    commands = None
    try:
        cfg = config_from_args(args)
        if _world_size() > 1:
            cfg, commands = _join_group(cfg)
        state = ServerState(cfg, launched=launched)
    except ValueError as e:
        raise SystemExit(f"rollplex.server: {e}") from None
    if commands is not None and commands.rank != 0:
        from .group import follow

        try:
            follow(state, commands)
        finally:
            state.close()
        commands.close()
        return
    logging.getLogger("rollplex.server").info(
        "serving %s on http://%s:%d (%s, %s, mode=%s, rollouts=%s, auth=%s%s)", state.model_path or cfg.model,
        args.host, args.port, cfg.device, cfg.dtype, cfg.rl.mode, cfg.backend.rollout_backend,
        "on" if cfg.api_key else "off",
        f", {commands.world} ranks" if commands is not None else "")
    try:
        if commands is None:
            uvicorn.run(create_app(state), host=args.host, port=args.port, log_level=args.log_level,
                        timeout_keep_alive=args.timeout_keep_alive)
        else:
            state.commands = commands
            _serve_group(create_app(state), args.host, args.port, args.log_level, args.timeout_keep_alive)
    finally:
        state.close()
        if commands is not None:
            commands.stop()
            commands.close()


if __name__ == "__main__":
    main()
