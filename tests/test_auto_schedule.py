"""schedule="auto": the chooser's decisions (torch-free) and, on the tiny model, a step under it that runs
the arm it picked and equals phased."""

import pytest

from rollplex.rl.auto_schedule import AutoChooser


def _drive(ch: AutoChooser, rate: dict, steps: int, groups: float = 3.0, tokens: float = 1000.0) -> list[str]:
    """Run `steps` steps, each arm taking rate[arm] seconds per token; the arms picked."""
    out = []
    for _ in range(steps):
        arm = ch.pick()
        out.append(arm)
        ch.record(arm, rate[arm] * tokens, tokens, groups if arm == "fused" else None)
    return out


def test_explores_each_arm_after_its_warm_up_then_runs_the_faster():
    ch = AutoChooser(reprobe_steps=8, warmup=1)
    arms = _drive(ch, {"phased": 1.0, "fused": 0.8}, 6)
    assert arms == ["phased", "phased", "fused", "fused", "fused", "fused"]
    ch = AutoChooser(reprobe_steps=8, warmup=1)
    assert _drive(ch, {"phased": 0.8, "fused": 1.0}, 6)[4:] == ["phased", "phased"]


def test_warm_up_steps_are_not_measured():
    """A first step of 100x (compiles) does not make its arm look slow."""
    ch = AutoChooser(reprobe_steps=50, warmup=1)
    ch.record(ch.pick(), 100.0, 1.0)  # phased, cold
    ch.record(ch.pick(), 1.0, 1.0)  # phased, measured
    ch.record(ch.pick(), 100.0, 1.0, 2)  # fused, cold
    ch.record(ch.pick(), 0.9, 1.0, 2)  # fused, measured
    assert ch.best() == "fused" and ch.arms["phased"].ema == 1.0 and ch.arms["fused"].ema == 0.9


def test_a_tie_within_the_margin_runs_phased():
    ch = AutoChooser(reprobe_steps=50, margin=0.02)
    _drive(ch, {"phased": 1.0, "fused": 0.99}, 4)
    assert ch.best() == "phased"
    ch = AutoChooser(reprobe_steps=50, margin=0.02)
    _drive(ch, {"phased": 1.0, "fused": 0.97}, 4)
    assert ch.best() == "fused"


def test_fused_that_trained_no_group_beside_decode_does_not_pay():
    """Every group finished with the rollout (fixed lengths): fused is phased's work plus its overhead."""
    ch = AutoChooser(reprobe_steps=50)
    _drive(ch, {"phased": 1.0, "fused": 0.5}, 4, groups=0.0)
    assert ch.best() == "phased"


def test_re_probes_the_other_arm_and_follows_a_change():
    ch = AutoChooser(reprobe_steps=5, ema=1.0)
    arms = _drive(ch, {"phased": 1.0, "fused": 0.8}, 14)
    # phased last ran at step 2: probed at step 7, then at 12 (one step in five)
    assert arms[4:] == ["fused"] * 2 + ["phased"] + ["fused"] * 4 + ["phased"] + ["fused"] * 2
    arms = _drive(ch, {"phased": 1.0, "fused": 1.3}, 8)  # the workload changed: fused stopped paying
    # the first slow fused step turns it to phased; after that fused runs only as a probe, one step in five
    assert arms[0] == "fused" and arms[1:].count("fused") <= 2 and arms[1] == "phased" and ch.best() == "phased"


def test_an_unavailable_arm_is_never_picked():
    ch = AutoChooser(reprobe_steps=2)
    ch.unavailable("fused")
    assert _drive(ch, {"phased": 1.0, "fused": 0.1}, 6) == ["phased"] * 6


@pytest.mark.parametrize("bad", [dict(reprobe_steps=1), dict(margin=1.0), dict(warmup=-1), dict(ema=0.0)])
def test_bad_settings_raise(bad):
    with pytest.raises(ValueError):
        AutoChooser(**bad)


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer\.step\(\)`")
def test_auto_steps_run_the_picked_schedule_and_equal_phased(tiny_dir, proc, tail):
    """On the tiny model: the first steps explore (phased, then fused after its warm-up step), each reports the
    arm it ran, and a step under auto equals the same step phased."""
    from test_fused_step import _assert_same_step, _run, _step

    from rollplex.rl.config import RLConfig

    with pytest.raises(ValueError, match="auto_reprobe_steps"):
        RLConfig(schedule="auto", auto_reprobe_steps=1)
    auto = _step(tiny_dir, proc, schedule="auto", auto_reprobe_steps=2)
    phased = _step(tiny_dir, proc)
    ran = []
    for i in range(3):
        m_auto = _run(auto)
        ran.append(m_auto[0]["rollplex/auto_fused"])
        m_phased = _run(phased)
        _assert_same_step(m_auto, m_phased, step=i + 1)
    assert ran == [0.0, 0.0, 1.0]
    assert m_auto[0]["rollplex/fused"] == 1.0 and "rollplex/auto_phased_s_per_1k_tokens" in m_auto[0]
