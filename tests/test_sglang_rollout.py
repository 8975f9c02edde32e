"""The SGLang rollout backend wired into the RL step, the server and the driver, against the fake SGLang
(tests/fake_sglang: SGLang's shape; it generates with Rollplex's engine over its own copy of the
checkpoint, so a policy that is not copied in after an update samples from stale weights there).

- the output adapter: one request per sample with seeds s + j, image prompts as processor_output items;
  SGLang's answers as RequestOutputs, and the answers it refuses
- RLStep with the SGLang backend takes the same steps as with the native engine (tokens, logprobs,
  losses, updated weights), SGLang's copy of the policy follows each update, phases release and
  resume SGLang's memory by the plan, a loaded checkpoint is copied in
- the server with --rollout-backend sglang serves /rollout and /train_step (/generate is a 400)
- without SGLang the backend fails before anything is served, naming the install command; bad settings
"""

from __future__ import annotations

import random
import sys
from importlib import metadata
from pathlib import Path

import httpx
import pytest
import torch
from helpers import FORWARD_TERMS, assert_fp32_close, assert_weights_close
from server_helpers import wire_rows

from engine_patches.sglang import contract
from engine_patches.sglang.backend import SGLangRollout
from engine_patches.sglang.outputs import generate_kwargs, request_outputs, sample_seeds
from rollplex import backends
from rollplex.backends import BackendConfig
from rollplex.data import row_to_inputs
from rollplex.engine import Engine, EngineConfig, SamplingParams
from rollplex.memory import MemoryConfig, MemoryManager, PhasePlan
from rollplex.models import ModelInputs, load_model
from rollplex.rl.config import RLConfig
from rollplex.rl.step import RLStep, rollout_requests
from rollplex.tiny import shape_color

FAKE = Path(__file__).resolve().parent / "fake_sglang"
ROOT = Path(__file__).resolve().parents[1]
ROWS = shape_color.make_rows(4, seed=3)
BASE = dict(n=3, max_new_tokens=6, lr=1e-3, kl_coef=0.05, micro_batch_prompts=2, micro_batch_samples=4)


@pytest.fixture
def fake_sglang(monkeypatch):
    """tests/fake_sglang on sys.path: SGLang 'installed' (its dist-info) and importable, here and in the
    processes it spawns; its modules are forgotten afterwards."""
    before = set(sys.modules)
    monkeypatch.syspath_prepend(str(FAKE))
    yield
    for name in set(sys.modules) - before:
        if name == "sglang" or name.startswith("sglang.") or name in ("recording_hook", "tiny_runtime"):
            del sys.modules[name]


@pytest.fixture
def no_sglang(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)


def _native(tiny_dir, proc, **cfg) -> RLStep:
    model = load_model(tiny_dir)
    engine = Engine(model, proc, EngineConfig(max_num_seqs=64, max_model_len=256))
    return RLStep(model, engine, RLConfig(**{**BASE, **cfg}), proc, reward_fn="shape_color")


def _sglang(tiny_dir, proc, memory=None, memory_cfg=None, backend: BackendConfig | None = None, **cfg) -> RLStep:
    model = load_model(tiny_dir)
    rollout = backends.rollout_backend(backend or BackendConfig("sglang"), str(tiny_dir), proc, "float32", seed=0)
    return RLStep(model, rollout, RLConfig(**{**BASE, **cfg}), proc, reward_fn="shape_color", memory=memory,
                  memory_cfg=memory_cfg)


def _varied(batch, prompt_ids):
    """Scores that vary within each group (non-zero advantages), from (prompt, sample j of its group) alone:
    the same whichever groups the batch holds."""
    group = batch.group.tolist()
    j = [k - group.index(g) for k, g in enumerate(group)]
    return torch.tensor([float((prompt_ids[g] + jj) % 3 == 0) for g, jj in zip(group, j)]), {}


