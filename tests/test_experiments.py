"""CPU smoke runs of the kernel experiments (experiments/kernels) on the tiny checkpoint: they parse, run
and report what they claim to (their GPU numbers are in docs/BENCHMARKS.md)."""

import json

from experiments.kernels import layer, profile


def _rows(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_engine_profile_reports_steps_and_writes_a_trace(tiny_dir, tmp_path, capsys):
    profile.main(["--preset", f"{tiny_dir}/config.json", "--parts", "engine", "--device", "cpu", "--batches", "4",
                  "--trace", str(tmp_path)])
    eng = [r for r in _rows(capsys) if r["bench"] == "engine_profile"]
    assert len(eng) == 1 and eng[0]["batch"] == 4 and eng[0]["period_ms"] > 0
    assert eng[0]["host_top"] and (tmp_path / "engine_b4.json.gz").stat().st_size > 0


def test_layer_bench_runs_every_variant(tiny_dir, capsys):
    layer.main(["--preset", f"{tiny_dir}/config.json", "--batches", "2", "--variants", "default,autotune"])
    rows = _rows(capsys)
    assert [r["variant"] for r in rows] == ["default", "autotune"]
    assert all(r["ms"] > 0 and r["layers"] == 4 for r in rows)
