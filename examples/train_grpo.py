"""GRPO over the Rollplex server's HTTP API, OpenRLHF-style: one driver loop, the heavy lifting server-side.

    python examples/train_grpo.py                                   # the embedded demo (tiny model,
                                                                    #  shape-colour task, in-process server)
    python examples/train_grpo.py --server http://127.0.0.1:30000 --data train.parquet --steps 200 \\
        --rollout-batch-size 32 --n-samples 8 --save-dir ckpt --save-every 50

Per step:  POST /rollout   (a batch of verl rows x n samples; the server retains the rollout)
           POST /train_step (rewards scored server-side by `--reward`, default: dispatch on data_source)
and every K steps POST /save (the driver's data position rides along as `data_state`; --resume
loads it back; the server writes checkpoints only under its --checkpoint-root). Without --server
the driver starts `rollplex.server` in a background thread on a free loopback port and talks HTTP
to it all the same.

Data: verl rows (parquet or jsonl; `prompt`, `images`, `data_source`, `reward_model.ground_truth`);
without --data the shape-colour demo set is written to LOG_DIR/shape_color_train.jsonl. Batches
walk a seeded per-epoch permutation, so step k always sees the same prompts (and resume needs only k).
Outputs in LOG_DIR: metrics.jsonl (verl metric names, one line per step), TensorBoard events when
`torch.utils.tensorboard` imports, and reward.png (reward and throughput curves).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import sys
import time
from pathlib import Path

try:
    import rollplex  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
from tqdm import tqdm

from rollplex.data import load_rows, save_rows
from rollplex.plots import plot_rewards


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="HF dir / preset for the in-process server (default: tiny model)")
    ap.add_argument("--data", default=None, help="verl rows, .parquet or .jsonl (default: the shape-colour demo)")
    ap.add_argument("--server", default=None, help="URL of a running `python -m rollplex.server` (default: in-process)")
    ap.add_argument("--api-key", default=os.environ.get("ROLLPLEX_API_KEY"))
    ap.add_argument("--mode", choices=["rollplex", "serial"], default="rollplex", help="in-process server's mode")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="in-process server's device")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rollout-batch-size", type=int, default=32, help="prompts per step")
    ap.add_argument("--n-samples", type=int, default=16, help="samples per prompt (GRPO group size)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: 4 for the demo, else 256")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=None, help="default: 1e-3 for the demo, else the server's")
    ap.add_argument("--kl-coef", type=float, default=None, help="in-process: the server's KL coefficient")
    ap.add_argument("--reward", default="default", help="reward name or module:function (scored by the server)")
    ap.add_argument("--format-warmup-steps", type=int, default=None, help="in-process server; default: 30 for the"
                    " demo task, else 0")
    ap.add_argument("--target-reward", type=float, default=None, help="stop when the mean reward of the last 3"
                    " steps reaches it (default: 0.8 for the demo, else off)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-dir", default=None, help="checkpoints: SAVE_DIR/global_step_K; in-process: the server's"
                    " checkpoint root, with --server: a folder under that server's --checkpoint-root")
    ap.add_argument("--save-every", type=int, default=0, help="save every K steps (0: only at the end)")
    ap.add_argument("--resume", default=None, help="checkpoint dir to resume from (POST /load); in-process: under"
                    " --save-dir when given, with --server: under that server's --checkpoint-root")
    ap.add_argument("--log-dir", default="runs/train_grpo")
    ap.add_argument("--timeout", type=float, default=600.0, help="HTTP timeout per request (s)")
    args = ap.parse_args(argv)
    # the demo task's defaults follow the task, not where the server runs: `--server URL` against a server
    # started as the README says trains as the in-process demo does (the server's own lr is meant for real
    # models and leaves the tiny one flat)
    demo = args.model is None and args.data is None
    if args.max_new_tokens is None:
        args.max_new_tokens = 4 if demo else 256
    if args.lr is None and demo:
        args.lr = 1e-3
    if args.format_warmup_steps is None:
        args.format_warmup_steps = 30 if demo else 0  # the demo task's answer format: never on user data
    if args.target_reward is None and demo:
        args.target_reward = 0.8
    for name in ("steps", "rollout_batch_size", "n_samples", "max_new_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


# ---- data ---------------------------------------------------------------------------------------
def _b64_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_to_wire(x):
    """PIL image / verl {"bytes", "path"} / local path / bytes -> something the server can decode."""
    if hasattr(x, "save"):  # PIL
        buf = io.BytesIO()
        x.save(buf, format="PNG")
        return _b64_url(buf.getvalue())
    if isinstance(x, dict):
        if x.get("bytes") is not None:
            return _b64_url(bytes(x["bytes"]))
        return image_to_wire(x.get("path") or x.get("url"))
    if isinstance(x, (bytes, bytearray)):
        return _b64_url(bytes(x))
    if isinstance(x, str) and not x.startswith("data:") and len(x) < 4096 and os.path.isfile(x):
        return _b64_url(Path(x).read_bytes())  # the server may not share this filesystem
    return x


def row_to_wire(row: dict) -> dict:
    keep = {k: row[k] for k in ("prompt", "data_source", "reward_model", "extra_info") if row.get(k) is not None}
    if row.get("images"):
        keep["images"] = [image_to_wire(x) for x in row["images"]]
    if row.get("videos"):
        keep["videos"] = [[image_to_wire(f) for f in v] for v in row["videos"]]
    return json.loads(json.dumps(keep, default=str))  # numpy scalars & co. from parquet


def load_dataset(args) -> list[dict]:
    if args.data is None:
        from rollplex.demo import shape_color

        path = Path(args.log_dir) / "shape_color_train.jsonl"
        if not path.exists():
            save_rows(shape_color.make_rows(512, seed=args.seed), path)
        args.data = str(path)
    rows = load_rows(args.data)
    if not rows:
        raise SystemExit(f"{args.data}: no rows")
    return rows


def batch_indices(num_rows: int, step: int, batch_size: int, seed: int) -> list[int]:
    """Rows of step `step`: consecutive slices of a seeded permutation per epoch."""
    out, pos = [], step * batch_size
    while len(out) < batch_size:
        epoch, i = divmod(pos, num_rows)
        order = list(range(num_rows))
        random.Random(seed * 100_003 + epoch).shuffle(order)
        out.append(order[i])
        pos += 1
    return out


# ---- server -------------------------------------------------------------------------------------
class Client:
    def __init__(self, url: str, api_key: str | None, timeout: float):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=url, headers=headers, timeout=timeout)

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        r = self.http.request(method, path, json=body)
        if r.status_code >= 400:
            try:
                msg = r.json()["error"]["message"]
            except Exception:  # noqa: BLE001
                msg = r.text[:500]
            raise SystemExit(f"{method} {path} -> HTTP {r.status_code}: {msg}")
        return r.json()


def start_server(args):
    from rollplex.engine import EngineConfig
    from rollplex.rl.config import RLConfig
    from rollplex.server import ServerConfig, serve_in_thread

    rl = RLConfig(mode=args.mode, n=args.n_samples, lr=args.lr or 1e-6, kl_coef=args.kl_coef or 0.0,
                  temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=args.seed,
                  micro_batch_prompts=8, micro_batch_samples=32)
    # the server only saves and loads under its checkpoint root: the save dir, else the resumed run's folder
    root = args.save_dir or (str(Path(args.resume).resolve().parent) if args.resume else None)
    cfg = ServerConfig(model=args.model, device=args.device, api_key=args.api_key,
                       format_warmup_steps=args.format_warmup_steps, rl=rl, engine=EngineConfig(seed=args.seed),
                       checkpoint_root=root)
    return serve_in_thread(cfg)


def _tensorboard(log_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:  # noqa: BLE001 - optional
        return None
    return SummaryWriter(str(log_dir / "tb"))


def main(argv=None) -> dict:
    args = parse_args(argv)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = load_dataset(args)
    embedded = start_server(args) if args.server is None else None
    url = args.server or embedded.url
    client = Client(url, args.api_key, args.timeout)
    try:
        return _train(args, client, rows, log_dir)
    finally:
        client.http.close()
        if embedded is not None:
            embedded.stop()


def _train(args, client: Client, rows: list[dict], log_dir: Path) -> dict:
    health = client.call("GET", "/health")
    print(f"server {client.http.base_url}: {health['model']} ({health['device']}, mode={health['mode']}), "
          f"{len(rows)} rows from {args.data}", flush=True)
    start = 0
    if args.resume:
        resume = args.resume if args.server else str(Path(args.resume).resolve())  # in-process: from this cwd
        loaded = client.call("POST", "/load", {"path": resume})
        start = int((loaded.get("data_state") or {}).get("step", loaded["global_step"]))
        print(f"resumed from {args.resume} at step {start}", flush=True)
    overrides = {k: v for k, v in (("lr", args.lr), ("kl_coef", args.kl_coef)) if v is not None}
    tb = _tensorboard(log_dir)
    history: list[dict] = []
    saved = None
    metrics_path = log_dir / "metrics.jsonl"
    sp = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    bar = tqdm(range(start, args.steps), desc=f"GRPO ({health['mode']})", unit="step", initial=start,
               total=args.steps)
    with open(metrics_path, "a" if args.resume else "w") as log:
        for step in bar:
            t0 = time.perf_counter()
            batch = [row_to_wire(rows[i]) for i in batch_indices(len(rows), step, args.rollout_batch_size, args.seed)]
            ro = client.call("POST", "/rollout", {"prompts": batch, "n": args.n_samples, "sampling_params": sp})
            m = client.call("POST", "/train_step", {"rollout_id": ro["rollout_id"], "reward": args.reward, **overrides})
            m.update({"driver/step": step + 1, "timing_s/driver_step": time.perf_counter() - t0})
            history.append(m)
            log.write(json.dumps(m) + "\n")
            log.flush()
            if tb is not None:
                for k, v in m.items():
                    if isinstance(v, (int, float)):
                        tb.add_scalar(k, v, step + 1)
            recent = [h["critic/score/mean"] for h in history[-3:]]
            bar.set_postfix(reward=f"{m['critic/score/mean']:.2f}", avg3=f"{sum(recent) / len(recent):.2f}")
            if args.save_dir and args.save_every and (step + 1) % args.save_every == 0:
                saved = _save(client, args, step + 1)
            if args.target_reward is not None and len(recent) == 3 and sum(recent) / 3 >= args.target_reward:
                bar.write(f"target reward {args.target_reward} reached at step {step + 1}")
                break
    bar.close()
    if tb is not None:
        tb.close()
    done = start + len(history)
    if args.save_dir and history and (not args.save_every or done % args.save_every):
        saved = _save(client, args, done)
    png = plot_rewards(history, log_dir / "reward.png") if history else None
    summary = {"steps": len(history), "final_step": done, "metrics": str(metrics_path),
               "plot": str(png) if png else None, "checkpoint": saved}
    if history:
        last = [h["critic/score/mean"] for h in history[-3:]]
        summary.update(first_reward=history[0]["critic/score/mean"], last_reward=sum(last) / len(last))
        print(f"mean reward {summary['first_reward']:.2f} (first step) -> {summary['last_reward']:.2f} "
              f"(last {len(last)} steps); metrics: {metrics_path}" + (f", plot: {png}" if png else ""), flush=True)
    return summary


def _save(client: Client, args, step: int) -> str:
    """POST /save; returns the checkpoint's path on the server. In-process the save dir is the server's
    checkpoint root; a remote server takes SAVE_DIR relative to its own --checkpoint-root."""
    name = f"global_step_{step}"
    path = str(Path(args.save_dir) / name) if args.server else name
    saved = client.call("POST", "/save", {"path": path, "data_state": {"step": step, "seed": args.seed,
                                                                        "data": args.data}})
    return saved["path"]


if __name__ == "__main__":
    main()