def _weights(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---- the output adapter ------------------------------------------------------------------------------
def test_requests_are_one_per_sample_with_the_native_seeds(proc):
    text = ModelInputs([5, 6, 7])
    image = row_to_inputs(proc, ROWS[0])
    params = [SamplingParams(n=2, seed=10, max_new_tokens=5, stop=["x"]), SamplingParams(n=3, seed=20, top_k=4)]
    kw = generate_kwargs([text, image], params, sample_seeds(params, random.Random(0)))
    assert set(kw) == {"input_ids", "image_data", "sampling_params", "return_logprob"} and kw["return_logprob"]
    assert kw["input_ids"] == [[5, 6, 7]] * 2 + [image.input_ids] * 3  # prompt-major, placeholders expanded
    assert [sp["sampling_seed"] for sp in kw["sampling_params"]] == [10, 11, 20, 21, 22]
    assert all(sp["n"] == 1 for sp in kw["sampling_params"])
    assert all(set(sp) <= set(contract.ROLLOUT_SAMPLING) for sp in kw["sampling_params"])
    assert kw["sampling_params"][0]["stop"] == ["x"] and kw["sampling_params"][2]["top_k"] == 4
    assert kw["image_data"][:2] == [None, None]
    item = kw["image_data"][2]
    assert item["format"] == "processor_output" and torch.equal(item["image_grid_thw"], image.image_grid_thw)
    assert torch.equal(item["pixel_values"], image.pixel_values) and item["pixel_values"].device.type == "cpu"
    assert kw["image_data"][3] is item and kw["image_data"][4] is item  # one item per prompt, sent once
    assert "image_data" not in generate_kwargs([text], params[:1], [[1, 2]])
    unseeded = [SamplingParams(n=3)]
    seeds = sample_seeds(unseeded, random.Random(1))[0]
    assert seeds[1] == seeds[0] + 1 and seeds != sample_seeds(unseeded, random.Random(2))[0]
    video = ModelInputs([1, 2], pixel_values_videos=torch.zeros(4, 8), video_grid_thw=torch.tensor([[2, 2, 2]]))
    with pytest.raises(ValueError, match="video prompts"):
        generate_kwargs([video], params[:1], [[1, 2]])


def _answer(ids, reason, prompt_tokens=3, lps=None, text="sglang text"):
    lps = lps if lps is not None else [(-0.5 - i, t, None) for i, t in enumerate(ids)]
    return {"text": text, "output_ids": ids,
            "meta_info": {"id": "r", "prompt_tokens": prompt_tokens, "finish_reason": reason,
                          "output_token_logprobs": lps, "completion_tokens": len(ids), "cached_tokens": 0}}


def test_answers_become_request_outputs():
    prompts = [ModelInputs([1, 2, 3]), ModelInputs([4, 5, 6])]
    params = [SamplingParams(n=2, stop=["!"]), SamplingParams(n=1)]
    raw = [_answer([7, 2], {"type": "stop", "matched": 2}),
           _answer([8, 9, 9], {"type": "stop", "matched": "!"}),
           _answer([10, 11], {"type": "length", "length": 2},
                   lps=[(-1.0, 10, "a"), (-2.0, 11, "b"), (-3.0, 12, "c")])]  # extra logprobs past the stop: cut
    outs = request_outputs(prompts, params, raw, request_ids=["a", "b"])
    assert [o.request_id for o in outs] == ["a", "b"] and outs[0].prompt_token_ids == [1, 2, 3]
    s0, s1 = outs[0].samples
    assert (s0.token_ids, s0.logprobs, s0.finish_reason, s0.matched_stop) == ([7, 2], [-0.5, -1.5], "stop", 2)
    assert (s1.finish_reason, s1.matched_stop, s1.text) == ("stop", "!", "sglang text")
    t = outs[1].samples[0]
    assert (t.token_ids, t.logprobs, t.finish_reason, t.matched_stop) == ([10, 11], [-1.0, -2.0], "length", None)
    # with a processor Rollplex decodes, as the native engine does, and cuts the answer at a matched stop string
    decoded = request_outputs(prompts, params, raw, decode=lambda ids, skip: "ab!cd" if 8 in ids else "x")
    assert decoded[0].samples[1].text == "ab" and decoded[0].samples[0].text == "x"


@pytest.mark.parametrize("raw,match", [
    (_answer([7], {"type": "stop", "matched": 2}, prompt_tokens=5), "counted 5 prompt tokens"),
    (_answer([7, 8], {"type": "length", "length": 2}, lps=[(-1.0, 7, None), (-1.0, 9, None)]), "token for token"),
    (_answer([7, 8], {"type": "length", "length": 2}, lps=[(-1.0, 7, None)]), "token for token"),
    (_answer([7], None), "not a finished request"),
    ({"output_ids": [7], "meta_info": {"prompt_tokens": 3, "finish_reason": {"type": "length"}}}, "no output_token"),
    ([], "0 outputs for 1 requests"),
], ids=["prompt-length", "other-token", "short-logprobs", "unfinished", "no-logprobs", "count"])
def test_answers_that_do_not_fit_are_refused(raw, match):
    with pytest.raises(RuntimeError, match=match):
        request_outputs([ModelInputs([1, 2, 3])], [SamplingParams()], raw if isinstance(raw, list) else [raw])


# ---- the RL step ------------------------------------------------------------------------------------
def test_sglang_backend_takes_the_native_steps(fake_sglang, tiny_dir, proc):
    native, sgl = _native(tiny_dir, proc), _sglang(tiny_dir, proc)
    be = sgl.backend
    assert (native.rollout_backend, sgl.rollout_backend, sgl.engine) == ("native", "sglang", None)
    runtime = be.engine.runtime  # the fake's own copy of the policy
    try:
        for step in range(2):
            a, b = native.rollout(ROWS), sgl.rollout(ROWS)
            # SGLang sampled from the policy as it is now: copied in after the previous update
            assert all(torch.equal(p, q) for p, q in zip(runtime.model.parameters(), sgl.model.parameters()))
            assert torch.equal(a.responses, b.responses) and torch.equal(a.mask, b.mask)
            assert torch.equal(a.group, b.group) and a.num_samples == 12
            assert_fp32_close(b.rollout_logprobs, a.rollout_logprobs, "rollout logprobs", FORWARD_TERMS)
            assert b.extras["texts"] == a.extras["texts"]
            assert b.extras["finish_reasons"] == a.extras["finish_reasons"]
            rewards = torch.tensor([float((i + step) % 3 == 0) for i in range(a.num_samples)])
            a.rewards, b.rewards = rewards, rewards.clone()
            w0 = _weights(native.model)
            ma, mb = native.train(a), sgl.train(b)
            for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/advantages/mean"):
                assert_fp32_close(mb[k], ma[k], k, scale=1.0)  # means of O(1) terms that may cancel
            assert ma["actor/grad_norm"] > 0
            moved = 0.0
            for (name, wa), wb in zip(_weights(native.model).items(), _weights(sgl.model).values()):
                moved = max(moved, float((wa - w0[name]).abs().max()))
                assert_weights_close(wb, wa, name)
            assert moved > 1e-4  # the step changed the policy, so step 2 samples from other weights
        assert be.weight_pushes == 2  # before the first rollout, and once after the first update
        kinds = [c[0] for c in be.engine.memory_calls]
        # first push; ref releases weights, KV cache, graphs; the rollout resumes the weights, copies the
        # update in, then resumes the KV cache and graphs; the second step releases again
        assert kinds[:6] == ["update", "release", "resume", "update", "resume", "release"]
        assert be.engine.memory_calls[1][1] == ["weights", "kv_cache", "cuda_graph"]
        assert be.engine.memory_calls[4][1] == ["kv_cache", "cuda_graph"]
        # the hooked scheduler in SGLang's scheduler process counted the rollouts' decode steps
        assert be.engine.hook_metrics()["rollplex/sglang_decode_steps"] >= 2 * 5
    finally:
        be.close()


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer\.step\(\)`")
def test_fused_on_sglang_trains_groups_as_they_finish(fake_sglang, tiny_dir, proc, tail):
    """SGLang reports each prompt's group as its samples finish (one batch request per prompt, answered in
    the order of their lengths): the fused schedule trains the first groups while the others still
    decode, in finishing order, and updates the policy as the phased step does."""
    lengths = [3, 9, 5, 12]  # the groups answer in the order 0, 2, 1, 3 (0 first and 3 last on a busy machine)
    runs = []
    for schedule in ("phased", "fused"):
        rl = _sglang(tiny_dir, proc, schedule=schedule, lr=1e-4)
        try:
            prompts, params, per_prompt = rollout_requests(rl.processor, ROWS, rl.cfg, rl.step_idx)
            params = [SamplingParams(n=p.n, max_new_tokens=k, seed=p.seed, ignore_eos=True)
                      for p, k in zip(params, lengths)]
            w0 = _weights(rl.model)
            batch, m = rl.run(prompts, params, rewards=_varied, **per_prompt)
            runs.append((batch, m, w0, _weights(rl.model)))
        finally:
            rl.backend.close()
    (phased, mp, w0, wp), (fused, mf, _, wf) = runs
    assert mf["rollplex/fused"] == 1.0 and mf["rollplex/fused_groups"] == 4
    assert mf["rollplex/fused_groups_in_rollout"] >= 2  # trained while the other groups still decoded
    order = fused.finish_order()  # groups answered together are reported in prompt order
    assert sorted(order) == [0, 1, 2, 3] and order[0] == 0 and order[-1] == 3
    assert torch.equal(fused.responses, phased.responses) and torch.equal(fused.rewards, phased.rewards)
    assert_fp32_close(mf["actor/pg_loss"], mp["actor/pg_loss"], "pg_loss", scale=1.0)
    assert max(float((wp[n] - w0[n]).abs().max()) for n in w0) > 1e-5  # the step moved the policy
    for name in wp:
        assert_weights_close(wf[name], wp[name], name)


def test_phases_follow_the_memory_plan_and_report_transitions(fake_sglang, tiny_dir, proc):
    mm = MemoryManager(PhasePlan.releases_only(), backend="accounting")
    rl = _sglang(tiny_dir, proc, memory=mm, memory_cfg=MemoryConfig(memory_plan="release"))
    be = rl.backend
    try:
        assert rl.memory_sizes()["kv_cache"] == 0  # SGLang's KV cache is in its own pool
        m = rl.step(ROWS)
        assert mm.plan.get("ref", "kv_cache") != "resident"
        assert be.memory_adapter.released == {"weights", "kv_cache", "cuda_graph"} and mm.current == "update"
        assert any(k.startswith("memory/pause_s/sglang/") for k in m), sorted(m)
        rl.sample([ModelInputs([5, 6, 7])], [SamplingParams(max_new_tokens=2, seed=1)])
        assert be.memory_adapter.released == set() and mm.current == "rollout" and be.weight_pushes == 2
    finally:
        be.close()
    mm = MemoryManager(PhasePlan.releases_only(), backend="accounting")
    kept = BackendConfig("sglang", sglang_release_weights=False)
    rl = _sglang(tiny_dir, proc, memory=mm, memory_cfg=MemoryConfig(memory_plan="resident"), backend=kept)
    try:
        rl.step(ROWS)
        assert rl.backend.engine.memory_calls[1:] == []  # everything stays resident: only the first copy
    finally:
        rl.backend.close()


def test_the_step_plans_into_what_sglang_left_of_the_device(fake_sglang, tiny_dir, proc, monkeypatch):
    """SGLang's processes take their share of the device when they start (measured as the device's free memory
    before and after); the step's memory plan fits into the rest, unless the operator gave the capacity."""
    from engine_patches.sglang import plugin as sgl_plugin

    free = iter([40 << 30, 30 << 30])  # SGLang took 10 GiB
    monkeypatch.setattr(sgl_plugin, "_device_free", lambda: next(free))
    mm = MemoryManager(PhasePlan.releases_only(), backend="accounting", capacity=64 << 30)
    rl = _sglang(tiny_dir, proc, memory=mm, memory_cfg=MemoryConfig(memory_plan="auto"))
    try:
        assert rl.backend.device_bytes == 10 << 30
        assert rl.memory_fit.capacity == 54 << 30
    finally:
        rl.backend.close()
    free = iter([40 << 30, 30 << 30])
    mm = MemoryManager(PhasePlan.releases_only(), backend="accounting", capacity=64 << 30)
    rl = _sglang(tiny_dir, proc, memory=mm, memory_cfg=MemoryConfig(memory_plan="auto", device_capacity_gib=20))
    try:
        assert rl.memory_fit.capacity == 20 << 30  # given: kept as is
    finally:
        rl.backend.close()


def test_checkpoint_load_copies_the_policy_in(fake_sglang, tiny_dir, proc, tmp_path):
    from rollplex.rl.run_state import load_checkpoint, save_checkpoint

    rl = _sglang(tiny_dir, proc)
    be = rl.backend
    try:
        batch = rl.rollout(ROWS)
        save_checkpoint(rl, tmp_path / "ck")
        batch.rewards = torch.tensor([float(i % 2) for i in range(batch.num_samples)])
        rl.train(batch)
        pushes = be.weight_pushes
        load_checkpoint(rl, tmp_path / "ck")
        assert be.weight_pushes == pushes + 1
        assert all(torch.equal(p, q) for p, q in zip(be.engine.runtime.model.parameters(), rl.model.parameters()))
    finally:
        be.close()


def test_backend_refusals(fake_sglang, tiny_dir, proc):
    rl_cfg = RLConfig(**BASE, cosched=True)
    rollout = backends.rollout_backend(BackendConfig("sglang"), str(tiny_dir), proc, "float32")
    try:
        with pytest.raises(ValueError, match="cosched needs the native rollout backend"):
            RLStep(load_model(tiny_dir), rollout, rl_cfg, proc)
        with pytest.raises(RuntimeError, match="no policy attached"):  # SGLang's copy is stale until attached
            rollout.generate([ModelInputs([5, 6])], [SamplingParams(max_new_tokens=2)])
    finally:
        rollout.close()
    image = row_to_inputs(proc, ROWS[0])
    old = SGLangRollout(engine=None, version="0.5.7")
    with pytest.raises(ValueError, match=r"image prompts need SGLang >= 0\.5\.17"):
        old.generate([image], [SamplingParams()])
    assert SGLangRollout(engine=None, version="0.5.17").image_prompts
    assert SGLangRollout(engine=None, version="0.5.23.post1").image_prompts
    assert not SGLangRollout(engine=None, version="0.5.16").image_prompts


# ---- the server and the driver -----------------------------------------------------------------------
def _server_config(tiny_dir, tmp_path, backend="sglang"):
    from rollplex.server import ServerConfig

    return ServerConfig(model=str(tiny_dir), device="cpu", checkpoint_root=str(tmp_path / "ck"),
                        rl=RLConfig(n=2, lr=1e-3, kl_coef=0.05, max_new_tokens=4, micro_batch_prompts=4),
                        engine=EngineConfig(max_model_len=256, kv_cache_tokens=4096, max_num_seqs=64),
                        backend=BackendConfig(rollout_backend=backend))


def test_server_serves_rollout_and_train_step_on_sglang(fake_sglang, tiny_dir, tmp_path):
    from rollplex.server import serve_in_thread

    with serve_in_thread(_server_config(tiny_dir, tmp_path)) as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as c:
        health = c.get("/health").json()
        assert health["rollout_backend"] == "sglang" and health["engine"] is None
        c0 = c.get("/checksum").json()["weights_checksum"]
        ro = c.post("/rollout", json={"prompts": wire_rows(2), "n": 3})
        assert ro.status_code == 200, ro.text
        ro = ro.json()
        assert ro["rollout_id"] and ro["num_samples"] == 6 and ro["weights_version"] == 0
        assert [s["prompt_index"] for s in ro["samples"]] == [0, 0, 0, 1, 1, 1]
        s = ro["samples"][0]
        assert len(s["token_ids"]) == len(s["logprobs"]) >= 1 and s["finish_reason"]["type"] in ("stop", "length")
        m = c.post("/train_step", json={"rollout_id": ro["rollout_id"], "rewards": [1, 0, 0, 0, 1, 0]})
        assert m.status_code == 200, m.text
        assert m.json()["training/global_step"] == 1 and m.json()["actor/grad_norm"] > 0
        assert c.get("/checksum").json()["weights_checksum"] != c0
        val = c.post("/rollout", json={"prompts": [{"input_ids": [5, 6, 7]}], "n": 2, "for_training": False,
                                       "sampling_params": {"temperature": 0, "max_new_tokens": 3}})
        assert val.status_code == 200 and val.json()["rollout_id"] is None and val.json()["weights_version"] == 1
        backend = srv.state.rl.backend
        assert backend.weight_pushes == 2  # the trained policy went to SGLang before the second rollout
        assert all(torch.equal(p, q) for p, q in zip(backend.engine.runtime.model.parameters(),
                                                     srv.state.model.parameters()))
        gen = c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert gen.status_code == 400 and "--rollout-backend" in gen.json()["error"]["message"]
        mem = c.get("/memory").json()
        assert mem["regions"]["kv_cache"] == 0 and mem["kv_cache_blocks"] is None
        assert mem["rollout_backend"] == "sglang"
        assert "rollplex_engine_waiting" not in c.get("/metrics").text
    assert not backend.engine.proc.is_alive()  # stopping the server shut SGLang down


def test_rollout_intake_on_sglang_is_dropped_when_the_client_leaves(fake_sglang, tiny_dir, tmp_path, heavy_encode):
    """The backend's /rollout prepares its prompts on the fair intake threads as the native path does: a
    client that leaves stops the prompts not started yet, and the server serves the next client."""
    import time

    from rollplex.server import serve_in_thread

    started = heavy_encode
    heavy = [{"prompt": [{"role": "user", "content": f"HEAVY {i}"}]} for i in range(16)]
    cfg = _server_config(tiny_dir, tmp_path)
    with serve_in_thread(cfg) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/rollout", json={"prompts": heavy, "n": 2}, timeout=0.4)
        time.sleep(0.25 * 16 + 0.5)  # all 16 would have run by now, even one after another
        # started before the client left at 0.4 s: two rounds of the intake threads at most
        assert len(started) <= 2 * cfg.intake_threads < 16, len(started)
        ro = c.post("/rollout", json={"prompts": wire_rows(1), "n": 2})
        assert ro.status_code == 200, ro.text


def test_without_sglang_the_backend_fails_before_serving(no_sglang, tiny_dir, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"needs SGLang .*pip install 'rollplex\[sglang\]'"):
        _server_config(tiny_dir, tmp_path)
    import uvicorn

    from rollplex import system
    from rollplex.server import __main__ as cli

    def never(*a, **k):
        raise AssertionError("nothing may be loaded or served")

    monkeypatch.setattr(uvicorn, "run", never)
    monkeypatch.setattr(system, "load_policy", never)
    with pytest.raises(SystemExit, match=r"rollplex\.server: .*pip install 'rollplex\[sglang\]'"):
        cli.main(["--rollout-backend", "sglang", "--device", "cpu"])
    with pytest.raises(ImportError, match=r"pip install 'rollplex\[sglang\]'"):
        backends.rollout_backend(BackendConfig("sglang"), str(tiny_dir))
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_grpo", ROOT / "examples" / "train_grpo.py")
    driver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver)
    with pytest.raises(SystemExit, match=r"train_grpo: .*pip install 'rollplex\[sglang\]'"):
        driver.main(["--rollout-backend", "sglang", "--device", "cpu", "--steps", "1",
                     "--log-dir", str(tmp_path / "log")])
    with pytest.raises(SystemExit) as e:  # a remote server's backend is its own
        driver.parse_args(["--server", "http://127.0.0.1:1", "--rollout-backend", "sglang"])
    assert e.value.code == 2


@pytest.mark.parametrize("kw,match", [
    (dict(rollout_backend="vllm"), "must be one of"),
    (dict(sglang_mem_fraction_static=1.0), "sglang_mem_fraction_static"),
    (dict(sglang_mem_fraction_static=0.0), "sglang_mem_fraction_static"),
    (dict(sglang_weight_bucket_mb=0), "sglang_weight_bucket_mb"),
    (dict(sglang_args="{bad json"), "JSON object"),
    (dict(sglang_args="[1, 2]"), "JSON object, got list"),
    (dict(sglang_args='{"model_path": "/x", "tp_size": 1}'), r"cannot set \['model_path'\]"),
], ids=["backend", "fraction-1", "fraction-0", "bucket", "json", "not-object", "managed"])
def test_backend_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        BackendConfig(**kw)


def test_backend_flags(monkeypatch):
    from rollplex.server.__main__ import config_from_args, parser

    monkeypatch.delenv("ROLLPLEX_API_KEY", raising=False)
    ap = parser()
    assert config_from_args(ap.parse_args(["--device", "cpu"])).backend == BackendConfig()
    args = ap.parse_args(["--device", "cpu", "--sglang-mem-fraction-static", "0.6", "--no-sglang-release-weights",
                          "--sglang-args", '{"attention_backend": "fa3"}'])
    cfg = config_from_args(args)
    assert cfg.backend == BackendConfig(sglang_mem_fraction_static=0.6, sglang_release_weights=False,
                                        sglang_args='{"attention_backend": "fa3"}')
    assert cfg.backend.extra_sglang_args() == {"attention_backend": "fa3"}
    with pytest.raises(SystemExit):
        ap.parse_args(["--rollout-backend", "vllm"])
    with pytest.raises(SystemExit, match="sglang_mem_fraction_static"):
        from rollplex.server.__main__ import main

        main(["--device", "cpu", "--sglang-mem-fraction-static", "1.5"])


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    from rollplex.processor import VLProcessor
    from rollplex.tiny import write_tiny

    out = write_tiny(tmp_path_factory.mktemp("tiny3"), seed=1, family="qwen3_vl")
    return out, VLProcessor.from_pretrained(out)


def test_sglang_backend_rolls_out_qwen3_vl_as_the_native_engine(fake_sglang, tiny_qwen3):
    tiny_dir, proc = tiny_qwen3
    native, sgl = _native(tiny_dir, proc), _sglang(tiny_dir, proc)
    assert type(sgl.model).__name__ == "Qwen3VL"
    be = sgl.backend
    try:
        a, b = native.rollout(ROWS), sgl.rollout(ROWS)
        # the policy went in by its HF names (fused back by the fake as SGLang's loader does)
        assert all(torch.equal(p, q) for p, q in zip(be.engine.runtime.model.parameters(), sgl.model.parameters()))
        assert torch.equal(a.responses, b.responses) and torch.equal(a.mask, b.mask)
        assert_fp32_close(b.rollout_logprobs, a.rollout_logprobs, "rollout logprobs", FORWARD_TERMS)
        assert be.weight_pushes == 1
    finally:
        be.close()
