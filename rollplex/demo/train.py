"""`python -m rollplex.demo`: GRPO teaches the embedded tiny Qwen2.5-VL to read colours.

1. Write / load the tiny random-init checkpoint (it knows no language yet).
2. Format warm-up: a few supervised steps on *randomly labelled* answers teach it to reply with one
   option letter and stop — it learns the format, not the answer: its first GRPO step scores 0.14–0.20
   (seeds 0–2), below chance (0.25), as some answers are not yet one clean letter.
3. GRPO with the native engine (shared weights), shared-prefix scoring and training until the mean
   reward of 3 steps reaches the target; a progress bar (in a log: a line per step); a reward curve PNG
   with the target and that mean, and LOG_DIR/summary.json, at the end.

Each run writes into its own folder, LOG_DIR: runs/PROJECT/EXPERIMENT, EXPERIMENT defaulting to
demo-YYYYMMDD-HHMMSS (loggers.resolve_run_dir), so a run never replaces the one before. Metrics (verl
names) go to the loggers chosen with `--logger` (rollplex/loggers.py; default: jsonl, i.e.
LOG_DIR/metrics.jsonl), the reward curve to LOG_DIR/reward.png.

On the CPU the demo first estimates a step's cost from the model's size and the step's tokens and
warns when a step will take minutes (a real-size `--model`); with `--progress` (default: on when
stdout is a terminal) it reports inside each step: the rollout's tokens and finished samples, the
update's micro-batches (demo/progress.py).

The policy, its format warm-up, the engine and the RL step are assembled by rollplex.system.build; the
options are flags generated from SystemConfig (rollplex/cli.py) with the demo's defaults (DEFAULTS), so
they are the server's and the benchmarks' flags; `--warmup-steps` is the format warm-up's here.

PPO with a critic (`--adv-estimator gae`, rl/critic.py): a value model copied from the warmed-up policy
is trained beside it (`--critic-lr`, default 1e-3 as the actor's `--lr`; `--critic-warmup`, `--gamma`,
`--lam`).

RLOO, REINFORCE++ and Dr.GRPO train with a KL loss to the format-warmed reference (`--kl-coef 0.1`;
REINFORCE++ also `--lr 1.5e-3`, Dr.GRPO 4 mini-batches per rollout) unless those flags are given
(`RUN_DEFAULTS`, said at the start of a run): their advantages are not divided by each group's reward spread
as GRPO's are, and without it the policy's entropy collapsed before the model had learnt the task. DAPO
(`--filter-groups`, `--clip-ratio-high 0.28`; rl/config.py): a step rolls out more prompts until it holds
--prompts groups whose samples' rewards differ (`train/num_gen_batches`). It trains in 4 mini-batches per
rollout (`--ppo-mini-batches 4`) unless told: with one, every update is on-policy, the clip-higher clips
nothing and the entropy collapsed. Its overlong shaping (`--overlong-buffer-len B`) gets room past the answer:
an answer is a letter and the end of the turn, 2 of the demo's 4 new tokens, and a buffer inside those 4
penalised every third token until the policy stopped answering; so the demo allows 4 + B new tokens unless
`--max-new-tokens` is given. GSPO (`--policy-loss gspo`) trains in 4 mini-batches per rollout too, so that its
sequence-level clip acts.

The run says how many CPU threads it uses (rollplex/threads.py: 1 for the tiny model unless `--threads` or
$OMP_NUM_THREADS says otherwise), and where it writes the tiny checkpoint on its first run. Ctrl-C or
SIGTERM stops it cleanly (demo/ending.py): the plot, LOG_DIR/summary.json and the metrics are written, then
it exits with 130 / 143. With stdout a log file, each step prints one line.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import sys
import time
from pathlib import Path

import torch

from ..cli import ConfigParser
from ..cosched import Timeline
from ..data import row_to_inputs
from ..engine import EngineConfig
from ..loggers import LoggerConfig, Tracker, add_arguments, resolve_run_dir
from ..memory import MemoryConfig
from ..plots import plot_rewards, reward_labels
from ..rl.algos import AGG_MODE_HELP, describe
from ..rl.config import RLConfig
from ..system import SystemConfig, build, load_policy
from ..threads import apply_threads
from ..tiny import FAMILIES, ensure_tiny, shape_color, tiny_path, tiny_written
from .ending import Signals, summary, summary_line
from .progress import StepProgress, cpu_cost_warning, decoder_params, expected_passes, log_mode

LOG_EVERY_S = 5.0  # in-step progress without a terminal: a line at most this often
WINDOW = 3  # the run stops when the mean reward of this many steps reaches --target


# The demo's defaults, over SystemConfig's: the tiny task's 4 new tokens (an option letter and the end of the
# turn), large groups, a fast learning rate (the critic's too: verl's 1e-5 is for real models and far too
# slow for the tiny one's few steps), float32, no memory manager, a short-context engine.
DEFAULTS = {"dtype": "float32", "format_warmup_steps": 30,
            "rl": RLConfig(n=16, max_new_tokens=4, lr=1e-3, micro_batch_prompts=8, micro_batch_samples=32,
                           max_num_gen_batches=10, critic_lr=1e-3),
            "engine": EngineConfig(max_num_seqs=256, max_model_len=512), "memory": MemoryConfig(memory_plan="resident")}
# no flag: the LR warm-up (--warmup-steps is the format warm-up here, as it always was), and the sections a
# one-process native-engine demo does not use
SKIP = ("rl.warmup_steps", "backend", "fsdp", "cosched", "tp")


def parser() -> ConfigParser:
    ap = ConfigParser(SystemConfig, DEFAULTS, skip=SKIP, prog="python -m rollplex.demo",
                      description=__doc__.splitlines()[0],
                      aliases={"format_warmup_steps": ("--warmup-steps",)},
                      help={"model": "HF checkpoint dir (default: the embedded tiny model, whose random weights this "
                                     "demo trains)",
                            "format_warmup_steps": "format warm-up steps (random option letters)",
                            "seed": "data, warm-up and sampling seed",
                            "loss_agg_mode": describe(AGG_MODE_HELP) + " (with --adv-estimator dr_grpo the demo "
                                             "uses seq-mean-token-sum-norm unless given)",
                            "kl_coef": "KL coefficient (rloo, reinforce_plus_plus, dr_grpo: 0.1 unless given, a KL "
                                       "loss to the reference; else 0: no reference model)",
                            "lr": "the actor's lr (reinforce_plus_plus: 1.5e-3 unless given)"})
    ap.add_argument("--steps", type=int, default=300, help="max GRPO steps (stops early at --target)")
    ap.add_argument("--target", type=float, default=0.8, help=f"stop when the mean reward of {WINDOW} steps reaches it")
    ap.add_argument("--prompts", type=int, default=32, help="prompts per step (with --filter-groups: groups kept)")
    ap.add_argument("--trace", default=None,
                    help="write the run's phases and co-scheduled work as a Chrome/Perfetto trace (JSON) here, "
                         "and its timeline as a PNG beside it")
    ap.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                    help="progress inside each step (rollout tokens, update micro-batches): on a terminal in the "
                         "step bar's line; in a log (stdout not a terminal) a line every few seconds, only inside "
                         "a step that runs longer than that (every step gets its own line either way); off: none. "
                         "auto and on are the same")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads (torch.set_num_threads); default: $OMP_NUM_THREADS if set, else 1 for the "
                         "embedded tiny model on the CPU (more thrash a shared machine and change the trajectory), "
                         "else torch's default. The run says what it picked")
    ap.add_argument("--model-family", choices=FAMILIES, default=None,
                    help="the embedded tiny model's family (default qwen2_5_vl); not with --model")
    add_arguments(ap, experiment="demo")
    ap.add_argument("--out", dest="log_dir", help="the same as --log-dir")
    return ap


# Each algorithm's own defaults on this task, applied where no flag sets them: (the flag's key, its value, the defaults
# it brings). dr_grpo: its loss aggregation. rloo, reinforce_plus_plus and dr_grpo, whose advantages are not divided
# by each group's reward spread: without more, the policy's entropy collapsed before it had learnt to see (every
# group's samples then answer alike and get advantage 0); a KL loss to the format-warmed reference keeps it spread,
# and reinforce_plus_plus, whose baseline is the batch's mean reward, needs a faster lr too (docs/BENCHMARKS.md:
# "Other estimators on the demo's task", "Policy losses and DAPO on the demo's task"). DAPO's clip-higher and GSPO's
# sequence clip act only where the policy ratio moves: with one mini-batch per rollout (the demo's default) every
# update is on-policy and the ratio is 1 (DAPO's entropy collapsed, GSPO was GRPO with per-sequence means); with
# OFF_POLICY_MINI_BATCHES mini-batches per rollout (as their recipes run: several optimizer steps per rollout) the
# later ones are off-policy and the clip acts. SAPO learnt without (its soft gate let the entropy collapse with 4).
# dr_grpo learnt as slowly as rloo with the KL loss alone (not by step 300, seed 0): 4 optimizer steps per rollout
# took it there at step 62.
# DAPO's overlong buffer: see own_defaults.
OFF_POLICY_MINI_BATCHES = 4
RUN_DEFAULTS = (("rl.adv_estimator", "dr_grpo", {"rl.loss_agg_mode": "seq-mean-token-sum-norm", "rl.kl_coef": 0.1,
                                                 "rl.ppo_mini_batches": OFF_POLICY_MINI_BATCHES}),
                ("rl.adv_estimator", "rloo", {"rl.kl_coef": 0.1}),
                ("rl.adv_estimator", "reinforce_plus_plus", {"rl.kl_coef": 0.1, "rl.lr": 1.5e-3}),
                ("rl.filter_groups", True, {"rl.ppo_mini_batches": OFF_POLICY_MINI_BATCHES}),
                ("rl.policy_loss", "gspo", {"rl.ppo_mini_batches": OFF_POLICY_MINI_BATCHES}))
RUN_DEFAULT_BASE = {"rl.adv_estimator": "grpo", "rl.policy_loss": "vanilla", "rl.filter_groups": False}


def config(ap: ConfigParser, args) -> SystemConfig:
    """The demo's SystemConfig from its flags (ValueError when invalid), with the estimator's, the policy loss's and
    DAPO's RUN_DEFAULTS where no flag was given."""
    cfg, _ = config_and_defaults(ap, args)
    return cfg


