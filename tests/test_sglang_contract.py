"""SGLang's contract, checked against the real releases' source without running SGLang.

A session fixture downloads each checked release's wheel (`pip download --no-deps`, kept in pytest's
cache across runs) and extracts the files the contract names; nothing of SGLang is imported. Then:
every CONTRACT entry holds in each release; the check fails when a relied-on name is broken; the fake
SGLang the hook tests use has the same shape; the patch touches nothing the contract leaves out; and the
/generate fields the server mirrors are the contract's.

The download needs PyPI: without it the tests fail, unless ROLLPLEX_OFFLINE=1 (then they skip).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from sglang_sources import _cache_dir

from engine_patches.sglang import check, contract, plugin
from engine_patches.sglang.check import FetchError, check_sources, fetch_wheel, reader
from engine_patches.sglang.contract import CHECKED_VERSIONS, CONTRACT, MIN_VERSION
from rollplex import backends

ROOT = Path(__file__).resolve().parents[1]
FAKE = Path(__file__).resolve().parent / "fake_sglang"


def test_real_sglang_has_every_name_the_patch_relies_on(sglang_source):
    version, root = sglang_source
    assert root.name.startswith(f"sglang-{version}-")
    problems = check_sources(reader(root), version=version)
    assert problems == [], f"SGLang {version} breaks the contract:\n" + "\n".join(problems)
    # entries that hold only from a later release are the ones this release fails
    later = [e for e in CONTRACT if not e.applies_to(version)]
    assert len(check_sources(reader(root), later)) == len(later)
    # read, never imported: SGLang's runtime needs CUDA and its own torch
    assert not any(m == "sglang" or m.startswith("sglang.") for m in sys.modules)


def _edited(read, file: str, old: str, new: str):
    def r(f):
        text = read(f)
        if f == file:
            assert old in text, f"{old!r} not in {file}"
            return text.replace(old, new)
        return text
    return r


@pytest.mark.parametrize("file,old,new,expect", [
    (contract.SCHEDULER, "def run_batch(", "def run_batch_v2(", "no run_batch"),
    (contract.SCHEDULER, "func(**recv_req.parameters)", "func(recv_req.parameters)", "does not call **parameters"),
    (contract.ENGINE, "run_scheduler_process_func: Callable", "scheduler_func: Callable",
     "no class attribute run_scheduler_process_func"),
    (contract.CONSTANTS, 'GPU_MEMORY_TYPE_KV_CACHE = "kv_cache"', 'GPU_MEMORY_TYPE_KV_CACHE = "kv"',
     "expected 'kv_cache'"),
    (contract.FORWARD, "def is_decode(self)", "def is_decoding(self)", "no is_decode"),
], ids=["method", "rpc-dispatch", "class-attr", "constant", "forward-mode"])
def test_check_reports_a_broken_name(sglang_source, file, old, new, expect):
    _, root = sglang_source
    entries = [e for e in CONTRACT if e.file == file]
    assert check_sources(reader(root), entries) == []
    problems = check_sources(_edited(reader(root), file, old, new), entries)
    assert any(expect in p for p in problems), problems


def test_check_reports_a_missing_file(tmp_path):
    problems = check_sources(reader(tmp_path))
    assert len(problems) == len(CONTRACT) and all("is missing" in p for p in problems)


def test_check_cli(sglang_source, capsys, request, tmp_path_factory):
    version, _ = sglang_source
    cache = _cache_dir(request.config, tmp_path_factory)
    assert check.main([version, "--cache", str(cache)]) == 0
    held = sum(e.applies_to(version) for e in CONTRACT)
    assert f"sglang {version}: all {held} contract entries that apply to it hold" in capsys.readouterr().out


def test_fetch_failure_says_why(tmp_path, monkeypatch):
    def failing(version, dest, extra=()):
        return subprocess.CompletedProcess([], 1, "", "ERROR: No matching distribution found for sglang==9.9.9")

    monkeypatch.setattr(check, "_pip_download", failing)
    with pytest.raises(FetchError, match="No matching distribution"):
        fetch_wheel("9.9.9", tmp_path)


# ---- the fake SGLang and the patch against the table -----------------------------------------------
FAKE_SCOPES = {"Engine", "Scheduler", "run_scheduler_process", "ForwardMode", "ScheduleBatch", "RpcReqInput",
               "RpcReqOutput"}


def test_fake_sglang_has_the_contract_shape():
    entries = [e for e in CONTRACT if e.scope.split(".")[0] in FAKE_SCOPES and e.kind != "absent"]
    assert len(entries) >= 20 and any(e.names[0] == "generate" for e in entries)
    problems = check_sources(reader(FAKE), entries)
    assert problems == [], "\n".join(problems)


def _names(kinds: tuple[str, ...], scope: str) -> set[str]:
    out = set()
    for e in CONTRACT:
        if e.kind in kinds and e.scope == scope:
            out |= {e.names[0]} if e.kind == "method" else set(e.names)
    return out


def _params(scope: str, method: str) -> set[str]:
    return {p for e in CONTRACT if e.kind == "method" and e.scope == scope and e.names[0] == method
            for p in e.names[1:]}


def _class_in(path: Path, name: str) -> ast.ClassDef:
    tree = ast.parse(path.read_text())
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def _own(cls: ast.ClassDef) -> set[str]:
    """Methods the class defines and names it assigns (in its body or on self)."""
    out = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    for n in ast.walk(cls):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    out.add(t.attr)
                elif isinstance(t, ast.Name):
                    out.add(t.id)
    return out


def _base_uses(cls: ast.ClassDef) -> dict[str, set[str]]:
    """{"self": attrs read on self but not its own, "super": methods called on super(), "batch.<x>": ...}"""
    own = _own(cls)
    uses: dict[str, set[str]] = {"self": set(), "super": set(), "batch": set(), "forward_mode": set()}
    for n in ast.walk(cls):
        if not isinstance(n, ast.Attribute):
            continue
        v = n.value
        if isinstance(v, ast.Name) and v.id == "self" and n.attr not in own:
            uses["self"].add(n.attr)
        elif isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
            uses["super"].add(n.attr)
        elif isinstance(v, ast.Name) and v.id == "batch":
            uses["batch"].add(n.attr)
        elif isinstance(v, ast.Attribute) and v.attr == "forward_mode":
            uses["forward_mode"].add(n.attr)
    return uses


def test_scheduler_patch_touches_only_contract_names():
    cls = _class_in(ROOT / "engine_patches/sglang/scheduler_patch.py", "RollplexScheduler")
    uses = _base_uses(cls)
    scheduler = _names(("method", "self_attr"), "Scheduler")
    assert uses["self"] and uses["self"] <= scheduler, uses["self"] - scheduler
    assert uses["super"] <= scheduler | {"__init__"}, uses["super"] - scheduler
    assert uses["batch"] <= _names(("method", "fields"), "ScheduleBatch")
    assert uses["forward_mode"] <= _names(("method",), "ForwardMode")
    assert "run_batch" in uses["super"] and "is_decode" in uses["forward_mode"]
    assert {contract.RPC_METHOD, contract.DRIVER_ATTR} <= _own(cls)


def test_engine_patch_and_memory_adapter_touch_only_contract_names():
    engine = _names(("method", "class_attr"), "Engine")
    cls = _class_in(ROOT / "engine_patches/sglang/engine.py", "RollplexEngine")
    uses = _base_uses(cls)
    assert uses["self"] <= engine and "collective_rpc" in uses["self"], uses["self"] - engine
    assert "run_scheduler_process_func" in _own(cls) & engine
    assert uses["super"] <= engine, uses["super"] - engine
    # the adapter calls SGLang's Engine with keyword arguments named as the contract lists
    tree = ast.parse((ROOT / "engine_patches/sglang/memory.py").read_text())
    seen = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Attribute) \
                and n.func.value.attr == "engine":
            seen.add(n.func.attr)
            assert n.func.attr in engine
            assert {k.arg for k in n.keywords} <= _params("Engine", n.func.attr), n.func.attr
    for n in ast.walk(tree):  # fn(tags=...) on a method taken from self.engine
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "engine":
            seen.add(n.attr)
            assert n.attr in engine
    assert {"release_memory_occupation", "resume_memory_occupation", "update_weights_from_tensor"} <= seen
    assert "tags" in _params("Engine", "release_memory_occupation")
    assert tuple(sorted(contract.MEMORY_TAGS)) == tuple(sorted(
        e.value for e in CONTRACT if e.kind == "constant" and e.names[0].startswith("GPU_MEMORY_TYPE_")))


def test_rollout_backend_touches_only_contract_names():
    """The rollout backend calls SGLang's Engine only by contract names, with contract keywords; its
    requests use contract sampling names; it starts SGLang with the contract's server arguments."""
    engine = _names(("method",), "Engine")
    called, read = _engine_uses("backend.py", "self.engine")
    assert called == {"generate", "shutdown"} and called <= engine
    assert read - called == set()  # generate_groups is RemoteEngine's, looked up with getattr
    called, read = _engine_uses("groups.py", "engine")
    assert called == {"async_generate"} and called <= engine
    assert read - called == {"loop"} and read - called <= _names(("self_attr",), "Engine")
    assert _params("Engine", "async_generate") == _params("Engine", "generate")
    from engine_patches.sglang.outputs import generate_kwargs, sampling_dict
    from rollplex.engine import SamplingParams

    assert set(generate_kwargs([], [], [])) - {"image_data"} <= _params("Engine", "generate")  # and async_generate
    assert "image_data" in _params("Engine", "generate")
    assert set(sampling_dict(SamplingParams(stop=["x"], stop_token_ids=[1]), 0)) == set(contract.ROLLOUT_SAMPLING)
    assert set(contract.ROLLOUT_SAMPLING) <= set(contract.SAMPLING_FIELDS)
    tree = ast.parse((ROOT / "engine_patches/sglang/plugin.py").read_text())
    start = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "rollout")
    started = next(n for n in ast.walk(start) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                   and n.func.id == "engine_cls")
    assert {k.arg for k in started.keywords} - {None, "hook_spec"} == set(contract.MANAGED_SERVER_ARGS)


