"""rollplex/loggers.py: logger names, the jsonl file's exact content, console lines, TensorBoard events
and a wandb run (offline) when those packages are installed, and the install hint when they are not."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from rollplex.loggers import LoggerConfig, Tracker, add_arguments, parse_names

STEP1 = {"critic/score/mean": 0.25, "timing_s/step": 1.5, "training/global_step": 1, "actor/grad_norm": None}
STEP2 = {"critic/score/mean": 0.5, "timing_s/step": 1.25, "training/global_step": 2, "actor/grad_norm": 0.75}


def _cfg(tmp_path, *names, **kw) -> LoggerConfig:
    return LoggerConfig(names=names, project="proj", experiment="exp", log_dir=str(tmp_path / "run"), **kw)


def test_names_repeat_or_comma_list():
    assert parse_names(["jsonl,Console", "tensorboard", "jsonl", " wandb "]) == ("jsonl", "console", "tensorboard",
                                                                                 "wandb")
    with pytest.raises(ValueError, match="unknown logger 'mlflow'"):
        parse_names(["jsonl,mlflow"])
    with pytest.raises(ValueError, match="unknown logger"):
        LoggerConfig(names=("tb",))
    assert LoggerConfig(project="p", experiment="e").log_dir == str(Path("runs") / "p" / "e")  # verl's layout
    with pytest.raises(ValueError, match="non-empty"):
        LoggerConfig(experiment="")


def test_cli_flags(tmp_path):
    ap = argparse.ArgumentParser()
    add_arguments(ap, experiment="exp0")
    args = ap.parse_args(["--logger", "console,jsonl", "--logger", "tensorboard", "--project", "p"])
    args.api_key = "s3cret"
    cfg = LoggerConfig.from_args(args, append=True)
    assert cfg.names == ("console", "jsonl", "tensorboard") and cfg.project == "p"
    assert cfg.experiment.startswith("run-") and cfg.log_dir == str(Path("runs") / "p" / cfg.experiment) and cfg.append
    assert "api_key" not in cfg.hparams and cfg.hparams["project"] == "p"  # a credential is never recorded
    cfg = LoggerConfig.from_args(ap.parse_args(["--experiment", "exp1"]))
    assert cfg.experiment == "exp1" and cfg.log_dir == str(Path("runs") / "rollplex" / "exp1")
    assert LoggerConfig.from_args(ap.parse_args([])).names == ("jsonl",)


def test_jsonl_content_is_exact_and_resume_appends(tmp_path):
    with Tracker(_cfg(tmp_path, "jsonl")) as t:
        t.log({}, 0)
        t.log(STEP1, 1)
    path = tmp_path / "run" / "metrics.jsonl"
    assert path.read_text() == (
        '{"step": 0}\n'
        '{"step": 1, "critic/score/mean": 0.25, "timing_s/step": 1.5, "training/global_step": 1, '
        '"actor/grad_norm": null}\n')
    with Tracker(_cfg(tmp_path, "jsonl", append=True)) as t:
        t.log(STEP2, 2)
    assert [json.loads(x) for x in path.read_text().splitlines()] == [{"step": 0}, {"step": 1, **STEP1},
                                                                      {"step": 2, **STEP2}]
    with Tracker(_cfg(tmp_path, "jsonl")) as t:  # a fresh run starts the file anew
        t.log(STEP2, 1)
    assert [json.loads(x) for x in path.read_text().splitlines()] == [{"step": 1, **STEP2}]


def test_console_line(tmp_path, capsys):
    with Tracker(_cfg(tmp_path, "console")) as t:
        t.log({"critic/score/mean": 0.123456, "training/global_step": 3, "val": None}, 3)
    assert capsys.readouterr().out == "step:3 - critic/score/mean:0.1235 - training/global_step:3 - val:None\n"
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_tensorboard_writes_scalar_events(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracker(_cfg(tmp_path, "tensorboard", "jsonl")) as t:
        t.log(STEP1, 1)
        t.log({**STEP2, "note": "text"}, 2)
    tb = tmp_path / "run" / "tensorboard"
    assert list(tb.glob("events.out.tfevents.*"))
    ea = EventAccumulator(str(tb))
    ea.Reload()
    assert sorted(ea.Tags()["scalars"]) == ["actor/grad_norm", "critic/score/mean", "timing_s/step",
                                            "training/global_step"]  # numbers only; null and text skipped
    assert [(e.step, e.value) for e in ea.Scalars("critic/score/mean")] == [(1, 0.25), (2, 0.5)]
    assert [(e.step, e.value) for e in ea.Scalars("actor/grad_norm")] == [(2, 0.75)]


def test_missing_tensorboard_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    with pytest.raises(ImportError, match=r"pip install 'rollplex\[tensorboard\]'"):
        Tracker(_cfg(tmp_path, "jsonl", "tensorboard"))


def test_missing_wandb_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install 'rollplex\[wandb\]'"):
        Tracker(_cfg(tmp_path, "wandb"))


def test_wandb_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network, no account
    monkeypatch.setenv("WANDB_SILENT", "true")
    with Tracker(_cfg(tmp_path, "wandb", hparams={"lr": 1e-3})) as t:
        t.log(STEP1, 1)
        t.log(STEP2, 2)
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    [record] = runs[0].glob("run-*.wandb") if len(runs) == 1 else []
    assert b"critic/score/mean" in record.read_bytes()  # the history rows are in the run's record file