def own_defaults(given: dict) -> dict:
    """The RUN_DEFAULTS that apply to a run with these given flags (ConfigParser.given), those flags left out.

    DAPO's overlong buffer (`--overlong-buffer-len B`) gets its room: the task's answer is a letter and the end of
    the turn, 2 of the demo's 4 new tokens, so a buffer inside those 4 penalised answers the task needs (with B = 2
    every third token, until the policy stopped answering); unless --max-new-tokens is given, the demo allows
    4 + B new tokens, and the penalty falls on what runs past the 4."""
    own: dict = {}
    for key, value, defaults in RUN_DEFAULTS:
        if given.get(key, RUN_DEFAULT_BASE.get(key)) == value:
            own.update({k: v for k, v in defaults.items() if k not in own})
    if given.get("rl.overlong_buffer_len", 0) > 0:
        own["rl.max_new_tokens"] = DEFAULTS["rl"].max_new_tokens + given["rl.overlong_buffer_len"]
    return {k: v for k, v in own.items() if k not in given}


def config_and_defaults(ap: ConfigParser, args) -> tuple[SystemConfig, dict]:
    """(the SystemConfig, the RUN_DEFAULTS applied to it)."""
    given = ap.given(args)
    own = own_defaults(given)
    return ap.config(args, **own), own


