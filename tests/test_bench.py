"""CPU smoke runs of the benchmark tools on the tiny checkpoint: they parse, run and report what they
claim to (their GPU numbers are in docs/BENCHMARKS.md)."""

import json
import math

import pytest


def _rows(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


STEP_ARGS = ["--device", "cpu", "--no-compile", "--prompts", "2", "--video-prompts", "2", "--n", "2",
             "--new-tokens", "6", "--image-size", "56", "--text-tokens", "8"]


def test_step_bench_compares_serial_sharing_and_cosched(tiny_dir, capsys, tmp_path):
    from rollplex.bench import step

    trace = tmp_path / "trace.json"
    step.main(["--preset", f"{tiny_dir}/config.json", "--workloads", "w3b-tail", "--trace", str(trace), *STEP_ARGS,
               "--new-tokens", "24", "--modes", "serial,rollplex,cosched"])
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


def test_step_bench_runs_the_fused_schedule(tiny_dir, capsys, tmp_path):
    from rollplex.bench import step

    trace = tmp_path / "fused.json"
    step.main(["--preset", f"{tiny_dir}/config.json", "--workloads", "w3b-video-tail", "--vision", "frozen",
               "--modes", "rollplex,fused", "--micro-prompts", "1", "--trace", str(trace), *STEP_ARGS,
               "--video-prompts", "3", "--new-tokens", "24", "--fuse-admission", "pays"])
    rows = _rows(capsys)
    check = next(r for r in rows if r["bench"] == "step_check")
    assert check["fused_grad_norm"] == pytest.approx(check["rollplex_grad_norm"], rel=1e-4, abs=1e-6)
    by = {(r["step"], r["mode"], r.get("admission")): r for r in rows
          if r["bench"] == "step" and r["workload"] == "w3b-video-tail"}
    fused = [(s, "fused", "pays") for s in ("cold", "timed")]  # the timed step's gate measured the cold one
    assert set(by) == {(s, "rollplex", None) for s in ("cold", "timed")} | set(fused)
    for s, _, a in fused:  # the same samples, rewards and update on both schedules, whatever the admission
        assert by[(s, "fused", a)]["fused"] == 1.0 and by[(s, "fused", a)]["groups"] == 3
        assert by[(s, "fused", a)]["grad_norm"] == pytest.approx(by[(s, "rollplex", None)]["grad_norm"], rel=1e-4,
                                                                 abs=1e-6)
    summaries = [r for r in rows if r["bench"] == "step_summary" and r["step"] == "timed"]
    assert [r["admission"] for r in summaries] == ["pays"]
    for summary in summaries:
        assert summary["fused"] > summary["fused_gen_s"] > 0 and summary["chunks"] == 3
    events = json.loads(trace.read_text())["traceEvents"]
    lanes = {e.get("args", {}).get("name") for e in events if e["ph"] == "M"}
    assert {"decode", "fused"} <= lanes


def test_step_bench_without_warm_up_times_the_first_step(tiny_dir, capsys):
    from rollplex.bench import step

    step.main(["--preset", f"{tiny_dir}/config.json", "--workloads", "w3b-video", "--no-warm", "--vision", "trained",
               "--modes", "serial,rollplex", *STEP_ARGS])
    rows = _rows(capsys)
    assert [r["step"] for r in rows if r["bench"] == "step" and r["workload"] == "w3b-video"] == ["first", "first"]
    (summary,) = [r for r in rows if r["bench"] == "step_summary"]
    assert summary["step"] == "first" and summary["serial"] > summary["gen_s"] and "cosched" not in summary


def test_step_bench_reports_the_critics_cost(tiny_dir, capsys):
    """PPO with a critic (adv_estimator gae): each mode's row carries the critic's values scoring and update;
    a table sets them side by side. gae runs under the phase-aware plan (the memory flags reach it): here the
    critic and the reference offloaded where they are not read, which the accounting backend poisons, so a
    row that read a region the bench left paused would report a NaN loss."""
    from rollplex.bench import step

    offload = "critic_weights:rollout=offloaded,critic_optimizer:*=offloaded,ref_weights:*=offloaded"
    step.main(["--preset", f"{tiny_dir}/config.json", "--workloads", "w3b", "--no-warm", "--vision", "frozen",
               "--modes", "serial,rollplex", "--adv-estimator", "gae", "--kl-coef", "0.01", "--memory-overrides",
               offload, *STEP_ARGS])
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    setup = next(r for r in rows if r["bench"] == "step_setup")
    assert setup["memory_plan"] == "auto" and setup["memory_backend"] == "accounting"
    ours = [r for r in rows if r["bench"] == "step" and r["workload"] == "w3b"]
    assert [r["mode"] for r in ours] == ["serial", "rollplex"]
    assert all(r["values_s"] > 0 and r["update_critic_s"] > 0 and math.isfinite(r["vf_loss"]) for r in ours)
    assert all(r["memory_plan"] == f"auto + {offload}" and math.isfinite(r["kl_loss"]) for r in ours)
    assert ours[1]["grad_norm"] == pytest.approx(ours[0]["grad_norm"], rel=1e-4)
    (summary,) = [r for r in rows if r["bench"] == "step_summary"]
    assert summary["serial_critic_s"] > 0 and summary["rollplex_critic_s"] > 0
    assert "| serial s (critic s) | rollplex s (critic s) | critic vs serial | memory plan |" in out


def test_step_bench_carries_a_rows_back_off_to_its_next_step(tiny_dir, capsys, monkeypatch):
    """Each row builds its trainer afresh; the micro-batches an out-of-memory back-off halved to on the cold
    step are kept for the timed one, as a training loop's trainer keeps them: it does not fail again."""
    import torch

    from rollplex.bench import step
    from rollplex.rl.critic import ValueModel

    values, ooms = ValueModel.values, []

    def tight(self, mb, mode, packed):
        if torch.is_grad_enabled() and mb.num_prompts > 1:
            ooms.append(mb.num_prompts)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return values(self, mb, mode, packed)

    monkeypatch.setattr(ValueModel, "values", tight)
    step.main(["--preset", f"{tiny_dir}/config.json", "--workloads", "w3b", "--vision", "frozen", "--modes",
               "rollplex", "--adv-estimator", "gae", *STEP_ARGS])
    rows = [r for r in _rows(capsys) if r["bench"] == "step"]
    # the check trains the rollplex row twice: as configured and with one group per pass
    assert [(r["workload"], r["step"]) for r in rows] == [("w3b-check", "check")] * 2 + [("w3b", "cold"),
                                                                                          ("w3b", "timed")]
    assert all(math.isfinite(r["vf_loss"]) for r in rows)
    # 4 -> 2 -> 1 prompts per pass by the check's first trainer and by the cold step's; the timed step kept 1
    assert ooms == [2] * 4


def test_memory_bench_runs_steps_under_the_manager(capsys):
    from rollplex.bench import memory

    memory.main(["--workloads", "tiny", "--device", "cpu", "--no-compile", "--micro-prompts", "1"])
    rows = _rows(capsys)
    steps = [r for r in rows if r.get("micro_batch_prompts") is not None]
    assert steps and all(r["micro_batch_prompts"] == 1 for r in steps)
    setup = next(r for r in rows if r.get("bench") == "memory_setup")
    assert setup["fit"]["measures"] == [] and setup["fit"]["budget_gib"] is None  # CPU: nothing to fit
    with pytest.raises(SystemExit, match="does not fit the device"):  # a device too small: the plan's reasons
        memory.main(["--workloads", "tiny", "--device", "cpu", "--no-compile", "--device-capacity-gib", "0.001"])


# ---- serve --load ---------------------------------------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_rounds_plan_the_servers_memory_for_their_response_length():
    from rollplex.bench.serve import plan_args

    assert plan_args("--kl-coef 0.001", 512) == "--kl-coef 0.001 --max-new-tokens 512"
    assert plan_args("", 64) == "--max-new-tokens 64"
    for given in ("--max-new-tokens 256", "--max-new-tokens=256 --kl-coef 0"):
        assert plan_args(given, 512) == given


def test_serve_load_runs_end_to_end(tiny_dir, capsys, tmp_path, monkeypatch):
    """Cold start, check, the measurements (batched, raw-socket, httpx with a pool of N and the default one,
    the client ceiling against the canned endpoint, streamed), warm start, tables: the server a subprocess
    (the CLI), this process the client."""
    import os
    from pathlib import Path

    from rollplex.bench import serve

    root = str(Path(__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log = tmp_path / "server.log"
    serve.main(["--load", "--model", str(tiny_dir), "--port", str(_free_port()), "--canned-port", str(_free_port()),
                "--prompts", "8", "--prompt-len", "16",
                "--max-new-tokens", "8", "--check-tokens", "4", "--repeats", "1", "--token-range", "10,400",
                "--cache-root", str(tmp_path / "caches"), "--log", str(log),
                "--server-args", "--device cpu --max-num-seqs 8 --kv-cache-tokens 4096 --max-model-len 256"])
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(r["measure"], r.get("start")) for r in rows] == [
        ("ready", "cold"), ("first_request", "cold"), ("check", None), ("batched", None), ("concurrent", None),
        ("httpx", None), ("httpx", None), ("client_ceiling", None), ("streamed", None), ("ready", "warm"),
        ("first_request", "warm")]
    by = {(r["measure"], r.get("start")): r for r in rows}
    pools = [r for r in rows if r["measure"] == "httpx"]
    assert [r["pool"] for r in pools] == [8, "default"]
    for r in pools + [by[("concurrent", None)], by[("client_ceiling", None)]]:
        assert r["requests"] == 8 and r["tok_s"] > 0 and r["ratio_to_batched"] > 0
        assert 0 < r["latency_p50_ms"] <= r["latency_p99_ms"] <= r["wall_s"] * 1e3 + 1  # (wall: whole ms)
    # the canned endpoint answers with one real /generate answer: same bytes, no engine work
    ceiling = by[("client_ceiling", None)]
    assert ceiling["answer_bytes"] > 8 * 2 and ceiling["tok_s"] > by[("httpx", None)]["tok_s"]
    for start in ("cold", "warm"):
        ready = by[("ready", start)]
        phases = ready["server_phases_s"]
        assert list(phases) == ["imports", "weights", "kv_sizing", "tuning", "capture", "engine", "trainer", "ready"]
        # the bench counts from the process start, the server from its CLI's entry
        assert ready["ready_s"] >= phases["ready"] >= phases["imports"] + phases["weights"]
    assert by[("check", None)]["equal"] + by[("check", None)]["near_ties"] == 8
    for m in ("batched", "concurrent", "streamed"):
        assert by[(m, None)]["tokens"] == 8 * 8 and by[(m, None)]["tok_s"] > 0
    streamed = by[("streamed", None)]
    assert 0 < streamed["ttft_p50_ms"] <= streamed["ttft_p99_ms"] <= streamed["wall_s"] * 1e3
    assert by[("concurrent", None)]["ratio_to_batched"] > 0
    assert by[("first_request", "warm")]["same_tokens_as_cold"] == 8  # fp32 on CPU: the same greedy tokens
    assert "time to ready, warm (s)" in out and "TTFT p50 / p99 (ms)" in out
    table = out[out.index("client "):].splitlines()  # the client table is printed last
    assert [line.split("  ")[0] for line in table[1:]] == [
        "one batched /generate (raw socket)", "raw socket, a connection per request", "httpx.AsyncClient, pool 8",
        "httpx.AsyncClient, default pool (100)", "client ceiling: httpx, pool N, canned answer"]
    text = log.read_text()
    assert text.count("startup: ready in") == 2 and "startup: weights loaded in" in text


def test_serve_load_check_fails_on_a_mismatch():
    from rollplex.bench.serve_load import OutputMismatch, check_outputs

    batched = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]

    def no_tie_check(where):
        raise AssertionError("equal outputs need no tie check")

    assert check_outputs(batched, [list(x) for x in batched], 4, no_tie_check, 0.5)["equal"] == 3
    with pytest.raises(OutputMismatch, match="not a near tie"):  # answers routed to the wrong requests
        check_outputs(batched, [batched[1], batched[0], batched[2]], 4, lambda where: [6.0] * len(where), 0.5)
    late = [batched[0], batched[1], [9, 10, 11, 13]]
    summary = check_outputs(batched, late, 4, lambda where: [0.01] * len(where), 0.5)  # a flipped near tie
    assert summary["equal"] == 2 and summary["near_ties"] == 1 and summary["first_difference"] == [3]
    with pytest.raises(OutputMismatch):
        check_outputs(batched, late, 4, lambda where: [2.0] * len(where), 0.5)
    with pytest.raises(OutputMismatch, match="expected 4"):  # an answer cut short
        check_outputs(batched, [batched[0], batched[1], [9, 10, 11]], 4, no_tie_check, 0.5)


def test_serve_load_tie_gaps_are_logprob_differences_given_the_common_context(tiny_dir):
    import asyncio

    import torch

    from rollplex.bench.serve_load import tie_gaps
    from rollplex.engine import EngineConfig
    from rollplex.models import ModelInputs, load_model
    from rollplex.server import ServerConfig, serve_in_thread

    prompt = list(range(10, 26))
    batched, concurrent = [[30, 31, 32], [30, 31, 32]], [[30, 31, 40], [77, 31, 32]]
    engine = EngineConfig(max_model_len=256, kv_cache_tokens=4096, max_num_seqs=8)
    with serve_in_thread(ServerConfig(model=str(tiny_dir), device="cpu", engine=engine)) as srv:
        gaps = asyncio.run(tie_gaps(srv.url, [prompt, prompt], batched, concurrent, [(0, 2), (1, 0)]))
    model = load_model(tiny_dir, "cpu", torch.float32).eval()
    with torch.no_grad():
        late = torch.log_softmax(model([ModelInputs(prompt + [30, 31])])[0, -1].float(), -1)
        first = torch.log_softmax(model([ModelInputs(prompt)])[0, -1].float(), -1)
    expected = [abs(late[32] - late[40]).item(), abs(first[30] - first[77]).item()]
    assert gaps == pytest.approx(expected, abs=1e-4) and min(expected) > 0


def test_step_bench_long_tail_against_packed_and_padded_serial(tiny_dir, capsys):
    """w3b-long-tail: lengths per sample (different within a group, the longest one at the cap); serial rows
    per token budget, packed, and the padded baseline beside them, all agreeing with rollplex."""
    from rollplex.bench import step
    from rollplex.bench.workloads import sample_lengths

    lens = sample_lengths(2, 3, 24, 6, seed=11, sigma_prompt=0.5, sigma_sample=0.5)
    assert max(map(max, lens)) == 24 and all(len(set(g)) > 1 for g in lens), lens
    step.main(["--preset", f"{tiny_dir}/config.json", "--workloads", "w3b-long-tail", "--vision", "frozen",
               "--modes", "serial,serial-padded,rollplex", "--serial-max-tokens", "64,4096", "--long-prompts", "2",
               "--long-n", "3", "--long-new-tokens", "24", "--long-median", "6", "--no-warm", *STEP_ARGS])
    rows = _rows(capsys)
    check = next(r for r in rows if r["bench"] == "step_check")
    for mode in ("serial", "serial-padded"):
        assert math.isclose(check[f"{mode}_grad_norm"], check["rollplex_grad_norm"], rel_tol=1e-4)
    ours = [r for r in rows if r["bench"] == "step" and r["workload"] == "w3b-long-tail"]
    assert [(r["mode"], r["micro_batch_max_tokens"], r["packed"]) for r in ours] == [
        ("serial", 64, True), ("serial", 4096, True), ("serial-padded", None, False), ("rollplex", 32768, True)]
    assert all(r["n"] == 6 and r["gradient_checkpointing"] for r in ours)
    for r in ours[1:]:
        assert math.isclose(r["grad_norm"], ours[0]["grad_norm"], rel_tol=1e-4)
    (summary,) = [r for r in rows if r["bench"] == "step_summary"]
    assert summary["response_tokens"] == sum(map(sum, lens))
    assert summary["serial"] == min(summary["serial_64"], summary["serial_4096"])
    assert summary["serial_max_tokens"] in (64, 4096) and summary["serial_padded"] > summary["gen_s"]


def test_step_check_verdict_flags_a_mode_whose_kl_departs():
    from rollplex.bench.step import check_verdict

    ok = check_verdict({"serial_kl_loss": 8.18e-6, "rollplex_kl_loss": 1.03e-5, "fused_kl_loss": 8.18e-6})
    assert ok.startswith("check: ok")
    bad = check_verdict({"serial_kl_loss": 8.18e-6, "rollplex_kl_loss": 1.31e-3, "fused_kl_loss": 8.18e-6})
    assert bad.startswith("check: MISMATCH") and "rollplex 0.00131" in bad and "fused" not in bad


def test_step_bench_check_only_trains_the_check_rows(tiny_dir, capsys):
    from rollplex.bench import step

    step.main(["--preset", f"{tiny_dir}/config.json", "--workloads", "w3b-tail", "--vision", "frozen", "--modes",
               "serial,rollplex,fused", "--check-only", *STEP_ARGS])
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    steps = [(r["mode"], r["step"]) for r in rows if r["bench"] == "step"]
    assert steps == [("serial", "check"), ("rollplex", "check"), ("rollplex", "check"), ("fused", "check")]
    check = next(r for r in rows if r["bench"] == "step_check")
    assert {"rollplex_one_group_kl_loss", "fused_rollout_probs_diff_max"} <= set(check)
    verdict = next(line for line in out.splitlines() if line.startswith("check:"))
    assert verdict.startswith("check: ok") and "rollplex_one_group" in verdict  # fp32: every mode's KL ~0
