"""`python -m rollplex.demo`: GRPO teaches the embedded tiny Qwen2.5-VL to read colours.

1. Write / load the tiny random-init checkpoint (it knows no language yet).
2. Format warm-up: a few supervised steps on *randomly labelled* answers teach it to reply with one
   option letter and stop — it learns the format, not the answer, so it scores chance (0.25).
3. GRPO with the native engine (shared weights), shared-prefix scoring and training until the mean
   reward reaches the target; a progress bar per step; a reward curve PNG at the end.

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

RLOO and REINFORCE++ train with a KL loss to the format-warmed reference (`--kl-coef 0.1`; REINFORCE++ also
`--lr 1.5e-3`) unless those flags are given (`ESTIMATOR_DEFAULTS`): their advantages are not divided by each
group's reward spread as GRPO's are, and without it the policy's entropy collapsed before the model had
learnt the task.

DAPO (`--filter-groups`, `--overlong-buffer-len`, `--clip-ratio-high 0.28`; rl/config.py): a step rolls
out more prompts until it holds --prompts groups whose samples' rewards differ (`train/num_gen_batches`).
"""

from __future__ import annotations

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
from ..tiny import shape_color
from .progress import StepProgress, cpu_cost_warning, decoder_params, expected_passes

LOG_EVERY_S = 5.0  # --progress without a terminal: a line at most this often


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
                            "kl_coef": "KL coefficient (rloo, reinforce_plus_plus: 0.1 unless given, a KL loss to the "
                                       "reference; else 0: no reference model)",
                            "lr": "the actor's lr (reinforce_plus_plus: 1.5e-3 unless given)"})
    ap.add_argument("--steps", type=int, default=300, help="max GRPO steps (stops early at --target)")
    ap.add_argument("--target", type=float, default=0.8, help="stop when the mean reward of 3 steps reaches it")
    ap.add_argument("--prompts", type=int, default=32, help="prompts per step (with --filter-groups: groups kept)")
    ap.add_argument("--trace", default=None,
                    help="write the run's phases and co-scheduled work as a Chrome/Perfetto trace (JSON) here, "
                         "and its timeline as a PNG beside it")
    ap.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                    help="progress inside each step (rollout tokens, update micro-batches); auto: on when stdout is "
                         "a terminal (the step bar's line), on elsewhere: a line every few seconds")
    add_arguments(ap, experiment="demo")
    ap.add_argument("--out", dest="log_dir", help="the same as --log-dir")
    return ap


# Each estimator's own defaults on this task, where a flag does not set them. dr_grpo: its loss aggregation. rloo
# and reinforce_plus_plus, whose advantages are not divided by each group's reward spread: without more, the
# policy's entropy collapsed before it had learnt to see (every group's samples then answer alike and get advantage
# 0); a KL loss to the format-warmed reference keeps it spread, and reinforce_plus_plus, whose baseline is the
# batch's mean reward, needs a faster lr too (docs/BENCHMARKS.md: "Other estimators on the demo's task")
ESTIMATOR_DEFAULTS = {"dr_grpo": {"rl.loss_agg_mode": "seq-mean-token-sum-norm"},
                      "rloo": {"rl.kl_coef": 0.1},
                      "reinforce_plus_plus": {"rl.kl_coef": 0.1, "rl.lr": 1.5e-3}}


def config(ap: ConfigParser, args) -> SystemConfig:
    """The demo's SystemConfig from its flags (ValueError when invalid), with the estimator's ESTIMATOR_DEFAULTS
    where no flag was given."""
    given = ap.given(args)
    own = ESTIMATOR_DEFAULTS.get(given.get("rl.adv_estimator"), {})
    return ap.config(args, **{k: v for k, v in own.items() if k not in given})


