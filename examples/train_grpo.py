"""GRPO over the Rollplex server's HTTP API, OpenRLHF-style: one driver loop, the heavy lifting server-side.

    python examples/train_grpo.py                                   # the embedded demo (tiny model,
                                                                    #  shape-colour task, in-process server)
    python examples/train_grpo.py --server http://127.0.0.1:30000 --data train.parquet --steps 200 \\
        --rollout-batch-size 32 --n-samples 8 --save-dir ckpt --save-every 50 \\
        --val-data test.parquet --eval-every 10 --logger jsonl,tensorboard --experiment geo3k

Per step:  POST /rollout   (a batch of verl rows x n samples; the server retains the rollout)
           POST /train_step (rewards scored server-side by `--reward`, default: dispatch on data_source;
                            a server scores only rewards registered when it started)
           with --filter-groups (DAPO's dynamic sampling) the server trains only the groups whose
           samples' rewards differ; while it keeps fewer than --rollout-batch-size the driver rolls
           out the next batch and asks again with every rollout of the step (`more_rollout_ids`)
and every K steps POST /save (the driver's data position rides along as `data_state`; --resume
loads it back; the server writes checkpoints only under its --checkpoint-root). Without --server
the driver starts `rollplex.server` in a background thread on a free loopback port and talks HTTP
to it all the same.

Data: verl rows (parquet or jsonl; `prompt`, `images`, `data_source`, `reward_model.ground_truth`);
without --data the shape-colour demo set is written to LOG_DIR/shape_color_train.jsonl. Batches
walk a seeded per-epoch permutation, so step k always sees the same prompts (and resume needs only k).

Validation (verl's val_before_train, test_freq and val_kwargs): with --val-data the driver generates
for every validation row through /rollout (`for_training: false`: nothing is retained; --val-n
samples at --val-temperature, greedy by default), scores the answers itself with the same --reward,
and logs `val-core/{data_source}/reward/mean@{n}` and friends: before the first step, every
--eval-every steps and after the last one, with the metrics of the step they follow.

Logging (`--logger`, repeatable or a comma list: console, jsonl, tensorboard, wandb; rollplex/loggers.py)
into LOG_DIR (default runs/PROJECT/EXPERIMENT, EXPERIMENT defaulting to train_grpo-YYYYMMDD-HHMMSS: a new
folder per run): metrics.jsonl (one object per step, verl metric names and a `step` key), tensorboard/,
wandb/; and reward.png (reward and throughput curves; the reward panel is titled by the data's
data_source, with a chance line only on the shape-colour task, where 0.25 is a fact of the task). A
resumed run appends to the metrics of the folder it is given (`--experiment` / `--log-dir`).

An in-process server on the CPU first gets an estimate of one step's cost (rollplex/demo/progress.py):
a warning when a step will take minutes (a real-size --model, long --max-new-tokens).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

try:
    import rollplex  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
from tqdm import tqdm

from rollplex.data import load_rows, save_rows
from rollplex.demo.ending import Signals
from rollplex.demo.progress import log_mode
from rollplex.loggers import DEFAULT_NAMES as DEFAULT_LOGGERS
from rollplex.loggers import LoggerConfig, Tracker, resolve_run_dir
from rollplex.loggers import add_arguments as add_logger_arguments
from rollplex.loggers import parse_names as parse_logger_names
from rollplex.plots import plot_rewards, reward_labels
from rollplex.rl import algos
from rollplex.rl.rewards import get_reward_fn, score
from rollplex.threads import apply_threads


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None: such a flag's help says what leaving it out means."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=_HelpFormatter)
    ap.add_argument("--model", default=None, help="in-process server's model: HF checkpoint dir, HF model id from "
                    "the local cache, or preset name (random weights: for benchmarks only) (default: the tiny "
                    "demo model)")
    ap.add_argument("--data", default=None, help="verl rows, .parquet or .jsonl (default: the shape-colour demo)")
    ap.add_argument("--server", default=None, help="URL of a running `python -m rollplex.server` (default: in-process)")
    ap.add_argument("--api-key", default=None, help="the server's API key (default: $ROLLPLEX_API_KEY)")
    ap.add_argument("--mode", choices=["rollplex", "serial"], default="rollplex", help="in-process server's mode")
    ap.add_argument("--rollout-backend", choices=["native", "sglang"], default=None,
                    help="in-process server's rollout backend; sglang needs `pip install 'rollplex[sglang]'` and "
                    "CUDA (default: native; with --server the server's own --rollout-backend applies)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="in-process server's device "
                    "(default: cuda if available)")
    ap.add_argument("--steps", type=int, default=300, help="training steps")
    ap.add_argument("--rollout-batch-size", type=int, default=32, help="prompts per step")
    ap.add_argument("--n-samples", type=int, default=16, help="samples per prompt (GRPO group size)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="response length, also in validation "
                    "(default: 4 for the demo, else 256)")
    ap.add_argument("--temperature", type=float, default=1.0, help="rollout sampling temperature")
    ap.add_argument("--lr", type=float, default=None, help="default: 1e-3 for the demo, else the server's")
    ap.add_argument("--kl-coef", type=float, default=None, help="KL coefficient (default: the server's)")
    ap.add_argument("--adv-estimator", default=None, choices=algos.ADV_ESTIMATORS,
                    help=algos.describe(algos.ADV_ESTIMATOR_HELP) + ". Sent with each /train_step (default: the "
                    "server's; dr_grpo with loss aggregation "
                    "seq-mean-token-sum-norm unless --loss-agg-mode says otherwise); gae and remax need a server "
                    "started with them (the in-process one is)")
    ap.add_argument("--critic-lr", type=float, default=None, help="gae: the critic's lr (default: the server's; the "
                    "in-process server's: --lr)")
    ap.add_argument("--critic-warmup", type=int, default=0, help="gae: the first steps train the critic only "
                    "(in-process server only: a startup setting)")
    ap.add_argument("--gamma", type=float, default=None, help="discount of gae's / reinforce_plus_plus's per-token "
                    "return (default: the server's)")
    ap.add_argument("--lam", type=float, default=None, help="gae's lambda (default: the server's)")
    ap.add_argument("--policy-loss", default=None, choices=algos.POLICY_LOSSES,
                    help=algos.describe(algos.POLICY_LOSS_HELP) + " (default: the server's)")
    ap.add_argument("--loss-agg-mode", default=None, choices=algos.AGG_MODES,
                    help=algos.describe(algos.AGG_MODE_HELP) + " (default: the server's)")
    ap.add_argument("--clip-ratio-low", type=float, default=None, help="PPO clip range below 1 (default: the server's)")
    ap.add_argument("--clip-ratio-high", type=float, default=None, help="PPO clip range above 1; DAPO's clip-higher: "
                    "0.28 (default: the server's)")
    ap.add_argument("--use-kl-loss", action=argparse.BooleanOptionalAction, default=None,
                    help="KL term in the loss, or (--no-use-kl-loss) a KL penalty in the reward (default: the "
                    "server's)")
    ap.add_argument("--overlong-buffer-len", type=int, default=None, help="DAPO's overlong reward shaping of the "
                    "rewards the server scores: the last tokens before --max-new-tokens over which a response loses "
                    "up to --overlong-penalty-factor (0: off; default: the server's)")
    ap.add_argument("--overlong-penalty-factor", type=float, default=None, help="the overlong penalty at "
                    "--max-new-tokens (default: the server's)")
    ap.add_argument("--filter-groups", action="store_true",
                    help="DAPO's dynamic sampling: the server keeps only the groups whose samples' rewards differ, "
                    "and the driver rolls out further batches into the same step until it keeps "
                    "--rollout-batch-size of them")
    ap.add_argument("--max-num-gen-batches", type=int, default=10, help="rollouts per step at most with "
                    "--filter-groups, then the run stops (0: unbounded; at most the server's --max-rollouts)")
    ap.add_argument("--reward", default="default", help="reward name or module:function (scored by the server in "
                    "training, by this driver in validation); the in-process server registers it, a --server must "
                    "have it registered (its --reward or --reward-module)")
    ap.add_argument("--format-warmup-steps", type=int, default=None, help="in-process server; default: 30 for the"
                    " demo task, else 0")
    ap.add_argument("--target-reward", type=float, default=None, help="stop when the mean reward of the last 3"
                    " steps reaches it (default: 0.8 for the demo, else off)")
    ap.add_argument("--seed", type=int, default=0, help="data order, sampling and the in-process server")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads of this process (and its in-process "
                    "server); default: $OMP_NUM_THREADS if set, else 1 for the tiny model on the CPU, else torch's "
                    "(rollplex/threads.py)")
    ap.add_argument("--save-dir", default=None, help="checkpoints: SAVE_DIR/global_step_K; in-process: the server's"
                    " checkpoint root, with --server: a folder under that server's --checkpoint-root")
    ap.add_argument("--save-every", type=int, default=0, help="save every K steps (0: only at the end)")
    ap.add_argument("--resume", default=None, help="checkpoint dir to resume from (POST /load); in-process: under"
                    " --save-dir when given, with --server: under that server's --checkpoint-root")
    ap.add_argument("--timeout", type=float, default=600.0, help="HTTP timeout per request (s)")
    val = ap.add_argument_group("validation (verl's val_kwargs, test_freq, val_before_train)")
    val.add_argument("--val-data", default=None, help="validation rows, .parquet or .jsonl (default: none; the "
                     "demo task with --eval-every writes its own)")
    val.add_argument("--eval-every", type=int, default=0, help="validate every N steps and after the last one "
                     "(0: no periodic validation)")
    val.add_argument("--val-before-train", action=argparse.BooleanOptionalAction, default=True,
                     help="validate before the first step (logged as that step, 0 on a fresh run)")
    val.add_argument("--val-n", type=int, default=1, help="samples per validation prompt")
    val.add_argument("--val-temperature", type=float, default=0.0, help="validation temperature (0: greedy)")
    val.add_argument("--val-batch-size", type=int, default=256, help="validation prompts per /rollout request")
    add_logger_arguments(ap, experiment="train_grpo")
    args = ap.parse_args(argv)
    if args.api_key is None:
        args.api_key = os.environ.get("ROLLPLEX_API_KEY")
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
    args.replaced = resolve_run_dir(args, "train_grpo")  # an earlier run's files in an explicit folder
    for name in ("steps", "rollout_batch_size", "n_samples", "max_new_tokens", "val_n", "val_batch_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.eval_every < 0 or args.max_num_gen_batches < 0:
        ap.error("--eval-every and --max-num-gen-batches must be >= 0")
    if not 0.0 <= args.val_temperature <= 100.0:
        ap.error("--val-temperature must be in [0, 100]")
    if args.eval_every and args.val_data is None and not demo:
        ap.error("--eval-every needs --val-data")
    if args.server and args.rollout_backend:
        ap.error("--rollout-backend sets the in-process server's backend; start the server at --server with it")
    try:
        args.logger = list(parse_logger_names(args.logger or DEFAULT_LOGGERS))
    except ValueError as e:
        ap.error(str(e))
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
        from rollplex.tiny import shape_color

        path = Path(args.log_dir) / "shape_color_train.jsonl"
        if not path.exists():
            save_rows(shape_color.make_rows(512, seed=args.seed), path)
        args.data = str(path)
    rows = load_rows(args.data)
    if not rows:
        raise SystemExit(f"{args.data}: no rows")
    return rows


def load_val_dataset(args) -> list[dict]:
    """The validation rows on the wire (encoded once), or [] without validation. The demo task with
    --eval-every and no --val-data validates on its own held-out rows (the "test" split)."""
    if args.val_data is None and args.eval_every:  # parse_args allows this only for the demo task
        from rollplex.tiny import shape_color

        path = Path(args.log_dir) / "shape_color_val.jsonl"
        if not path.exists():
            save_rows(shape_color.make_rows(64, seed=args.seed, split="test"), path)
        args.val_data = str(path)
    if args.val_data is None:
        return []
    rows = load_rows(args.val_data)
    if not rows:
        raise SystemExit(f"{args.val_data}: no rows")
    return [row_to_wire(r) for r in rows]


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

    def call(self, method: str, path: str, body: dict | None = None, tolerate: str | None = None) -> dict | None:
        """The answer; SystemExit on an error, except a 400 whose message starts with `tolerate`: None."""
        r = self.http.request(method, path, json=body)
        if r.status_code >= 400:
            try:
                msg = r.json()["error"]["message"]
            except Exception:  # noqa: BLE001
                msg = r.text[:500]
            if tolerate is not None and r.status_code == 400 and msg.startswith(tolerate):
                return None
            raise SystemExit(f"{method} {path} -> HTTP {r.status_code}: {msg}")
        return r.json()


def start_server(args):
    from rollplex.backends import BackendConfig
    from rollplex.engine import EngineConfig
    from rollplex.rl.config import RLConfig
    from rollplex.server import ServerConfig, serve_in_thread

    # PPO with a critic needs a server that builds one: the in-process server does when asked for gae
    critic = dict(adv_estimator="gae", critic_lr=args.critic_lr or args.lr or 1e-6,
                  critic_warmup=args.critic_warmup) if args.adv_estimator == "gae" else {}
    if args.adv_estimator == "remax":  # the server's /rollout then returns each prompt's greedy response
        critic = dict(adv_estimator="remax")
    try:
        rl = RLConfig(mode=args.mode, n=args.n_samples, lr=args.lr or 1e-6, kl_coef=args.kl_coef or 0.0,
                      temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=args.seed,
                      micro_batch_prompts=8, micro_batch_samples=32, **critic)
    except ValueError as e:
        raise SystemExit(f"train_grpo: {e}") from None
    # the server only saves and loads under its checkpoint root: the save dir, else the resumed run's folder
    root = args.save_dir or (str(Path(args.resume).resolve().parent) if args.resume else None)
    backend = BackendConfig(rollout_backend=args.rollout_backend or "native")
    try:  # a missing SGLang (--rollout-backend sglang) fails here, before a model is loaded
        cfg = ServerConfig(model=args.model, device=args.device, api_key=args.api_key, reward=args.reward,
                           format_warmup_steps=args.format_warmup_steps, rl=rl, engine=EngineConfig(seed=args.seed),
                           checkpoint_root=root, backend=backend)
        return serve_in_thread(cfg)
    except ValueError as e:
        raise SystemExit(f"train_grpo: {e}") from None


def _warn_cpu_cost(args, embedded, rows: list[dict]) -> None:
    """Print the CPU cost warning for an in-process server on the CPU whose step will take minutes."""
    from rollplex.data import row_to_inputs
    from rollplex.demo.progress import cpu_cost_warning, decoder_params

    state = embedded.state
    if str(state.cfg.device).split(":")[0] != "cpu" or state.processor is None:
        return
    try:
        prompt_tokens = len(row_to_inputs(state.processor, rows[0]).input_ids)
    except (ValueError, OSError):  # a malformed row or a missing image: /rollout says so with its index
        return
    warning = cpu_cost_warning(decoder_params(state.rl.model), prompt_tokens, args.rollout_batch_size,
                               args.n_samples, args.max_new_tokens, args.mode, ref=bool(args.kl_coef))
    if warning:
        print(warning, flush=True)


# ---- validation ---------------------------------------------------------------------------------
def validate(client: Client, args, val_rows: list[dict]) -> dict:
    """Generate for every validation row (`--val-n` samples at `--val-temperature`, through /rollout
    without retaining anything), score the answers with `--reward` here in the driver, and return
    verl's validation metrics plus `timing_s/testing`."""
    t0 = time.perf_counter()
    try:
        fn = get_reward_fn(args.reward)
    except ValueError as e:
        raise SystemExit(f"validation: {e}") from None
    samples: list[tuple[str, int, dict[str, float]]] = []
    for lo in range(0, len(val_rows), args.val_batch_size):
        chunk = val_rows[lo:lo + args.val_batch_size]
        sp = {"max_new_tokens": args.max_new_tokens, "temperature": args.val_temperature,
              "seed": args.seed + lo * args.val_n}  # fixed across evaluations, so only the weights differ
        ro = client.call("POST", "/rollout", {"prompts": chunk, "n": args.val_n, "sampling_params": sp,
                                              "for_training": False})
        for s in ro["samples"]:
            i = s["prompt_index"]
            row = chunk[i]
            try:
                value, extra = score(fn, row.get("data_source"), s["text"],
                                     (row.get("reward_model") or {}).get("ground_truth"), row.get("extra_info"))
            except Exception as e:  # noqa: BLE001 - the reward function's or the data's problem: say which row
                raise SystemExit(f"validation: reward {args.reward!r} failed on {args.val_data} row {lo + i}: "
                                 f"{type(e).__name__}: {e}") from e
            samples.append((row.get("data_source") or "unknown", lo + i, {"reward": value, **extra}))
    return {**validation_metrics(samples), "timing_s/testing": time.perf_counter() - t0}


