"""CPU smoke runs of the benchmark tools on the tiny checkpoint: they parse, run and report (their GPU
numbers come from the device runs in docs/BENCHMARKS.md)."""

import json

from rollplex.bench import profile


def test_engine_profile_reports_steps_and_writes_a_trace(tiny_dir, tmp_path, capsys):
    profile.main(["--preset", f"{tiny_dir}/config.json", "--parts", "engine", "--device", "cpu", "--batches", "4",
                  "--trace", str(tmp_path)])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    eng = [r for r in rows if r["bench"] == "engine_profile"]
    assert len(eng) == 1 and eng[0]["batch"] == 4 and eng[0]["period_ms"] > 0
    assert eng[0]["host_top"] and (tmp_path / "engine_b4.json.gz").stat().st_size > 0


def test_layer_bench_runs_and_checks_variants(tiny_dir, capsys):
    from rollplex.bench import layer

    layer.main(["--preset", f"{tiny_dir}/config.json", "--batches", "2", "--variants", "default,autotune"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["variant"] for r in rows] == ["default", "autotune"]
    assert all(r["ms"] > 0 and r["layers"] == 4 for r in rows)
    assert rows[1]["rel_err_vs_default"] == 0.0  # on CPU both run the same eager functions
