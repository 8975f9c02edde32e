"""`python -m rollplex.server`: serve a policy for generation, rollouts and training steps over HTTP.

    python -m rollplex.server                                # the embedded tiny model, 127.0.0.1:30000
    python -m rollplex.server --model /ckpt/Qwen2.5-VL-3B-Instruct --api-key $KEY --n 8 --lr 1e-6

Flags map onto ServerConfig (state.py). One process per GPU; requests share one continuous batch.
"""

from __future__ import annotations

import argparse
import logging
import os


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m rollplex.server", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF checkpoint dir or preset name (default: embedded tiny model)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                    help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--mode", choices=["rollplex", "serial"], default="rollplex")
    ap.add_argument("--api-key", default=os.environ.get("ROLLPLEX_API_KEY"),
                    help="require 'Authorization: Bearer KEY' (default: $ROLLPLEX_API_KEY)")
    rl = ap.add_argument_group("RL defaults (per-step overrides in /train_step)")
    rl.add_argument("--n", type=int, default=8, help="samples per prompt in /rollout")
    rl.add_argument("--lr", type=float, default=1e-6)
    rl.add_argument("--kl-coef", type=float, default=0.0, help="> 0 keeps a frozen reference model")
    rl.add_argument("--temperature", type=float, default=1.0)
    rl.add_argument("--max-new-tokens", type=int, default=128, help="default for /generate and /rollout")
    rl.add_argument("--reward", default="default", help="reward for /train_step without rewards (name or module:fn)")
    rl.add_argument("--micro-batch-prompts", type=int, default=4)
    rl.add_argument("--micro-batch-samples", type=int, default=8)
    rl.add_argument("--micro-batch-max-tokens", type=int, default=None,
                    help="token budget per forward/backward instead of the two counts (verl's dynamic batch size)")
    rl.add_argument("--seed", type=int, default=0)
    rl.add_argument("--format-warmup-steps", type=int, default=0,
                    help="supervised answer-format steps on the shape-colour task at startup (tiny demo)")
    eng = ap.add_argument_group("engine and retention")
    eng.add_argument("--max-model-len", type=int, default=4096)
    eng.add_argument("--max-num-seqs", type=int, default=256)
    eng.add_argument("--kv-cache-tokens", type=int, default=None, help="default: 65536 on CPU, profiled on GPU")
    eng.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    eng.add_argument("--rollout-ttl", type=float, default=600.0, help="seconds a training rollout is retained")
    eng.add_argument("--max-rollouts", type=int, default=16, help="retained rollouts (oldest evicted)")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return ap


def config_from_args(args):
    from .state import ServerConfig

    return ServerConfig(
        model=args.model, device=args.device, dtype=args.dtype, mode=args.mode, api_key=args.api_key, n=args.n,
        lr=args.lr, kl_coef=args.kl_coef, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
        reward=args.reward, micro_batch_prompts=args.micro_batch_prompts,
        micro_batch_samples=args.micro_batch_samples, micro_batch_max_tokens=args.micro_batch_max_tokens,
        seed=args.seed, format_warmup_steps=args.format_warmup_steps,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, kv_cache_tokens=args.kv_cache_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, rollout_ttl_s=args.rollout_ttl,
        max_rollouts=args.max_rollouts)


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvicorn

    from .app import create_app
    from .state import ServerState

    try:
        cfg = config_from_args(args)
        state = ServerState(cfg)
    except ValueError as e:
        raise SystemExit(f"rollplex.server: {e}") from None
    logging.getLogger("rollplex.server").info("serving %s on http://%s:%d (%s, %s, mode=%s, auth=%s)",
                                              state.model_path or cfg.model, args.host, args.port, cfg.device,
                                              cfg.dtype, cfg.mode, "on" if cfg.api_key else "off")
    try:
        uvicorn.run(create_app(state), host=args.host, port=args.port, log_level=args.log_level)
    finally:
        state.close()


if __name__ == "__main__":
    main()