def _expected_max(values: list[float], draws: int) -> float:
    """E[max of `draws` draws with replacement from `values`]: what verl's best@N bootstrap estimates."""
    v, k = sorted(values), len(values)
    return sum(x * ((i / k) ** draws - ((i - 1) / k) ** draws) for i, x in enumerate(v, start=1))


def validation_metrics(samples: list[tuple[str, int, dict[str, float]]]) -> dict[str, float]:
    """verl's validation metrics from (data_source, prompt id, {variable: value}) per sample.

    Per data source and variable (`reward`, and any extra keys the reward function returns), averaged
    over prompts: `mean@N` (N: samples per prompt) and, for N > 1, `std@N`, `best@N/mean` and
    `worst@N/mean` (expected max / min of N draws from the prompt's samples, exact where verl
    bootstraps). The core variable (`acc` when the reward returns it, else `reward`) is logged as
    `val-core/{data_source}/{var}/mean@N` (and best@N), everything else under `val-aux/`.
    """
    groups: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))  # source -> var -> prompt -> values
    for source, uid, values in samples:
        for var, value in values.items():
            groups[source][var][uid].append(float(value))
    out: dict[str, float] = {}
    for source, by_var in groups.items():
        core = "acc" if "acc" in by_var else "reward"
        for var, by_prompt in by_var.items():
            per_prompt = list(by_prompt.values())
            n = max(len(v) for v in per_prompt)
            head, aux = f"{'val-core' if var == core else 'val-aux'}/{source}/{var}", f"val-aux/{source}/{var}"
            out[f"{head}/mean@{n}"] = statistics.fmean(statistics.fmean(v) for v in per_prompt)
            if n > 1:
                out[f"{aux}/std@{n}"] = statistics.fmean(statistics.pstdev(v) for v in per_prompt)
                out[f"{head}/best@{n}/mean"] = statistics.fmean(_expected_max(v, len(v)) for v in per_prompt)
                out[f"{aux}/worst@{n}/mean"] = statistics.fmean(-_expected_max([-x for x in v], len(v))
                                                                for v in per_prompt)
    return out


