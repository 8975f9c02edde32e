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


def test_step_bench_compares_serial_sharing_and_cosched(tiny_dir, capsys, tmp_path):
    from rollplex.bench import step

    trace = tmp_path / "trace.json"
    step.main(["--preset", f"{tiny_dir}/config.json", "--workloads", "w3b-tail", "--trace", str(trace), *STEP_ARGS,
               "--new-tokens", "24"])
    rows = _rows(capsys)
    ours = [r for r in rows if r["bench"] == "step" and r["workload"] == "w3b-tail"]
    steps = [(r["vision"], r["step"], r["mode"]) for r in ours]
    # per vision setting, the warm-up step (every mode) runs before the timed one
    modes = ("serial", "rollplex", "cosched")
    assert steps == [(v, s, m) for v in ("trained", "frozen") for s in ("cold", "timed") for m in modes]
    by = {(r["vision"], r["step"], r["mode"]): r for r in ours}
    summaries = [r for r in rows if r["bench"] == "step_summary"]
    assert [(s["vision"], s["step"]) for s in summaries] == [(v, s) for v in ("trained", "frozen")
                                                             for s in ("cold", "timed")]
    for s in summaries:
        assert s["movable_s"] > 0 and s["gen_s"] > 0 and s["cosched_gen_s"] > 0
        for mode in ("serial", "rollplex", "cosched"):
            r = by[(s["vision"], s["step"], mode)]
            gen = s["cosched_gen_s"] if mode == "cosched" else s["gen_s"]
            assert s[mode] == pytest.approx(gen + r["ref_plus_update_s"], abs=2e-3)
        # same update in every mode (fp32: sharing and co-scheduling change where work runs, not what)
        g = [by[(s["vision"], s["step"], m)]["grad_norm"] for m in ("serial", "rollplex", "cosched")]
        assert g[1] == pytest.approx(g[0], rel=1e-4, abs=1e-6) and g[2] == pytest.approx(g[0], rel=1e-4, abs=1e-6)
    check = [r for r in rows if r["bench"] == "step_check"][0]
    assert check["cosched_grad_norm"] == pytest.approx(check["serial_grad_norm"], rel=1e-4, abs=1e-6)
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("args", {}).get("name") == "decode" for e in events if e["ph"] == "M")


def test_step_bench_without_warm_up_times_the_first_step(tiny_dir, capsys):
    from rollplex.bench import step

    step.main(["--preset", f"{tiny_dir}/config.json", "--workloads", "w3b-video", "--no-warm", "--vision", "trained",
               "--modes", "serial,rollplex", *STEP_ARGS])
    rows = _rows(capsys)
    assert [r["step"] for r in rows if r["bench"] == "step" and r["workload"] == "w3b-video"] == ["first", "first"]
    (summary,) = [r for r in rows if r["bench"] == "step_summary"]
    assert summary["step"] == "first" and summary["serial"] > summary["gen_s"] and "cosched" not in summary


def test_memory_bench_runs_steps_under_the_manager(capsys):
    from rollplex.bench import memory

    memory.main(["--workloads", "tiny", "--device", "cpu", "--no-compile", "--micro-prompts", "1"])
    rows = _rows(capsys)
    steps = [r for r in rows if r.get("micro_batch_prompts") is not None]
    assert steps and all(r["micro_batch_prompts"] == 1 for r in steps)
