"""The algorithm flags' help lists what exists: every estimator, loss, aggregation and KL estimator of
rl/algos.py's menus appears in --help of the server, the demo and the driver, with no option of another
name (the help is made from the menus, so a new option cannot be left out)."""

import argparse
import re

import pytest

from rollplex.rl import algos

MENUS = {"adv_estimator": algos.ADV_ESTIMATORS, "policy_loss": algos.POLICY_LOSSES,
         "loss_agg_mode": algos.AGG_MODES, "kl_loss_type": algos.KL_KINDS, "kl_penalty": algos.KL_KINDS}


def _help_of(ap: argparse.ArgumentParser, flag: str) -> str | None:
    for action in ap._actions:
        if flag in action.option_strings:
            return action.help
    return None


def _parsers():
    from rollplex.demo.train import parser as demo_parser
    from rollplex.server.__main__ import parser as server_parser

    return {"server": server_parser(), "demo": demo_parser()}


def test_the_menus_are_the_help():
    assert algos.ADV_ESTIMATORS == tuple(algos.ADV_ESTIMATOR_HELP) and "remax" in algos.ADV_ESTIMATORS
    for name, ap in _parsers().items():
        for field, options in MENUS.items():
            text = _help_of(ap, "--" + field.replace("_", "-"))
            assert text is not None, (name, field)
            named = set(re.findall(r"([\w+-]+): ", text))  # "name: what" entries
            base = {o for o in options if not o.endswith("+")}
            assert named == base, (name, field, named ^ base)
        assert "remax" in _help_of(ap, "--adv-estimator") and "sapo" in _help_of(ap, "--policy-loss")
        ap.format_help()  # argparse's formatting accepts every text


def test_the_driver_lists_the_menus(monkeypatch, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "train_grpo.py"
    spec = importlib.util.spec_from_file_location("train_grpo_help", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setenv("COLUMNS", "100000")  # no line breaks inside the hyphenated names
    with pytest.raises(SystemExit):
        mod.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for options in (algos.ADV_ESTIMATORS, algos.POLICY_LOSSES, algos.AGG_MODES):
        for o in options:
            assert f"{o}:" in out, o
    assert mod.parse_args(["--adv-estimator", "remax"]).adv_estimator == "remax"