def main(argv=None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        cfg = config(ap, args)
    except ValueError as e:
        ap.error(str(e))
    replaced = resolve_run_dir(args, "demo")
    if replaced:
        print(f"note: {args.log_dir} holds an earlier run; replacing {', '.join(Path(f).name for f in replaced)}")
    try:
        logger_cfg = LoggerConfig.from_args(args)
    except ValueError as e:
        ap.error(str(e))
    tracker = Tracker(logger_cfg)  # before the model: a missing logger package fails at once
    try:
        _run(cfg, args, tracker)
    finally:
        tracker.close()


def _run(cfg: SystemConfig, args, tracker: Tracker) -> None:
    torch.manual_seed(cfg.rl.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))
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
    print(warmup_line(cfg.format_warmup_steps, system.warmup_loss, system.startup_s.get("format_warmup", 0.0)))
    model, engine, rl = system.model, system.engine, system.rl
    if args.trace:
        rl.timeline = Timeline(model.inv_freq.device)
    rng = random.Random(cfg.rl.seed)
    history: list[dict] = []
    from tqdm import tqdm

    bar = tqdm(range(args.steps), desc=f"{rl_cfg.adv_estimator} ({rl_cfg.mode})", unit="step")
    shown = {"reward": ""}  # the bar's reward text, which in-step progress on a terminal shows beside its own
    progress = _progress(args, model, engine, rl_cfg, bar, shown)
    try:
        for _ in bar:
            if progress is not None:
                progress.begin(len(history) + 1)
            # dynamic sampling (--filter-groups) rolls out more rows, drawn the same way, to fill the step
            try:
                m = rl.step(rng.sample(rows, args.prompts), more_rows=lambda: rng.sample(rows, args.prompts))
            except ValueError as e:  # dynamic sampling found too few groups to train
                raise SystemExit(f"rollplex.demo: step {len(history) + 1}: {e}") from None
            if progress is not None:
                progress.end()
            history.append(m)
            tracker.log(m, len(history))
            recent = sum(h["critic/score/mean"] for h in history[-3:]) / len(history[-3:])
            shown["reward"] = f"reward={m['critic/score/mean']:.2f}, avg3={recent:.2f}" + (
                f", gen_batches={m['train/num_gen_batches']}" if rl_cfg.filter_groups else "")
            bar.set_postfix_str(shown["reward"])
            if len(history) >= 3 and recent >= args.target:
                break
    finally:
        if progress is not None:
            progress.close()
        bar.close()
    title, chance = reward_labels(r.get("data_source") for r in rows)
    png = plot_rewards(history, out / "reward.png", title, chance)
    if rl.timeline is not None:
        trace = rl.timeline.write_trace(args.trace)
        timeline_png = rl.timeline.plot(Path(args.trace).with_suffix(".png"), title="demo: phases and prefix work")
        print(f"trace: {trace}" + (f", timeline: {timeline_png}" if timeline_png else ""))
    first, last = history[0]["critic/score/mean"], sum(h["critic/score/mean"] for h in history[-3:]) / 3
    print(f"mean reward: {first:.2f} (step 1) -> {last:.2f} (last 3 steps) in {len(history)} steps, "
          f"{time.perf_counter() - t0:.0f}s total")
    print(f"logs: {out}" + (f", plot: {png}" if png else ""))


def warmup_line(steps: int, loss: float | None, seconds: float) -> str:
    """What the demo says of its format warm-up (none ran when `loss` is None: --warmup-steps 0)."""
    if loss is None:
        return "format warm-up: off (--warmup-steps 0)"
    return f"format warm-up: {steps} steps on random letters, loss {loss:.3f} ({seconds:.1f}s)"


def _progress(args, model, engine, cfg: RLConfig, bar, shown: dict) -> StepProgress | None:
    """The in-step progress for `--progress`: on a terminal in the step bar's line (4 updates a second at
    most), elsewhere a printed line every LOG_EVERY_S; None when off."""
    tty = sys.stdout.isatty()
    if args.progress == "off" or (args.progress == "auto" and not tty):
        return None
    passes = expected_passes(cfg, args.prompts)
    if tty:
        def sink(text: str) -> None:
            bar.set_postfix_str(", ".join(x for x in (shown["reward"], text) if x))

        return StepProgress(model, engine, args.prompts, cfg.n, passes, sink, every_s=0.25)
    return StepProgress(model, engine, args.prompts, cfg.n, passes, lambda text: print(text, flush=True),
                        every_s=LOG_EVERY_S)


if __name__ == "__main__":
    main()
