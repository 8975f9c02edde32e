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

PPO with a critic (`--adv-estimator gae`, rl/critic.py): a value model copied from the warmed-up policy
is trained beside it (`--critic-lr`, default the actor's `--lr`; `--critic-warmup`, `--gamma`, `--lam`).

DAPO (`--filter-groups`, `--overlong-buffer-len`, `--clip-ratio-high 0.28`; rl/config.py): a step rolls
out more prompts until it holds --prompts groups whose samples' rewards differ (`train/num_gen_batches`).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

from ..cosched import Timeline
from ..data import row_to_inputs
from ..engine import Engine, EngineConfig
from ..loggers import LoggerConfig, Tracker, add_arguments, resolve_run_dir
from ..models import load_model
from ..plots import plot_rewards, reward_labels
from ..processor import VLProcessor
from ..rl.algos import AGG_MODES
from ..rl.config import ADV_ESTIMATORS, FILTER_GROUPS_METRICS, RLConfig
from ..rl.step import RLStep
from ..rl.warmup import format_warmup
from ..tiny import ensure_tiny, shape_color
from .progress import StepProgress, cpu_cost_warning, decoder_params, expected_passes

LOG_EVERY_S = 5.0  # --progress without a terminal: a line at most this often


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None: such a flag's help says what leaving it out means."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rollplex.demo", description=__doc__.splitlines()[0],
                                 formatter_class=_HelpFormatter)
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: the embedded tiny model, whose "
                    "random weights this demo trains)")
    ap.add_argument("--mode", default="rollplex", choices=["rollplex", "serial"], help="rollplex: shared-prefix "
                    "scoring and training; serial: verl's per-sample order")
    ap.add_argument("--steps", type=int, default=300, help="max GRPO steps (stops early at --target)")
    ap.add_argument("--target", type=float, default=0.8, help="stop when the mean reward of 3 steps reaches it")
    ap.add_argument("--prompts", type=int, default=32, help="prompts per step")
    ap.add_argument("--n", type=int, default=16, help="samples per prompt (GRPO group size)")
    ap.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    ap.add_argument("--kl-coef", type=float, default=0.0, help="KL loss to the warmed-up reference policy")
    ap.add_argument("--adv-estimator", default="grpo", choices=ADV_ESTIMATORS,
                    help="advantage estimator (rl/algos.py); dr_grpo with its seq-mean-token-sum-norm aggregation")
    ap.add_argument("--loss-agg-mode", default=None, choices=AGG_MODES,
                    help="loss aggregation (default: token-mean; dr_grpo's seq-mean-token-sum-norm with it)")
    ap.add_argument("--clip-ratio-low", type=float, default=0.2, help="PPO clip range below 1")
    ap.add_argument("--clip-ratio-high", type=float, default=0.2, help="PPO clip range above 1 (DAPO's clip-higher: "
                    "0.28)")
    ppo = ap.add_argument_group("PPO with a critic (--adv-estimator gae)")
    ppo.add_argument("--critic-lr", type=float, default=None, help="the critic's lr (default: --lr; RLConfig's "
                     "1e-5 is verl's for real models, far too slow for the tiny one's few steps)")
    ppo.add_argument("--critic-warmup", type=int, default=0, help="the first steps train the critic only")
    ppo.add_argument("--gamma", type=float, default=1.0, help="discount of the per-token return")
    ppo.add_argument("--lam", type=float, default=1.0, help="GAE's lambda")
    dapo = ap.add_argument_group("DAPO (verl's recipe: --clip-ratio-high 0.28 --filter-groups "
                                 "--overlong-buffer-len, KL off)")
    dapo.add_argument("--filter-groups", action="store_true", help="dynamic sampling: drop the groups whose samples "
                      "all score the same and roll out more prompts until the step has --prompts groups")
    dapo.add_argument("--filter-groups-metric", default="seq_reward", choices=FILTER_GROUPS_METRICS,
                      help="what must differ within a group: the reward trained on, or the score before overlong "
                      "shaping")
    dapo.add_argument("--max-num-gen-batches", type=int, default=10, help="rollouts per step at most with "
                      "--filter-groups (0: unbounded; verl's recipe: 10)")
    dapo.add_argument("--filter-groups-partial", action="store_true", help="at --max-num-gen-batches train on the "
                      "groups kept instead of stopping with an error")
    dapo.add_argument("--overlong-buffer-len", type=int, default=0, help="overlong reward shaping: a response longer "
                      "than max_new_tokens (4) minus this loses up to --overlong-penalty-factor (0: off)")
    dapo.add_argument("--overlong-penalty-factor", type=float, default=1.0, help="the overlong penalty at "
                      "max_new_tokens")
    ap.add_argument("--warmup-steps", type=int, default=30, help="format warm-up steps (random option letters)")
    ap.add_argument("--seed", type=int, default=0, help="data, warm-up and sampling seed")
    ap.add_argument("--freeze-vision-tower", action="store_true",
                    help="no gradient into the vision tower; the engine's prefill encodings are reused")
    ap.add_argument("--cosched", action="store_true",
                    help="run the reference's prefix beside the rollout's decode steps (needs --kl-coef > 0; "
                         "on an H200 it made steps no faster: docs/ARCHITECTURE.md)")
    ap.add_argument("--schedule", default="phased", choices=["phased", "fused"],
                    help="fused: train each prompt group beside the rest of the rollout (rl/pipeline.py)")
    ap.add_argument("--trace", default=None,
                    help="write the run's phases and co-scheduled work as a Chrome/Perfetto trace (JSON) here, "
                         "and its timeline as a PNG beside it")
    ap.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                    help="progress inside each step (rollout tokens, update micro-batches); auto: on when stdout is "
                         "a terminal (the step bar's line), on elsewhere: a line every few seconds")
    add_arguments(ap, experiment="demo")
    ap.add_argument("--out", dest="log_dir", help="the same as --log-dir")
    args = ap.parse_args(argv)
    if args.cosched and args.kl_coef <= 0:
        ap.error("--cosched moves the reference model's prefix work: it needs --kl-coef > 0")
    replaced = resolve_run_dir(args, "demo")
    if replaced:
        print(f"note: {args.log_dir} holds an earlier run; replacing {', '.join(Path(f).name for f in replaced)}")
    try:
        logger_cfg = LoggerConfig.from_args(args)
    except ValueError as e:
        ap.error(str(e))
    tracker = Tracker(logger_cfg)  # before the model: a missing logger package fails at once
    try:
        _run(args, tracker)
    finally:
        tracker.close()


