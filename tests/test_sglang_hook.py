"""The SGLang backend's runtime logic, against a fake SGLang with the real one's shape (tests/fake_sglang,
whose shape test_sglang_contract.py checks against the contract).

- the hooked Scheduler: the hook is called once per decode launch in both event loops, before
  (on_decode_step) and after (after_decode_launch) the launch, with SGLang's batch size and waiting
  count; prefill batches are not decode steps and break the decode period; timing from device events
- control RPCs through handle_rpc_request: results and errors in files, unknown ops refused
- the scheduler-process shim in a spawned process (what SGLang does): the child runs the hooked class,
  builds the hook itself, and answers the Engine subclass's RPCs
- the memory adapter's release/resume/refresh sequence; the co-scheduler hook on the tiny model (CPU)
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import pytest
import torch

from engine_patches.sglang import contract
from engine_patches.sglang.driver import HookDriver, result_path
from engine_patches.sglang.engine import make_engine_class
from engine_patches.sglang.memory import SGLangMemoryAdapter, hf_named_tensors
from engine_patches.sglang.scheduler_patch import bind_hook, make_hooked_scheduler, run_patched_scheduler_process
from engine_patches.sglang.spec import HookSpec
from engine_patches.sglang.timing import StepTimer
from rollplex.memory import Ledger, PhasePlan

FAKE = Path(__file__).resolve().parent / "fake_sglang"
SCRIPT = [("EXTEND", 4, 3, 5.0), ("DECODE", 4, 3, 2.0), ("DECODE", 4, 2, 3.0), ("DECODE", 4, 2, 4.0),
          ("EXTEND", 2, 0, 7.0), ("DECODE", 6, 0, 5.0), ("DECODE", 6, 0, 6.0), ("MIXED", 6, 0, 1.0),
          ("DECODE", 5, 0, 2.0)]
DECODES = [x for x in SCRIPT if x[0] == "DECODE"]


@pytest.fixture
def fake_sglang(monkeypatch):
    """tests/fake_sglang on sys.path (and so in spawned children); its modules are forgotten afterwards."""
    before = set(sys.modules)
    monkeypatch.syspath_prepend(str(FAKE))
    import sglang.srt.managers.scheduler as sched

    yield sched
    for name in set(sys.modules) - before:
        if name == "sglang" or name.startswith("sglang.") or name == "recording_hook":
            del sys.modules[name]


class FakeDevice:
    """Simulated GPU clock: batches advance it; events record it and complete at once."""

    def __init__(self):
        self.t = 0.0


class FakeEvent:
    def __init__(self, device, done=True):
        self.device, self.t, self.done, self.stream = device, None, done, None

    def record(self, stream=None):
        self.t, self.stream = self.device.t, stream

    def query(self):
        return self.done

    def elapsed_time(self, end):
        return end.t - self.t


def _run(sched_mod, loop: str, spec=None, clock=None, log=None, device=None):
    cls = make_hooked_scheduler(sched_mod.Scheduler, spec, clock=clock or (lambda: (None, None)))
    s = cls({"loop": loop, "script": SCRIPT, "log": log if log is not None else [], "device": device}, None)
    s.run_event_loop()
    return s


@pytest.mark.parametrize("module", ["sglang.srt.managers.mm_schedule", "sglang.srt.managers.mm_utils"])
def test_flushing_caches_also_drops_the_vision_encodings(fake_sglang, monkeypatch, module):
    """A weight update flushes through Scheduler.flush_cache; the patched one also empties SGLang's
    multimodal embedding cache (where the release keeps it), so a repeated image is encoded by the new
    tower, and leaves it when SGLang did not flush (requests queued)."""
    import types

    class Cache:
        def __init__(self):
            self.items = {1: "encoding by the old tower"}

        def clear(self):
            self.items.clear()

    mod = types.ModuleType(module)
    mod.embedding_cache = Cache()
    monkeypatch.setitem(sys.modules, module, mod)
    log = []
    s = _run(fake_sglang, "normal", log=log)
    s.waiting_queue = ["queued"]
    assert s.flush_cache() is False and mod.embedding_cache.items
    s.waiting_queue = []
    assert s.flush_cache(empty_cache=False) is True and not mod.embedding_cache.items
    assert log[-2:] == [("flush_cache", False), ("flush_cache", True)]


# ---- the hooked scheduler in both event loops ------------------------------------------------------
@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_hook_is_called_once_per_decode_launch_in_both_loops(fake_sglang, loop):
    log = []
    spec = HookSpec("recording_hook:Recorder", {"log": log})
    s = _run(fake_sglang, loop, spec, log=log)
    hook = s.rollplex.hook
    assert type(s).__name__ == "RollplexScheduler" and isinstance(s, fake_sglang.Scheduler)
    # every batch launched exactly once, in order; each decode launch bracketed by the two hook calls
    calls, step = [], 0
    for mode, size, _, _ in SCRIPT:
        if mode == "DECODE":
            calls += [("on", step), ("launch", mode, size), ("after", step)]
            step += 1
        else:
            calls.append(("launch", mode, size))
    assert log == calls
    assert [i.step for i in hook.infos] == list(range(len(DECODES)))
    assert [i.batch_size for i in hook.infos] == [x[1] for x in DECODES]
    assert [i.num_waiting for i in hook.infos] == [x[2] for x in DECODES]
    want_stream = "forward-stream" if loop == "overlap" else None  # overlap: SGLang's forward stream
    assert all(i.stream == want_stream for i in hook.infos)
    assert all(i.last_step_ms is None and i.last_period_ms is None for i in hook.infos)  # no device: no timing
    assert s.rollplex.steps == len(DECODES) and s.rollplex.other_batches == len(SCRIPT) - len(DECODES)


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_decode_steps_are_timed_and_periods_never_span_a_prefill(fake_sglang, loop):
    device = FakeDevice()
    spec = HookSpec("recording_hook:Recorder")
    s = _run(fake_sglang, loop, spec, clock=lambda: ((lambda: FakeEvent(device)), lambda: "current"), device=device)
    infos = s.rollplex.hook.infos
    ms = [x[3] for x in DECODES]  # each decode step's GPU time
    assert [i.last_step_ms for i in infos] == [None, *ms[:-1]]
    # step k's period (end of k-1 to end of k) is reported at step k+1; steps 0, 3 and 5 follow a
    # non-decode batch (EXTEND, EXTEND, MIXED), so they have none
    assert [i.last_period_ms for i in infos] == [None, None, ms[1], ms[2], None, ms[4]]
    assert infos[0].stream == ("forward-stream" if loop == "overlap" else "current")
    assert s.rollplex.metrics()["rollplex/sglang_last_decode_ms"] == ms[-1]


def test_step_timer_reads_steps_in_order_and_only_once_complete():
    device = FakeDevice()
    events = []

    def make():
        events.append(FakeEvent(device, done=False))
        return events[-1]

    t = StepTimer(make)
    for step, ms in enumerate([2.0, 3.0, 4.0]):
        t.start(step, "s")
        device.t += ms
        t.stop()
        if step == 1:
            t.break_before(2)
    t.poll()
    assert t.last_step_ms is None and t.in_flight == 3  # nothing complete: nothing read, nothing waited for
    events[1].done = True  # step 0's end; step 1's not yet
    t.poll()
    assert (t.last_step_ms, t.last_period_ms, t.in_flight) == (2.0, None, 2)
    for e in events:
        e.done = True
    t.poll()
    assert (t.last_step_ms, t.last_period_ms, t.in_flight) == (4.0, None, 0)  # step 2 follows a break
    assert all(e.stream == "s" for e in events)
    off = StepTimer(None)
    off.start(0)
    off.stop()
    off.poll()
    assert (off.last_step_ms, off.enabled) == (None, False)


def test_the_hook_is_built_in_the_scheduler_and_validated():
    with pytest.raises(ValueError, match="package.module:callable"):
        HookSpec("recording_hook.Recorder")
    with pytest.raises(ValueError, match="picklable"):
        HookSpec("recording_hook:Recorder", {"log": lambda: None})
    spec = HookSpec("recording_hook:Recorder", {"log": []})
    assert pickle.loads(pickle.dumps(bind_hook(spec))).keywords["hook_spec"] == spec
    assert pickle.loads(pickle.dumps(bind_hook(spec))).func is run_patched_scheduler_process


def test_a_spec_that_builds_no_hook_fails_at_scheduler_start(fake_sglang):
    with pytest.raises(TypeError, match="no on_decode_step"):
        _run(fake_sglang, "normal", HookSpec("recording_hook:NoHook"))


# ---- control RPCs ------------------------------------------------------------------------------------
def _rpc(sched, out, **params):
    from sglang.srt.managers.io_struct import RpcReqInput

    reply = sched.handle_rpc_request(RpcReqInput(method=contract.RPC_METHOD, parameters={"out_path": out, **params}))
    with open(result_path(out, 0)) as f:
        return reply, json.load(f)


def test_rpcs_reach_the_hook_with_results_and_errors_in_files(fake_sglang, tmp_path):
    s = _run(fake_sglang, "normal", HookSpec("recording_hook:Recorder"))
    reply, res = _rpc(s, str(tmp_path / "a"), op="start_admission", tag="r1")
    assert reply.success and res == {"ok": True, "result": {"tag": "r1"}} and s.rollplex.hook.started == "r1"
    reply, res = _rpc(s, str(tmp_path / "b"), op="metrics")
    assert reply.success and res["result"]["rollplex/sglang_decode_steps"] == len(DECODES)
    assert res["result"]["steps"] == list(range(len(DECODES)))
    reply, res = _rpc(s, str(tmp_path / "c"), op="update_weights", weights_path="/nowhere")
    assert not reply.success and "no weights at /nowhere" in reply.message
    assert res == {"ok": False, "error": "ValueError: no weights at /nowhere"}
    reply, res = _rpc(s, str(tmp_path / "d"), op="shutdown")
    assert not reply.success and "unknown control op 'shutdown'" in res["error"]
    reply, res = _rpc(s, str(tmp_path / "e"), op="stop_admission")  # the recorder has no such method
    assert not reply.success and "needs a hook with a method stop_admission()" in res["error"]


def test_without_a_hook_decode_is_still_counted(fake_sglang, tmp_path):
    s = _run(fake_sglang, "overlap")
    assert s.rollplex.hook is None and s.rollplex.steps == len(DECODES)
    reply, res = _rpc(s, str(tmp_path / "m"), op="metrics")
    assert reply.success and res["result"]["rollplex/sglang_decode_steps"] == len(DECODES)
    reply, res = _rpc(s, str(tmp_path / "s"), op="start_admission")
    assert not reply.success and "has no hook" in res["error"]


def test_shim_swaps_the_scheduler_in_its_process_once(fake_sglang, monkeypatch):
    import multiprocessing as mp

    monkeypatch.setattr(fake_sglang, "Scheduler", fake_sglang.Scheduler)  # restored afterwards
    reader, writer = mp.Pipe(duplex=False)
    args = ({"loop": "normal", "script": SCRIPT}, None, 0, 0, 0, None, writer)
    sched = run_patched_scheduler_process(*args, hook_spec=HookSpec("recording_hook:Recorder"))
    assert reader.recv()["scheduler_class"] == "RollplexScheduler"
    assert sched.rollplex.steps == len(DECODES) and len(sched.rollplex.hook.infos) == len(DECODES)
    with pytest.raises(RuntimeError, match="already runs"):
        run_patched_scheduler_process(*args)


# ---- the Engine subclass over a spawned scheduler process -------------------------------------------
@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_engine_runs_the_hooked_scheduler_in_its_spawned_process(fake_sglang, loop):
    import os

    from sglang.srt.entrypoints.engine import Engine

    cls = make_engine_class(Engine)
    assert cls.run_scheduler_process_func is run_patched_scheduler_process
    engine = cls(hook_spec=HookSpec("recording_hook:Recorder"), loop=loop)
    try:
        assert engine.scheduler_info["scheduler_class"] == "RollplexScheduler"
        assert engine.call("start_admission", tag="r1") == {"tag": "r1"}
        assert engine.run_script(SCRIPT)[0] == "done"
        m = engine.hook_metrics()
        assert m["pid"] == engine.scheduler_info["pid"] != os.getpid()  # built in the scheduler process
        assert m["started"] == "r1" and m["steps"] == list(range(len(DECODES)))
        assert m["batch_sizes"] == [x[1] for x in DECODES]
        assert m["rollplex/sglang_decode_steps"] == len(DECODES)
        assert m["calls"] == [[k, i] for i in range(len(DECODES)) for k in ("on", "after")]
        with pytest.raises(RuntimeError, match="failed in the scheduler: ValueError: no weights at x"):
            engine.call("update_weights", weights_path="x")
        with pytest.raises(ValueError, match="str, int, float, bool or None"):
            engine.call("start_admission", tag=["not", "flat"])
        assert os.listdir(engine.rollplex_dir) == []  # result files are consumed
    finally:
        engine.shutdown()


def test_engine_without_a_hook_keeps_the_class_shim(fake_sglang):
    from sglang.srt.entrypoints.engine import Engine

    engine = make_engine_class(Engine)(loop="normal")
    try:
        assert "run_scheduler_process_func" not in vars(engine)
        assert engine.scheduler_info["scheduler_class"] == "RollplexScheduler"
        engine.run_script(SCRIPT)
        assert engine.hook_metrics()["rollplex/sglang_decode_steps"] == len(DECODES)
        with pytest.raises(RuntimeError, match="has no hook"):
            engine.stop_admission()
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="HookSpec"):
        make_engine_class(Engine)(hook_spec="recording_hook:Recorder")


# ---- memory ------------------------------------------------------------------------------------------
class RecordingEngine:
    def __init__(self):
        self.calls = []

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tuple(tags)))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tuple(tags)))

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update", tuple(n for n, _ in named_tensors), flush_cache))


def test_memory_adapter_maps_phases_to_sglang_tags_and_refuses_stale_weights():
    eng, ledger = RecordingEngine(), Ledger()
    mem = SGLangMemoryAdapter(eng, bucket_bytes=3 * 4 * 4, ledger=ledger)
    mem.enter("rollout")
    assert eng.calls == []
    mem.enter("ref")
    mem.enter("update")
    assert eng.calls == [("release", ("weights", "kv_cache", "cuda_graph"))]
    with pytest.raises(RuntimeError, match="refresh_weights"):
        mem.enter("rollout")
    named = [(f"w{i}", torch.zeros(4)) for i in range(5)]  # 16 bytes each, 48 per bucket
    assert mem.refresh_weights(named) == 2
    mem.enter("rollout")
    assert eng.calls[1:] == [("resume", ("weights",)), ("update", ("w0", "w1", "w2"), False),
                             ("update", ("w3", "w4"), True), ("resume", ("kv_cache", "cuda_graph"))]
    assert "memory/pause_s/sglang/weights+kv_cache+cuda_graph" in ledger.metrics()
    with pytest.raises(ValueError, match="named tensors"):
        mem.refresh_weights([])
    with pytest.raises(ValueError, match="unknown phase"):
        mem.enter("train")


def test_memory_adapter_follows_the_plan_and_weight_backup():
    eng = RecordingEngine()
    mem = SGLangMemoryAdapter(eng, plan=PhasePlan.all_resident(), release_weights=False)
    assert [mem.released_in(p) for p in ("rollout", "ref", "update")] == [(), (), ()]
    mem.enter("ref")
    mem.enter("rollout")  # nothing released and no update: the weights are current
    assert eng.calls == []
    eng = RecordingEngine()
    mem = SGLangMemoryAdapter(eng, weights_cpu_backup=True)
    mem.enter("ref")
    mem.enter("rollout")  # released with a host backup, no update in between: no refresh needed
    assert eng.calls == [("release", ("weights", "kv_cache", "cuda_graph")),
                         ("resume", ("weights", "kv_cache", "cuda_graph"))]


def test_hf_named_tensors_are_what_sglang_loads(tiny_dir):
    from rollplex.models import load_model

    names = dict(hf_named_tensors(load_model(tiny_dir)))
    assert any(n.endswith(".self_attn.q_proj.weight") for n in names)
    assert any(n.endswith(".mlp.gate_proj.weight") for n in names)
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)


# ---- the co-scheduler as a scheduler hook (CPU, tiny model) -----------------------------------------
def test_cosched_hook_admits_beside_decode_and_hands_over_exact_prefixes(tiny_dir, proc, tmp_path):
    from engine_patches.sglang import tensor_ipc
    from engine_patches.sglang.cosched_hook import CoschedHook, received_rows
    from rollplex.data import row_to_inputs
    from rollplex.models import load_model
    from rollplex.tiny import shape_color

    eager = dict(slowdown_bound=0.9, baseline_samples=1, initial_budget=50.0, max_chunk_ms=1e6, max_in_flight=2,
                 serial_after=1000, reprobe_every=0, job_prompts=2)
    hook = CoschedHook(ref_path=str(tiny_dir), policy_path=str(tiny_dir), dtype="float32", config=eager, device="cpu")
    prompts = [row_to_inputs(proc, r) for r in shape_color.make_rows(3, seed=5)]
    path = tmp_path / "prompts.pkl"
    tensor_ipc.dump(prompts, path)
    assert hook.start_admission(str(path)) == {"prompts": 3, "jobs": 4}
    with pytest.raises(RuntimeError, match="already runs"):
        hook.start_admission(str(path))
    device = FakeDevice()
    driver = HookDriver(hook, StepTimer(lambda: FakeEvent(device)))
    for _ in range(6):  # decode steps of 4 ms: periods let the controller admit chunks
        info = driver.before_decode(4, 0)
        device.t += 4.0
        driver.after_decode(info)
    m = hook.stop_admission()
    assert m["rollplex/cosched_chunks"] > 0 and m["rollplex/prefix_hidden_s"] > 0
    assert hook.metrics() == m
    out = hook.export_prefix_states(str(tmp_path / "states.pkl"))
    assert out["consumers"] == ["old", "ref"]
    rows = received_rows(tensor_ipc.load(tmp_path / "states.pkl"))
    model = load_model(tiny_dir).eval()
    with torch.no_grad():
        want = model.prefix(prompts)
    for key in ("ref", "old"):
        got = rows[key].select([2, 0, 1]).gather()
        for layer in range(len(want.keys)):
            for i, j in enumerate([2, 0, 1]):
                n = int(want.lens[j])
                torch.testing.assert_close(got.keys[layer][i, :, :n], want.keys[layer][j, :, :n], rtol=0, atol=1e-6)
        torch.testing.assert_close(got.last_hidden, want.last_hidden[[2, 0, 1]], rtol=0, atol=1e-6)
    with pytest.raises(RuntimeError, match="release_prefix_states"):
        hook.start_admission(str(path))
    hook.release_prefix_states()
    # the policy copy takes the trainer's weights by name
    new = {n: p.detach() + 1.0 for n, p in model.named_parameters() if n.endswith("norm.weight")}
    tensor_ipc.dump(new, tmp_path / "w.pkl")
    assert hook.update_weights(str(tmp_path / "w.pkl")) == {"updated": len(new)}
    got = dict(hook.policy.named_parameters())
    assert all(torch.equal(got[n], t) for n, t in new.items())
    assert hook.export_weights("ref", str(tmp_path / "ref.pkl")) == {"tensors": len(list(model.parameters()))}
    ref = tensor_ipc.load(tmp_path / "ref.pkl")
    assert all(torch.equal(ref[n], p) for n, p in model.named_parameters())
    with pytest.raises(ValueError, match="no 'critic' model"):
        hook.export_weights("critic", str(tmp_path / "x.pkl"))
    tensor_ipc.dump({"nope.weight": torch.zeros(1)}, tmp_path / "bad.pkl")
    with pytest.raises(ValueError, match="unknown parameters"):
        hook.update_weights(str(tmp_path / "bad.pkl"))
    with pytest.raises(ValueError, match="ref_path"):
        CoschedHook()


def test_cuda_tensors_sent_from_an_sglang_process_load_without_sglang(monkeypatch):
    """In SGLang's processes torch's reduce_tensor names the device by UUID through sglang's own rebuild
    function; what they send (prefix states, exported weights) must load in a process without sglang."""
    from types import SimpleNamespace

    from torch.multiprocessing import reductions

    from engine_patches.sglang import tensor_ipc

    uuids = ["GPU-aaaa", "GPU-bbbb"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=uuids[i]))
    args = ("cls", (2, 3), (3, 1), 0, "storage", torch.float32, 1, b"handle", 24, 0, False, b"rc", 0, None, False)

    def sglang_reduce(t):  # what sglang's patch leaves as the original: its rebuild replaced the module's
        return reductions.rebuild_cuda_tensor, args

    monkeypatch.setattr(reductions, "_reduce_tensor_original", sglang_reduce, raising=False)
    fn, sent = tensor_ipc._reduce_cuda(torch.zeros(1))
    assert fn is tensor_ipc._rebuild_cuda and sent[6] == "GPU-bbbb" and sent[:6] + sent[7:] == args[:6] + args[7:]
    assert b"sglang.srt" not in pickle.dumps((fn, sent)) and b"engine_patches.sglang.tensor_ipc" in pickle.dumps(fn)

    got = []
    monkeypatch.delattr(reductions, "_reduce_tensor_original")
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *a: got.append(a) or "tensor")
    assert tensor_ipc._rebuild_cuda(*sent) == "tensor" and got == [args]  # the UUID back to this process's index
    with pytest.raises(RuntimeError, match="no visible CUDA device has UUID GPU-cccc"):
        tensor_ipc._rebuild_cuda(*sent[:6], "GPU-cccc", *sent[7:])
    # where torch is unpatched (this process sending), torch's own pair is used unchanged
    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: ("torch-rebuild", args))
    assert tensor_ipc._reduce_cuda(torch.zeros(1)) == ("torch-rebuild", args)


def test_renamed_server_arguments_go_under_the_release_name():
    from engine_patches.sglang.engine import server_args_for

    newer = {"model_path", "cuda_graph_max_bs_decode"}
    older = {"model_path", "cuda_graph_max_bs"}
    assert server_args_for({"model_path": "m", "cuda_graph_max_bs": 64}, newer) == \
        {"model_path": "m", "cuda_graph_max_bs_decode": 64}
    assert server_args_for({"cuda_graph_max_bs_decode": 64}, older) == {"cuda_graph_max_bs": 64}
    assert server_args_for({"cuda_graph_max_bs": 64}, older) == {"cuda_graph_max_bs": 64}
    assert server_args_for({"cuda_graph_max_bs": 64}, None) == {"cuda_graph_max_bs": 64}
    with pytest.raises(ValueError, match="one argument"):
        server_args_for({"cuda_graph_max_bs": 64, "cuda_graph_max_bs_decode": 32}, newer)


def test_the_engine_starts_sglang_with_the_renamed_argument():
    seen = {}

    class Engine:
        def __init__(self, **kwargs):
            seen.update(kwargs)

    make_engine_class(Engine, {"model_path", "cuda_graph_max_bs_decode"})(model_path="m", cuda_graph_max_bs=8)
    assert seen == {"model_path": "m", "cuda_graph_max_bs_decode": 8}


def test_server_argument_names_of_each_release_shape():
    import dataclasses

    from engine_patches.sglang.engine import server_arg_names

    @dataclasses.dataclass
    class Older:  # 0.5.7 / 0.5.17: a dataclass
        model_path: str = ""
        cuda_graph_max_bs: int | None = None

    class Newer:  # 0.5.23: a msgspec Struct, its fields in __struct_fields__
        __struct_fields__ = ("model_path", "cuda_graph_max_bs_decode")

    assert server_arg_names(Older) == {"model_path", "cuda_graph_max_bs"}
    assert server_arg_names(Newer) == {"model_path", "cuda_graph_max_bs_decode"}
    assert server_arg_names(type("Unknown", (), {})) is None