# ---- training -----------------------------------------------------------------------------------
def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _threads(n: int | None = None) -> int:
    """torch's intra-op threads (set to `n` first when given)."""
    import torch

    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.replaced and not args.resume:
        print(f"note: {args.log_dir} holds an earlier run; replacing "
              f"{', '.join(Path(f).name for f in args.replaced)}", flush=True)
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    rows = load_dataset(args)
    val_rows = load_val_dataset(args)
    device = args.device or ("cuda" if args.server is None and _cuda() else "cpu")
    threads_before = _threads()
    try:
        print(apply_threads(args.threads, device, tiny=args.model is None), flush=True)
    except ValueError as e:
        raise SystemExit(f"train_grpo.py: {e}") from None
    # the loggers first: a missing optional package fails before the server loads a model
    tracker = Tracker(LoggerConfig.from_args(args, append=bool(args.resume)))
    embedded = None
    try:
        embedded = start_server(args) if args.server is None else None
        if embedded is not None:
            _warn_cpu_cost(args, embedded, rows)
        client = Client(args.server or embedded.url, args.api_key, args.timeout)
        try:
            return _train(args, client, rows, val_rows, tracker)
        finally:
            client.http.close()
    finally:
        tracker.close()
        if embedded is not None:
            embedded.stop()
        _threads(threads_before)  # a caller in the same process (a test) keeps its own


