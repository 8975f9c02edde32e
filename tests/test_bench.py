"""CPU smoke runs of the benchmark tools on the tiny checkpoint: they parse, run and report what they
claim to (their GPU numbers are in docs/BENCHMARKS.md)."""

import json

import pytest

from rollplex.bench import profile


def _rows(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_engine_profile_reports_steps_and_writes_a_trace(tiny_dir, tmp_path, capsys):
    profile.main(["--preset", f"{tiny_dir}/config.json", "--parts", "engine", "--device", "cpu", "--batches", "4",
                  "--trace", str(tmp_path)])
    eng = [r for r in _rows(capsys) if r["bench"] == "engine_profile"]
    assert len(eng) == 1 and eng[0]["batch"] == 4 and eng[0]["period_ms"] > 0
    assert eng[0]["host_top"] and (tmp_path / "engine_b4.json.gz").stat().st_size > 0


def test_layer_bench_runs_every_variant(tiny_dir, capsys):
    from rollplex.bench import layer

    layer.main(["--preset", f"{tiny_dir}/config.json", "--batches", "2", "--variants", "default,autotune"])
    rows = _rows(capsys)
    assert [r["variant"] for r in rows] == ["default", "autotune"]
    assert all(r["ms"] > 0 and r["layers"] == 4 for r in rows)


STEP_ARGS = ["--device", "cpu", "--no-compile", "--prompts", "2", "--video-prompts", "2", "--n", "2",
             "--new-tokens", "6", "--image-size", "56", "--text-tokens", "8"]


def test_step_bench_times_a_warm_step_after_a_cold_one(tiny_dir, capsys):
    from rollplex.bench import step

    step.main(["--preset", f"{tiny_dir}/config.json", "--workloads", "w3b", *STEP_ARGS])
    rows = _rows(capsys)
    steps = [(r["step"], r["mode"]) for r in rows if r["bench"] == "step" and r["workload"] == "w3b"]
    # the warm-up step (both modes) runs before the timed one
    assert steps == [("cold", "serial"), ("cold", "rollplex"), ("timed", "serial"), ("timed", "rollplex")]
    phase = {(r["step"], r["mode"]): r for r in rows if r["bench"] == "step" and r["workload"] == "w3b"}
    (summary,) = [r for r in rows if r["bench"] == "step_summary"]
    assert summary["warm"] and summary["timed_rollout_differs"]  # a new rollout, not the warm-up's again
    assert summary["gen_s"] > 0 and summary["cold_rollout_s"] > 0
    for prefix, step_name, gen in (("", "timed", summary["gen_s"]), ("cold_", "cold", summary["cold_rollout_s"])):
        for mode in ("serial", "rollplex"):
            r = phase[(step_name, mode)]
            assert 0 < r["ref_s"] + r["update_actor_s"] <= r["ref_plus_update_s"] + 2e-3
            # a step is its rollout plus the mode's scoring + update (each rounded to 1 ms)
            assert summary[f"{prefix}step_{mode}_s"] == pytest.approx(gen + r["ref_plus_update_s"], abs=2e-3)
        ratio = summary[f"{prefix}step_serial_s"] / summary[f"{prefix}step_rollplex_s"]
        assert summary[f"{prefix}speedup"] == pytest.approx(ratio, rel=0.03)
    # same update in both modes on the timed batch (fp32: prefix sharing changes where work runs, not what)
    assert phase[("timed", "serial")]["grad_norm"] == pytest.approx(phase[("timed", "rollplex")]["grad_norm"],
                                                                    rel=1e-4, abs=1e-6)


def test_step_bench_without_warm_up_times_the_first_step(tiny_dir, capsys):
    from rollplex.bench import step

    step.main(["--preset", f"{tiny_dir}/config.json", "--workloads", "w3b-video", "--no-warm", *STEP_ARGS])
    rows = _rows(capsys)
    assert [r["step"] for r in rows if r["bench"] == "step" and r["workload"] == "w3b-video"] == ["first", "first"]
    (summary,) = [r for r in rows if r["bench"] == "step_summary"]
    assert not summary["warm"] and "cold_rollout_s" not in summary and summary["step_serial_s"] > summary["gen_s"]
