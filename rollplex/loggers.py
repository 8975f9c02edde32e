"""Metric loggers for the training loops, chosen by name like verl's `trainer.logger` list.

    cfg = LoggerConfig(names=("jsonl", "tensorboard"), project="rollplex", experiment="exp")
    with Tracker(cfg) as tracker:                      # LOG_DIR defaults to runs/PROJECT/EXPERIMENT
        tracker.log({"critic/score/mean": 0.25, "timing_s/step": 1.2}, step=1)

    console      one line per step on the terminal, `step:K - name:value - ...` (through tqdm.write, so
                 a progress bar stays intact)
    jsonl        LOG_DIR/metrics.jsonl: one JSON object per step, {"step": K, <verl metric name>: value, ...}
    tensorboard  scalar events under LOG_DIR/tensorboard; `pip install 'rollplex[tensorboard]'`
    wandb        a Weights & Biases run (project PROJECT, name EXPERIMENT, files under LOG_DIR);
                 `pip install 'rollplex[wandb]'`; WANDB_MODE=offline records it without a network

The optional packages are imported only when their logger is chosen, and a missing one is an
ImportError naming the install command, raised when the Tracker is built, before any training step.
`add_arguments` / `LoggerConfig.from_args` give the training CLIs the same flags (`--logger`,
`--project`, `--experiment`, `--log-dir`), named after verl's trainer.logger / project_name /
experiment_name. `resolve_run_dir` gives each CLI run its own folder: without `--experiment` the name
is PREFIX-YYYYMMDD-HHMMSS (with -2, -3, ... when that folder exists), so a run never replaces the
metrics and plots of the one before; an explicit name or `--log-dir` that already holds a run's files
is used as given, and the CLI says which files it replaces.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

NAMES = ("console", "jsonl", "tensorboard", "wandb")
DEFAULT_NAMES = ("jsonl",)


def parse_names(values) -> tuple[str, ...]:
    """Logger names from repeated and/or comma-separated values, in order, without repeats; ValueError
    for an unknown name."""
    out: list[str] = []
    for value in values:
        for name in str(value).split(","):
            name = name.strip().lower()
            if not name:
                continue
            if name not in NAMES:
                raise ValueError(f"unknown logger {name!r}; choose from {', '.join(NAMES)}")
            if name not in out:
                out.append(name)
    return tuple(out)


def default_log_dir(project: str, experiment: str) -> str:
    return str(Path("runs") / project / experiment)


RUN_FILES = ("metrics.jsonl", "reward.png")  # what a CLI run writes into its folder


def run_name(prefix: str, now: float | None = None) -> str:
    """PREFIX-YYYYMMDD-HHMMSS (local time) of `now` (default: the current time)."""
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}"


def resolve_run_dir(args: argparse.Namespace, prefix: str, now: float | None = None) -> list[str]:
    """Fill `args.experiment` and `args.log_dir` left unset by the flags of `add_arguments`: a new
    experiment name per run (`run_name`, suffixed -2, -3, ... while runs/PROJECT/NAME exists) and its
    folder runs/PROJECT/EXPERIMENT. Creates nothing. Returns the files of an earlier run that an explicit
    `--experiment` / `--log-dir` folder already holds (the CLI says it replaces them; a resumed run
    appends its metrics instead)."""
    if args.experiment is None and args.log_dir is None:
        base = run_name(prefix, now)
        name, k = base, 1
        while Path(default_log_dir(args.project, name)).exists():
            k += 1
            name = f"{base}-{k}"
        args.experiment = name
    elif args.experiment is None:  # --log-dir alone: the folder names the run
        args.experiment = Path(args.log_dir).name or prefix
    if args.log_dir is None:
        args.log_dir = default_log_dir(args.project, args.experiment)
    return [str(Path(args.log_dir) / f) for f in RUN_FILES if (Path(args.log_dir) / f).exists()]


@dataclass
class LoggerConfig:
    names: tuple[str, ...] = DEFAULT_NAMES
    project: str = "rollplex"  # verl's trainer.project_name: the wandb project
    experiment: str = "run"  # verl's trainer.experiment_name: the wandb run name
    log_dir: str | None = None  # default: runs/PROJECT/EXPERIMENT
    append: bool = False  # jsonl: continue the file (a resumed run) instead of starting it anew
    hparams: dict = field(default_factory=dict)  # the run's settings, recorded by wandb

    def __post_init__(self):
        self.names = parse_names(self.names)
        if not self.project or not self.experiment:
            raise ValueError("the project and experiment names must be non-empty")
        if self.log_dir is None:
            self.log_dir = default_log_dir(self.project, self.experiment)

    @classmethod
    def from_args(cls, args: argparse.Namespace, append: bool = False) -> LoggerConfig:
        """From the flags `add_arguments` defined (unset names resolved by `resolve_run_dir` first, as the
        CLIs do)."""
        if args.experiment is None:
            resolve_run_dir(args, "run")
        hparams = {k: v for k, v in vars(args).items() if k != "api_key"}  # never record a credential
        return cls(names=parse_names(args.logger or DEFAULT_NAMES), project=args.project, experiment=args.experiment,
                   log_dir=args.log_dir, append=append, hparams=hparams)


def add_arguments(ap: argparse.ArgumentParser, experiment: str) -> None:
    """`--logger` (repeatable, comma lists), `--project`, `--experiment`, `--log-dir` on a training CLI;
    `experiment` is the prefix of the default run name (`resolve_run_dir` fills the unset ones)."""
    g = ap.add_argument_group("logging")
    g.add_argument("--logger", action="append", default=None, metavar="NAME",
                   help=f"where metrics go: {', '.join(NAMES)}; repeat the flag or give a comma list "
                        f"(default: {','.join(DEFAULT_NAMES)})")
    g.add_argument("--project", default="rollplex", help="project name (verl's trainer.project_name)")
    g.add_argument("--experiment", default=None,
                   help=f"experiment name (verl's trainer.experiment_name) (default: {experiment}-YYYYMMDD-HHMMSS, "
                        "a new folder per run)")
    g.add_argument("--log-dir", default=None, help="the run's folder: metrics.jsonl, tensorboard/, wandb/, plots "
                                                   "(default: runs/PROJECT/EXPERIMENT)")


class _Logger(Protocol):
    def log(self, metrics: dict, step: int) -> None: ...

    def close(self) -> None: ...


def _scalars(metrics: dict) -> dict[str, float]:
    """The numeric, finite entries (the server sends non-finite values as null)."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class ConsoleLogger:
    def log(self, metrics: dict, step: int) -> None:
        from tqdm import tqdm

        parts = [f"{k}:{v:.4g}" if isinstance(v, float) else f"{k}:{v}" for k, v in metrics.items()]
        tqdm.write(" - ".join([f"step:{step}", *parts]))

    def close(self) -> None:
        pass