def _train(args, client: Client, rows: list[dict], val_rows: list[dict], tracker: Tracker) -> dict:
    health = client.call("GET", "/health")
    print(f"server {client.http.base_url}: {health['model']} ({health['device']}, mode={health['mode']}, "
          f"rollouts={health.get('rollout_backend', 'native')}), "
          f"{len(rows)} rows from {args.data}" + (f", {len(val_rows)} validation rows" if val_rows else ""),
          flush=True)
    start = pos = 0  # pos: batches of the data consumed (more than steps with --filter-groups)
    if args.resume:
        resume = args.resume if args.server else str(Path(args.resume).resolve())  # in-process: from this cwd
        loaded = client.call("POST", "/load", {"path": resume})
        start = int((loaded.get("data_state") or {}).get("step", loaded["global_step"]))
        pos = int((loaded.get("data_state") or {}).get("batch", start))
        print(f"resumed from {args.resume} at step {start}", flush=True)
    if args.adv_estimator == "dr_grpo" and args.loss_agg_mode is None:
        args.loss_agg_mode = "seq-mean-token-sum-norm"  # Dr.GRPO's aggregation
    names = ("lr", "kl_coef", "adv_estimator", "policy_loss", "loss_agg_mode", "clip_ratio_low", "clip_ratio_high",
             "use_kl_loss", "overlong_buffer_len", "overlong_penalty_factor", "critic_lr", "gamma", "lam")
    overrides = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if args.filter_groups:
        overrides["filter_groups"] = True
    history: list[dict] = []
    val: dict = {}
    saved = None
    sp = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    if val_rows and args.val_before_train:
        val = validate(client, args, val_rows)
        tracker.log(val, start)
        print(_val_line(start, val), flush=True)
    lines = log_mode(sys.stdout)  # a log file: a line per step instead of the bar's frames
    bar = tqdm(range(start, args.steps), desc=f"GRPO ({health['mode']})", unit="step", initial=start,
               total=args.steps, disable=lines)
    signals, stopped = Signals(), None

    def steps():
        nonlocal pos, saved, val
        for step in bar:
            t0 = time.perf_counter()
            ids: list[str] = []  # this step's rollouts: more than one when --filter-groups refills the batch
            while True:
                order = batch_indices(len(rows), pos, args.rollout_batch_size, args.seed)
                batch = [row_to_wire(rows[i]) for i in order]
                pos += 1
                ro = client.call("POST", "/rollout", {"prompts": batch, "n": args.n_samples, "sampling_params": sp})
                ids.append(ro["rollout_id"])
                body = {"rollout_id": ids[0], "reward": args.reward, **overrides}
                if args.filter_groups:
                    body.update(more_rollout_ids=ids[1:], train_batch_size=args.rollout_batch_size)
                refill = args.filter_groups and (not args.max_num_gen_batches or len(ids) < args.max_num_gen_batches)
                # the server asks for more groups with a 400 starting "filter_groups:"; at the bound it ends the run
                m = client.call("POST", "/train_step", body, tolerate="filter_groups:" if refill else None)
                if m is not None:
                    break
            m["timing_s/driver_step"] = time.perf_counter() - t0
            history.append(m)
            recent = [h["critic/score/mean"] for h in history[-3:]]
            bar.set_postfix(reward=f"{m['critic/score/mean']:.2f}", avg3=f"{sum(recent) / len(recent):.2f}")
            if lines:
                print(f"step {step + 1}/{args.steps}: reward {m['critic/score/mean']:.2f}, avg3 "
                      f"{sum(recent) / len(recent):.2f}, {m['timing_s/driver_step']:.1f}s", flush=True)
            reached = args.target_reward is not None and len(recent) == 3 and sum(recent) / 3 >= args.target_reward
            last = reached or step + 1 == args.steps
            if val_rows and args.eval_every and ((step + 1) % args.eval_every == 0 or last):
                val = validate(client, args, val_rows)  # logged with the step it follows, as verl does
                m.update(val)
                bar.write(_val_line(step + 1, val))
            tracker.log(m, step + 1)
            if args.save_dir and args.save_every and (step + 1) % args.save_every == 0:
                saved = _save(client, args, step + 1, pos)
            if reached:
                bar.write(f"target reward {args.target_reward} reached at step {step + 1}")
                break

    with signals:  # Ctrl-C or SIGTERM: stop where the run is, then save, plot and summarise as at its end
        try:
            steps()
        except KeyboardInterrupt:
            stopped = signals.name
    bar.close()
    if stopped is not None:
        print(f"\nstopped by {stopped} after {len(history)} steps; writing the run's files", flush=True)
    with signals.ignored():
        summary = _finish(args, client, rows, history, start, pos, saved, val)
    if stopped is not None:
        raise SystemExit(signals.exit_code)
    return summary