def main(argv=None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        cfg, own = config_and_defaults(ap, args)
    except ValueError as e:
        ap.error(str(e))
    if args.model_family is not None and cfg.model is not None:
        ap.error("--model-family picks the embedded tiny model; --model names a checkpoint already")
    replaced = resolve_run_dir(args, "demo")
    if replaced:
        print(f"note: {args.log_dir} holds an earlier run; replacing {', '.join(Path(f).name for f in replaced)}")
    try:
        logger_cfg = LoggerConfig.from_args(args)
    except ValueError as e:
        ap.error(str(e))
    threads_before = torch.get_num_threads()
    try:
        threads = apply_threads(args.threads, cfg.device, tiny=cfg.model is None)
    except ValueError as e:
        ap.error(str(e))
    print(threads, flush=True)
    if own:
        print("defaults for this algorithm on the demo's task (flags given win): "
              + ", ".join(f"--{k.split('.')[-1].replace('_', '-')} {v}" for k, v in own.items()), flush=True)
    tracker = Tracker(logger_cfg)  # before the model: a missing logger package fails at once
    signals = Signals()
    warnings = _show_warnings()
    try:
        with signals:
            _run(cfg, args, tracker, signals, threads=torch.get_num_threads())
    except KeyboardInterrupt:  # before the first step (loading, warm-up): nothing to plot
        print(f"\nstopped by {signals.name} before the first step: nothing trained", flush=True)
        raise SystemExit(signals.exit_code) from None
    finally:
        tracker.close()
        torch.set_num_threads(threads_before)  # a caller in the same process (a test) keeps its own
        logging.getLogger("rollplex").removeHandler(warnings)


class _BarSafeHandler(logging.Handler):
    """Rollplex's warnings as `warning: ...` lines on stderr, written around the step bar (tqdm.write)."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        tqdm.write(f"warning: {self.format(record)}", file=sys.stderr)


def _show_warnings() -> logging.Handler:
    """Rollplex's warnings (a fused step that runs phased, a memory plan over budget, ...) printed, whatever
    logging a caller set up; the handler, to remove at the end."""
    handler = _BarSafeHandler(logging.WARNING)
    logging.getLogger("rollplex").addHandler(handler)
    return handler


def _tiny_model(cfg: SystemConfig, family: str | None) -> SystemConfig:
    """cfg with the embedded tiny model of `family` (default qwen2_5_vl) as its model, written to the cache on the
    first run (said, with where)."""
    family = family or FAMILIES[0]
    path = tiny_path(family=family)
    if not tiny_written(path):
        print(f"writing the embedded tiny {family} model (random weights, ~4 MB) to {path} (first run only; "
              "$ROLLPLEX_CACHE moves it)", flush=True)
    return dataclasses.replace(cfg, model=str(ensure_tiny(family=family)))


def _run(cfg: SystemConfig, args, tracker: Tracker, signals: Signals, threads: int) -> None:
    if cfg.model is None:
        cfg = _tiny_model(cfg, args.model_family)
    torch.manual_seed(cfg.rl.seed)
    model_path, model, proc = load_policy(cfg)
    rows = shape_color.make_rows(512, seed=cfg.rl.seed)
    out = Path(args.log_dir)
    rl_cfg = cfg.rl
    if cfg.device == "cpu":  # before the warm-up, which a real-size model makes slow too
        warning = cpu_cost_warning(decoder_params(model), len(row_to_inputs(proc, rows[0]).input_ids), args.prompts,
                                   rl_cfg.n, rl_cfg.max_new_tokens, rl_cfg.mode, ref=rl_cfg.kl_coef > 0)
        if warning:
            print(warning, flush=True)
    t0 = time.perf_counter()
    try:  # the format warm-up on the training rows, the engine and the RL step (rollplex/system.py)
        system = build(cfg, model=model, processor=proc, model_path=model_path, reward_fn="shape_color",
                       warmup_rows=rows)
    except ValueError as e:
        raise SystemExit(f"rollplex.demo: {e}") from None
    print(warmup_line(cfg.format_warmup_steps, system.warmup_loss, system.startup_s.get("format_warmup", 0.0)),
          flush=True)
    model, engine, rl = system.model, system.engine, system.rl
    if args.trace:
        rl.timeline = Timeline(model.inv_freq.device)
    rng = random.Random(cfg.rl.seed)
    history: list[dict] = []
    lines = log_mode(sys.stdout)  # a log file (or a terminal too narrow for a bar): one line per step
    from tqdm import tqdm

    bar = tqdm(range(args.steps), desc=f"{rl_cfg.adv_estimator} ({rl_cfg.mode})", unit="step", disable=lines)
    shown = {"reward": ""}  # the bar's reward text, which in-step progress on a terminal shows beside its own
    progress = _progress(args, model, engine, rl_cfg, bar, shown, lines)
    stopped, failed = "steps", None
    try:
        for _ in range(args.steps):
            if progress is not None:
                progress.begin(len(history) + 1)
            t_step = time.perf_counter()
            # dynamic sampling (--filter-groups) rolls out more rows, drawn the same way, to fill the step
            try:
                m = rl.step(rng.sample(rows, args.prompts), more_rows=lambda: rng.sample(rows, args.prompts))
            except ValueError as e:  # dynamic sampling found too few groups to train: the run ends here
                failed = f"rollplex.demo: step {len(history) + 1}: {e}"
                stopped = "an error"
                break
            if progress is not None:
                progress.end()
            history.append(m)
            tracker.log(m, len(history))
            recent = sum(h["critic/score/mean"] for h in history[-WINDOW:]) / len(history[-WINDOW:])
            shown["reward"] = f"reward={m['critic/score/mean']:.2f}, avg{WINDOW}={recent:.2f}" + (
                f", gen_batches={m['train/num_gen_batches']}" if rl_cfg.filter_groups else "")
            if lines:
                print(f"step {len(history)}/{args.steps}: {shown['reward'].replace('=', ' ')}, "
                      f"{time.perf_counter() - t_step:.1f}s, {time.perf_counter() - t0:.0f}s in", flush=True)
            else:
                bar.update(1)
                bar.set_postfix_str(shown["reward"])
            if len(history) >= WINDOW and recent >= args.target:
                stopped = "target"
                break
    except KeyboardInterrupt:
        stopped = signals.name
    finally:
        if progress is not None:
            progress.close()
        bar.close()
    with signals.ignored():  # the run's files are written whatever comes now
        if failed is not None:
            print(failed, file=sys.stderr, flush=True)
        elif stopped not in ("steps", "target"):
            print(f"\nstopped by {stopped} after {len(history)} steps; writing the run's files", flush=True)
        _finish(cfg, args, rl, rows, history, out, stopped, time.perf_counter() - t0, threads)
    if failed is not None:
        raise SystemExit(1)
    if stopped not in ("steps", "target"):
        raise SystemExit(signals.exit_code)


def _finish(cfg: SystemConfig, args, rl, rows, history: list[dict], out: Path, stopped: str, seconds: float,
            threads: int) -> None:
    """The reward plot (with the target and the stopping statistic), the trace, summary.json and the last lines."""
    title, chance = reward_labels(r.get("data_source") for r in rows)
    png = plot_rewards(history, out / "reward.png", title, chance, target=args.target, window=WINDOW) \
        if history else None
    if rl.timeline is not None:
        trace = rl.timeline.write_trace(args.trace)
        timeline_png = rl.timeline.plot(Path(args.trace).with_suffix(".png"), title="demo: phases and prefix work")
        print(f"trace: {trace}" + (f", timeline: {timeline_png}" if timeline_png else ""))
    s = summary(history, args.target, WINDOW, stopped, seconds, seed=cfg.rl.seed, threads=threads,
                model=cfg.model, adv_estimator=cfg.rl.adv_estimator, policy_loss=cfg.rl.policy_loss)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
    print(summary_line(s), flush=True)
    print(f"logs: {out}" + (f", plot: {png}" if png else ""), flush=True)


def warmup_line(steps: int, loss: float | None, seconds: float) -> str:
    """What the demo says of its format warm-up (none ran when `loss` is None: --warmup-steps 0)."""
    if loss is None:
        return "format warm-up: off (--warmup-steps 0)"
    return f"format warm-up: {steps} steps on random letters, loss {loss:.3f} ({seconds:.1f}s)"


def _progress(args, model, engine, cfg: RLConfig, bar, shown: dict, lines: bool) -> StepProgress | None:
    """The in-step progress for `--progress` (auto: on): on a terminal in the step bar's line (4 updates a
    second at most), in a log a printed line every LOG_EVERY_S inside a step that runs longer; None when off."""
    if args.progress == "off":
        return None
    passes = expected_passes(cfg, args.prompts)
    if not lines:
        def sink(text: str) -> None:
            bar.set_postfix_str(", ".join(x for x in (shown["reward"], text) if x))

        return StepProgress(model, engine, args.prompts, cfg.n, passes, sink, every_s=0.25)
    return StepProgress(model, engine, args.prompts, cfg.n, passes, lambda text: print(text, flush=True),
                        every_s=LOG_EVERY_S)


if __name__ == "__main__":
    main()