def _run(args, tracker: Tracker) -> None:
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    path = args.model or ensure_tiny()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(path, device=device)
    proc = VLProcessor.from_pretrained(path)
    rows = shape_color.make_rows(512, seed=args.seed)
    out = Path(args.log_dir)
    max_new_tokens = 4  # an option letter and the end of the turn
    if device == "cpu":  # before the warm-up, which a real-size model makes slow too
        warning = cpu_cost_warning(decoder_params(model), len(row_to_inputs(proc, rows[0]).input_ids), args.prompts,
                                   args.n, max_new_tokens, args.mode, ref=args.kl_coef > 0)
        if warning:
            print(warning, flush=True)
    t0 = time.perf_counter()
    loss = format_warmup(model, proc, rows, shape_color.LETTERS, args.warmup_steps, lr=1e-3, seed=args.seed)
    print(f"format warm-up: {args.warmup_steps} steps on random letters, loss {loss:.3f} "
          f"({time.perf_counter() - t0:.1f}s)")
    if device == "cuda":  # the demo owns the model (the engine compiles only its decode)
        model.compile()
    engine = Engine(model, proc, EngineConfig(max_num_seqs=256, max_model_len=512))
    agg = args.loss_agg_mode or ("seq-mean-token-sum-norm" if args.adv_estimator == "dr_grpo" else "token-mean")
    try:
        cfg = RLConfig(mode=args.mode, n=args.n, temperature=1.0, max_new_tokens=max_new_tokens, lr=args.lr,
                       kl_coef=args.kl_coef, micro_batch_prompts=8, micro_batch_samples=32, seed=args.seed,
                       grad_clip=1.0, freeze_vision_tower=args.freeze_vision_tower, cosched=args.cosched,
                       schedule=args.schedule, adv_estimator=args.adv_estimator, loss_agg_mode=agg,
                       clip_ratio_low=args.clip_ratio_low, clip_ratio_high=args.clip_ratio_high,
                       filter_groups=args.filter_groups, filter_groups_metric=args.filter_groups_metric,
                       max_num_gen_batches=args.max_num_gen_batches, filter_groups_partial=args.filter_groups_partial,
                       overlong_buffer_len=args.overlong_buffer_len,
                       overlong_penalty_factor=args.overlong_penalty_factor, gamma=args.gamma, lam=args.lam,
                       critic_lr=args.critic_lr if args.critic_lr is not None else args.lr,
                       critic_warmup=args.critic_warmup)
    except ValueError as e:
        raise SystemExit(f"rollplex.demo: {e}") from None
    rl = RLStep(model, engine, cfg, proc, reward_fn="shape_color")
    if args.trace:
        rl.timeline = Timeline(model.inv_freq.device)
    rng = random.Random(args.seed)
    history: list[dict] = []
    from tqdm import tqdm

    bar = tqdm(range(args.steps), desc=f"{args.adv_estimator} ({args.mode})", unit="step")
    shown = {"reward": ""}  # the bar's reward text, which in-step progress on a terminal shows beside its own
    progress = _progress(args, model, engine, cfg, bar, shown)
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
                f", gen_batches={m['train/num_gen_batches']}" if args.filter_groups else "")
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

        return StepProgress(model, engine, args.prompts, args.n, passes, sink, every_s=0.25)
    return StepProgress(model, engine, args.prompts, args.n, passes, lambda text: print(text, flush=True),
                        every_s=LOG_EVERY_S)


if __name__ == "__main__":
    main()
