"""`python -m rollplex.server`: serve a policy for generation, rollouts and training steps over HTTP.

    python -m rollplex.server                                # the embedded tiny model, 127.0.0.1:30000
    python -m rollplex.server --model /ckpt/Qwen2.5-VL-3B-Instruct --api-key $KEY --n 8 --lr 1e-6
    python -m rollplex.server --model qwen2.5-vl-3b          # a preset: real shapes, RANDOM weights (benchmarks)

Flags fill ServerConfig (state.py: a rollplex.system.SystemConfig with the server's own settings): one
flag per field, its own and those of the configs it nests (RLConfig, EngineConfig, MemoryConfig, ...),
named after the field (`--kl-coef`, `--max-model-len`, `--no-packed`) by the generator all entry
points share (rollplex/cli.py), so a new config field is a new flag with nothing restated here (except
those in NO_FLAG, which mean nothing on a server). `--seed` seeds them all. Defaults are ServerConfig's.
One process per GPU; requests share one continuous batch.

Under torchrun (WORLD_SIZE > 1) every rank joins the default process group (NCCL on cuda:LOCAL_RANK,
gloo on CPU) and builds the same state; rank 0 serves HTTP on --host/--port and the others follow its
commands (group.py). When rank 0 stops (SIGINT, SIGTERM, or the server ending) it stops the others:

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m rollplex.server --model DIR
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time

# What a flag means on the server, where the field name alone does not say it (over rollplex.cli.HELP).
HELP = {
    "n": "samples per prompt in /rollout (GRPO group size)",
    "temperature": "default sampling temperature of /rollout",
    "top_p": "default top_p of /rollout",
    "max_new_tokens": "default for /generate and /rollout",
    "critic_warmup": "the first steps train the critic only (gae); not a /train_step override",
    "critic_model_path": "HF directory of the critic (gae; default: a copy of the policy and a fresh value head); "
                         "not a /train_step override",
    "kl_ctrl": "KL-in-reward coefficient: fixed (kl_coef) or adaptive (verl's controller, from kl_coef towards "
               "kl_target over kl_horizon samples); not a /train_step override",
    "lr_schedule_unit": "what advances the LR schedule: step (one train step, verl) or optimizer_step (each "
                        "mini-batch); not a /train_step override",
    "overlong_buffer_len": "DAPO's overlong reward shaping: the last tokens before max_new_tokens over which a "
                           "response loses up to overlong_penalty_factor from its score (0: off); applies to rewards "
                           "the server scores, against the rollout's max_new_tokens",
    "filter_groups": "DAPO's dynamic sampling: /train_step drops the groups whose samples all have the same "
                     "filter_groups_metric and trains the rest (the client refills its batches)",
    "filter_groups_metric": "seq_reward: the reward trained on (after overlong shaping); score: the reward "
                            "function's score before it (a client's rewards are both); or a key of the server's "
                            "reward function's dict, e.g. acc",
    "max_prompt_chars": "characters of one text prompt, checked before tokenising; default: 32 x --max-model-len",
    "max_image_pixels": "width x height of one image or video frame, read from its header before decoding",
    "api_key": "require 'Authorization: Bearer KEY' (default: $ROLLPLEX_API_KEY; an empty key is an error)",
    "max_samples": "prompts x n of one /generate or /rollout (bounds the answer's size)",
    "max_json_containers": "'[' + '{' bytes of a request body, counted before it is parsed (413 over it)",
    "header_timeout_s": "seconds a connection may take to send a request's headers (then it is closed)",
    "body_timeout_s": "seconds a request's body may take to arrive (408 after it)",
    "max_connections": "open HTTP connections; more are closed as they are accepted (default: half the "
                       "descriptor limit)",
    "reward": "reward for /train_step without rewards (a built-in name, module:function or FILE.py:function, "
              "imported at startup)",
    "reward_modules": "register another reward /train_step requests may name (module:function or "
                      "FILE.py:function, imported at startup; under NAME when given); repeatable",
    "allow_client_reward_code": "let /train_step requests name module:function / FILE.py:function rewards, which "
                                "the server then imports and runs: only where every client may run code on this host",
    "media_root": "requests may name local image / video files under this folder (default: none; images come as "
                  "base64 or data URLs)",
    "intake_threads": "threads that tokenise prompts and decode images, each with its own processor",
    "rollout_ttl_s": "seconds a training rollout is retained",
    "max_rollouts": "retained rollouts (oldest evicted)",
    "checkpoint_root": "/save and /load only read and write under this folder (default: ./checkpoints)",
}


# Config fields with no meaning on a server, so no flag: dynamic sampling's refill (a server rolls out no
# prompts of its own; its clients refill their batches), and the co-scheduler (not hosted: ServerConfig).
NO_FLAG = ("rl.max_num_gen_batches", "rl.filter_groups_partial", "cosched")


def server_estimator_help() -> str:
    """--adv-estimator's help on a server: every estimator (rl/algos.py), with what a server does for two."""
    from ..rl.algos import ADV_ESTIMATOR_HELP, describe

    return (describe(ADV_ESTIMATOR_HELP) + ". gae: the server builds a value model (/train_step may choose gae "
            "only on such a server); remax: /rollout returns each prompt's greedy response (`greedy`) and "
            "/train_step scores it or takes `greedy_rewards` (only on such a server)")