class JsonlLogger:
    def __init__(self, path: Path, append: bool):
        self.path = path
        self._file = open(path, "a" if append else "w")

    def log(self, metrics: dict, step: int) -> None:
        self._file.write(json.dumps({"step": step, **metrics}, default=str) + "\n")
        self._file.flush()  # readable while the run goes on

    def close(self) -> None:
        self._file.close()


class TensorBoardLogger:
    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("the tensorboard logger needs the tensorboard package: "
                              "pip install 'rollplex[tensorboard]'") from e
        self._writer = SummaryWriter(str(log_dir), flush_secs=10)

    def log(self, metrics: dict, step: int) -> None:
        for k, v in _scalars(metrics).items():
            self._writer.add_scalar(k, v, step)

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    def __init__(self, cfg: LoggerConfig):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("the wandb logger needs the wandb package: pip install 'rollplex[wandb]' "
                              "(WANDB_MODE=offline records a run without a network)") from e
        # wandb reads WANDB_MODE (online / offline / disabled) itself
        self._run = wandb.init(project=cfg.project, name=cfg.experiment, dir=cfg.log_dir,
                               config=json.loads(json.dumps(cfg.hparams, default=str)))

    def log(self, metrics: dict, step: int) -> None:
        self._run.log(_scalars(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class Tracker:
    """The chosen loggers; `log(metrics, step)` sends one step's metrics to each."""

    def __init__(self, cfg: LoggerConfig):
        self.cfg = cfg
        self.log_dir = Path(cfg.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.loggers: dict[str, _Logger] = {}
        try:
            for name in cfg.names:
                self.loggers[name] = self._make(name)
        except BaseException:
            self.close()
            raise

    def _make(self, name: str) -> _Logger:
        if name == "console":
            return ConsoleLogger()
        if name == "jsonl":
            return JsonlLogger(self.log_dir / "metrics.jsonl", self.cfg.append)
        if name == "tensorboard":
            return TensorBoardLogger(self.log_dir / "tensorboard")
        if name == "wandb":
            return WandbLogger(self.cfg)
        raise AssertionError(name)  # LoggerConfig validated the names

    def log(self, metrics: dict, step: int) -> None:
        for logger in self.loggers.values():
            logger.log(metrics, step)

    def close(self) -> None:
        loggers, self.loggers = self.loggers, {}
        for logger in loggers.values():
            logger.close()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