def _finish(args, client, rows, history, start, pos, saved, val) -> dict:
    """The last checkpoint (with --save-dir), the reward plot (with the target and the 3-step mean) and the
    summary, at the run's end or when it is stopped."""
    done = start + len(history)
    if args.save_dir and history and (not args.save_every or done % args.save_every):
        saved = _save(client, args, done, pos)
    log_dir = Path(args.log_dir)
    title, chance = reward_labels(r.get("data_source") for r in rows)
    png = plot_rewards(history, log_dir / "reward.png", title, chance, target=args.target_reward, window=3) \
        if history else None
    metrics_path = log_dir / "metrics.jsonl" if "jsonl" in args.logger else None
    summary = {"steps": len(history), "final_step": done, "log_dir": str(log_dir),
               "metrics": str(metrics_path) if metrics_path else None, "plot": str(png) if png else None,
               "checkpoint": saved, "val": val}
    if history:
        last3 = [h["critic/score/mean"] for h in history[-3:]]
        summary.update(first_reward=history[0]["critic/score/mean"], last_reward=sum(last3) / len(last3))
        print(f"mean reward {summary['first_reward']:.2f} (first step) -> {summary['last_reward']:.2f} "
              f"(last {len(last3)} steps); logs: {log_dir}" + (f", plot: {png}" if png else ""), flush=True)
    return summary


def _val_line(step: int, val: dict) -> str:
    core = ", ".join(f"{k.removeprefix('val-core/')} {v:.3f}" for k, v in val.items() if k.startswith("val-core/"))
    return f"validation at step {step}: {core} ({val['timing_s/testing']:.1f}s)"


def _save(client: Client, args, step: int, pos: int) -> str:
    """POST /save; returns the checkpoint's path on the server. In-process the save dir is the server's
    checkpoint root; a remote server takes SAVE_DIR relative to its own --checkpoint-root. A resumed run
    retrains the steps after its checkpoint and replaces theirs; a fresh one does not overwrite another
    run's (the server answers 409)."""
    name = f"global_step_{step}"
    path = str(Path(args.save_dir) / name) if args.server else name
    saved = client.call("POST", "/save", {"path": path, "data_state": {"step": step, "batch": pos, "seed": args.seed,
                                                                        "data": args.data},
                                          "overwrite": bool(args.resume)})
    return saved["path"]


if __name__ == "__main__":
    main()