def _engine_uses(file: str, receiver: str) -> tuple[set[str], set[str]]:
    """(methods called on, attributes read from) `receiver` ("self.engine", "engine") in a patch file."""
    tree = ast.parse((ROOT / "engine_patches/sglang" / file).read_text())
    on = lambda n: ast.unparse(n.value) == receiver  # noqa: E731
    called = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
              and on(n.func)}
    read = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and on(n)}
    return called, read


def test_engine_process_touches_only_contract_names():
    """The engine process drives SGLang's Engine (RollplexEngine) by contract names and builds the weight
    update request with the contract's fields, as Engine.update_weights_from_tensor does."""
    engine = _names(("method",), "Engine") | {"call"}  # call: RollplexEngine's own
    tree = ast.parse((ROOT / "engine_patches/sglang/engine_process.py").read_text())
    funcs = {id(c.func) for c in ast.walk(tree) if isinstance(c, ast.Call)}
    called, read = set(), set()
    for n in ast.walk(tree):  # the engine is `e` in the OPS table, `engine` elsewhere
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in ("e", "engine"):
            (called if id(n) in funcs else read).add(n.attr)
    assert {"generate", "release_memory_occupation", "resume_memory_occupation", "collective_rpc", "call",
            "shutdown"} <= called <= engine, called - engine
    assert read <= _names(("self_attr",), "Engine") | {"server_args"}, read
    assert {"loop", "tokenizer_manager"} <= read
    update = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "update_weights")
    req = next(n for n in ast.walk(update) if isinstance(n, ast.Call) and ast.unparse(n.func) ==
               "UpdateWeightsFromTensorReqInput")
    fields = next(e.names for e in CONTRACT if e.scope == "UpdateWeightsFromTensorReqInput")
    assert {k.arg for k in req.keywords} == set(fields)
    mirrored = next(e.names for e in CONTRACT if e.scope == "Engine.update_weights_from_tensor")
    assert {ast.unparse(c.func) for c in ast.walk(update) if isinstance(c, ast.Call)} >= {
        "UpdateWeightsFromTensorReqInput", "engine.tokenizer_manager.update_weights_from_tensor",
        "engine.loop.run_until_complete"} == {m.replace("self.", "engine.") for m in mirrored}