def parser():
    from ..cli import ConfigParser
    from .state import KEEP_ALIVE_S, ServerConfig

    ap = ConfigParser(ServerConfig, prog="python -m rollplex.server", description=__doc__.splitlines()[0],
                      skip=NO_FLAG, help={**HELP, "adv_estimator": server_estimator_help()},
                      flags={"rollout_ttl_s": "--rollout-ttl", "reward_modules": "--reward-module"},
                      kwargs={"reward_modules": {"action": "append", "type": str, "nargs": None,
                                                 "metavar": "[NAME=]MODULE:FN"},
                              # read after parsing: a default would print the key in --help
                              "api_key": {"metavar": "KEY"}},
                      titles={"rl": "RL defaults (RLConfig; /train_step may override them per step)"})
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on")
    ap.add_argument("--port", type=int, default=30000, help="port to listen on")
    ap.add_argument("--timeout-keep-alive", type=float, default=KEEP_ALIVE_S,
                    help="seconds an idle HTTP keep-alive connection stays open: a driver's pool of many connections "
                         "spends seconds of its own CPU between uses, and a connection the server closes meanwhile "
                         "fails its next request (uvicorn's default is 5)")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")
    return ap


def config_from_args(args):
    """The ServerConfig of flags parsed by `parser()`; the API key from $ROLLPLEX_API_KEY when not given."""
    from .app import check_api_key

    ap = parser()
    env = {} if "api_key" in ap.given(args) else {"api_key": os.environ.get("ROLLPLEX_API_KEY")}
    cfg = ap.config(args, **env)
    check_api_key(cfg.api_key)  # before the model loads
    return cfg


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


def _serve_group(app, host: str, port: int, log_level: str, keep_alive: float, limits) -> None:
    """uvicorn.run for rank 0 of a group: ends on SIGINT/SIGTERM without re-raising the signal afterwards
    (uvicorn does, to die by it), so that rank 0 stops the other ranks and the group exits 0."""
    import uvicorn

    from .http import uvicorn_options

    class GroupServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                try:
                    yield
                finally:
                    self._captured_signals.clear()

    server = GroupServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                        **uvicorn_options(limits, keep_alive)))
    server.run()
    if not server.started:
        raise SystemExit(f"rollplex.server: could not serve on {host}:{port}")


def main(argv=None) -> None:
    launched = time.perf_counter()  # the startup log counts the imports below from here
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvicorn

    from ..threads import apply_threads
    from .app import create_app
    from .http import uvicorn_options
    from .state import ServerState

    commands = None
    try:
        cfg = config_from_args(args)
        if _world_size() > 1:
            cfg, commands = _join_group(cfg)
        else:  # one process: the tiny model on the CPU runs on 1 thread unless $OMP_NUM_THREADS says (threads.py)
            logging.getLogger("rollplex.server").info("startup: %s", apply_threads(None, cfg.device,
                                                                                   tiny=cfg.model is None))
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
                        **uvicorn_options(cfg.limits, args.timeout_keep_alive))
        else:
            state.commands = commands
            _serve_group(create_app(state), args.host, args.port, args.log_level, args.timeout_keep_alive,
                         cfg.limits)
    finally:
        state.close()
        if commands is not None:
            commands.stop()
            commands.close()


if __name__ == "__main__":
    main()
    from ..parallel.launch import end_rank

    end_rank()
