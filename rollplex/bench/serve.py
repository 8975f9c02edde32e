"""`python -m rollplex.bench serve`: the served RL loop as a user runs it.

Starts `python -m rollplex.server` as a subprocess with the given server flags (defaults otherwise),
times it to ready, then runs `--rounds` rounds of `/rollout` (token-id prompts, ignore_eos, so every
sample decodes `--max-new-tokens`) followed by `/train_step` with random rewards, and reads `/memory`
after each phase. Any non-200 answer is reported and ends the run. Prints one JSON line per round and a
table; the server is stopped at the end.

    python -m rollplex.bench serve --model qwen2.5-vl-3b --server-args "--kl-coef 0.001"

The server is told the rounds' response length (`--max-new-tokens`, unless the server args give one): its
memory plan sizes the update's activations from it when the server starts, and a plan made for the
default 128 tokens under-counts a 512-token rollout's micro-batch 2.9x.

`--load` runs the load mode instead (serve_load.py: engine speed against concurrent and streamed
/generate clients, time to ready cold and warm): `python -m rollplex.bench serve --load --help`.
Both modes start the server with server_proc.py.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from . import serve_load
from .server_proc import server_command, start_server, stop_server, wait_ready

GiB = 2**30


def _phases(mem: dict) -> dict:
    manager = mem.get("manager") or {}
    # resident bytes only: /memory's per-phase peaks restart at every step's metrics (the step reports them)
    return {p: {"resident_gib": round(sum(r["resident_bytes"].values()) / GiB, 2)}
            for p, r in (manager.get("phases") or {}).items()}


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--load" in argv:
        argv.remove("--load")
        return serve_load.main(argv)
    ap = argparse.ArgumentParser(prog="python -m rollplex.bench serve")
    ap.add_argument("--load", action="store_true", help="run the load mode instead (its flags: --load --help)")
    ap.add_argument("--model", default=None, help="HF dir or preset (default: the embedded tiny model)")
    ap.add_argument("--server-args", default="", help="extra flags for python -m rollplex.server")
    ap.add_argument("--port", type=int, default=30123)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=352)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--token-range", default="1000,100000", help="prompt token ids are drawn from [lo, hi)")
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    ap.add_argument("--log", default=None, help="file for the server's output (default: inherit)")
    args = ap.parse_args(argv)
    import httpx

    url = f"http://127.0.0.1:{args.port}"
    cmd = server_command(args.model, args.port, plan_args(args.server_args, args.max_new_tokens))
    t0 = time.perf_counter()
    proc = start_server(cmd, args.log)
    rows = []
    try:
        ready_s = wait_ready(proc, url, args.ready_timeout, t0)
        print(json.dumps({"ready_s": round(ready_s, 1), "cmd": " ".join(cmd)}), flush=True)
        rng = random.Random(0)
        lo, hi = (int(x) for x in args.token_range.split(","))
        client = httpx.Client(base_url=url, timeout=3600)
        for r in range(args.rounds):
            prompts = [{"input_ids": [rng.randrange(lo, hi) for _ in range(args.prompt_len)]}
                       for _ in range(args.prompts)]
            t0 = time.perf_counter()
            ro = client.post("/rollout", json={"prompts": prompts, "n": args.n, "sampling_params": {
                "max_new_tokens": args.max_new_tokens, "ignore_eos": True, "temperature": 1.0}})
            gen_s = time.perf_counter() - t0
            row = {"round": r, "rollout_status": ro.status_code, "gen_s": round(gen_s, 2)}
            if ro.status_code != 200:
                row["error"] = ro.text[:500]
                rows.append(row)
                break
            body = ro.json()
            n_tok = args.prompts * args.n * args.max_new_tokens
            row["rollout_tok_s"] = round(n_tok / gen_s)
            mem_gen = _phases(client.get("/memory").json())
            num = body["num_samples"]
            t0 = time.perf_counter()
            tr = client.post("/train_step", json={"rollout_id": body["rollout_id"],
                                                  "rewards": [rng.random() for _ in range(num)]})
            row.update(train_status=tr.status_code, train_s=round(time.perf_counter() - t0, 2))
            if tr.status_code != 200:
                row["error"] = tr.text[:500]
                rows.append(row)
                break
            m = tr.json()
            mem = client.get("/memory").json()
            row.update({k: round(v, 3) for k, v in m.items() if k.startswith(("timing_s/", "memory/"))
                        and isinstance(v, float)})
            row["compiled_graphs"] = m.get("perf/compiled_graphs")
            row["phases"] = _phases(mem) or mem_gen
            row["cuda_max_allocated_gib"] = round((mem.get("cuda") or {}).get("max_allocated", 0) / GiB, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        stop_server(proc)
    # the update phase's peak as the step measured it (memory/update/peak_gib: CUDA's peak in the phase) and the
    # device segments its allocator requested and the host buffers it pinned for offloads (a first step's extra
    # time beyond compiling may be these)
    print(f"\n{'round':>5} {'rollout':>8} {'tok/s':>8} {'train':>6} {'train s':>8} {'step s':>7} {'upd peak GiB':>13} "
          f"{'transit s':>10} {'compile s':>10} {'upd mallocs':>12} {'host alloc s':>13}")
    for row in rows:
        upd = row.get("memory/update/peak_gib", float("nan"))
        step = row.get("timing_s/step", float("nan"))
        print(f"{row['round']:>5} {row['rollout_status']:>8} {row.get('rollout_tok_s', 0):>8} "
              f"{row.get('train_status', '-'):>6} {row.get('train_s', 0):>8} {step:>7} "
              f"{upd:>13} {row.get('memory/transition_s', float('nan')):>10} "
              f"{row.get('timing_s/compile', float('nan')):>10} "
              f"{row.get('memory/update/device_mallocs', float('nan')):>12} "
              f"{row.get('memory/host_alloc_s', float('nan')):>13}")
    if any(r.get("error") for r in rows):
        raise SystemExit(1)


def plan_args(server_args: str, max_new_tokens: int) -> str:
    """The server's flags with `--max-new-tokens` set to the rounds' length when they do not set it."""
    if "--max-new-tokens" in server_args.split() or any(a.startswith("--max-new-tokens=") for a in server_args.split()):
        return server_args
    return f"{server_args} --max-new-tokens {max_new_tokens}".strip()


if __name__ == "__main__":
    main()