def test_server_generate_fields_are_the_contracts():
    """The /generate fields and sampling parameters rollplex/server accepts are exactly those checked."""
    from rollplex.server import schemas

    generate = set(schemas.GenerateRequest.model_fields) | set(schemas.NEUTRAL_GENERATE) | set(schemas.IGNORED_GENERATE)
    assert generate == set(contract.GENERATE_FIELDS)
    sampling = (set(schemas.SGLangSamplingParams.model_fields) - {"seed"}) | {"sampling_seed"} \
        | set(schemas.NEUTRAL_SAMPLING) | set(schemas.IGNORED_SAMPLING)
    assert sampling == set(contract.SAMPLING_FIELDS)


def test_contract_table():
    assert MIN_VERSION == CHECKED_VERSIONS[0]
    assert list(CHECKED_VERSIONS) == sorted(CHECKED_VERSIONS, key=contract.release_tuple)
    assert len({(e.kind, e.file, e.scope, e.names) for e in CONTRACT}) == len(CONTRACT)
    with pytest.raises(AssertionError):
        contract.Relied("method", "sglang/nowhere.py", "X", ("y",), "z")


# ---- backend selection ---------------------------------------------------------------------------
def test_backend_selection():
    assert backends.BackendConfig().rollout_backend == "native"
    assert backends.check_backend("sglang") == "sglang"
    assert backends.plugin("sglang") is plugin and backends.require_backend("native") is None
    with pytest.raises(ValueError, match="native"):
        backends.BackendConfig(rollout_backend="vllm")


def test_sglang_missing_or_old_names_the_install_command(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    with pytest.raises(ImportError, match=r"pip install 'rollplex\[sglang\]'"):
        plugin.engine_class()
    with pytest.raises(ImportError, match=r"pip install 'rollplex\[sglang\]'"):
        backends.require_backend("sglang")
    monkeypatch.setattr(metadata, "version", lambda name: "0.5.6.post2")
    with pytest.raises(ImportError, match=r"older than 0\.5\.7.*rollplex\[sglang\]"):
        plugin.require()
    monkeypatch.setattr(metadata, "version", lambda name: "0.5.23")
    assert plugin.require() == "0.5.23" and backends.require_backend("sglang") == "0.5.23"
    # installed by its metadata but not importable here (no SGLang runtime on this machine)
    with pytest.raises(ImportError, match=r"does not import.*rollplex\[sglang\]"):
        plugin.engine_class()
