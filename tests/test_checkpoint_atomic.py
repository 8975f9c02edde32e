"""Checkpoints are written atomically and loaded only whole and sound.

/save writes into a temporary folder beside the target, syncs it and renames it over the target: a save
that fails (a full disk, a data_state that cannot round-trip) or a process killed mid-save leaves the old
checkpoint byte for byte. /load checks everything it would apply before applying any of it: weights after
the cast to the live dtype, the optimizer's hyperparameters, flags and moments, the LR scheduler's and the
RNG's state, index files confined to the checkpoint; a failing one is 400 with nothing changed (weights,
optimizer, step, weights version, the retained rollout still trainable on-policy).

One in-process server (the tiny model, CPU, fp32, with a reference model), and the library on its own for
the killed process.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from rollplex.engine import EngineConfig
from rollplex.rl.config import RLConfig
from rollplex.server import ServerConfig, serve_in_thread

REWARDS = [1.0, 0.0, 0.0, 1.0]
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    rl = RLConfig(n=2, lr=1e-3, kl_coef=0.05, max_new_tokens=4, micro_batch_prompts=4, micro_batch_samples=8)
    cfg = ServerConfig(model=str(tiny_dir), device="cpu", rl=rl,
                       engine=EngineConfig(max_model_len=128, kv_cache_tokens=2048, max_num_seqs=16),
                       checkpoint_root=str(tmp_path_factory.mktemp("ckpt-atomic")))
    srv = serve_in_thread(cfg)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert _train(c, _rollout(c)).status_code == 200  # AdamW has moments, the schedule a position
        yield c


def _rollout(c) -> str:
    r = c.post("/rollout", json={"prompts": [{"input_ids": p} for p in PROMPTS], "n": 2})
    assert r.status_code == 200, r.text
    return r.json()["rollout_id"]


def _train(c, rid) -> httpx.Response:
    return c.post("/train_step", json={"rollout_id": rid, "rewards": REWARDS})


def _error(r) -> str:
    return r.json()["error"]["message"]


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _snapshot(server, c) -> dict:
    st = server.state
    return {"http": c.get("/checksum").json(),
            "weights": [p.detach().clone() for p in st.model.parameters()],
            "optimizer": [t.detach().clone() for t in st.rl.actor.optimizer.state_tensors()],
            "lr": [g["lr"] for g in st.rl.actor.optimizer.param_groups],
            "rng": torch.get_rng_state()}


def _assert_same(a: dict, b: dict) -> None:
    assert a["http"] == b["http"]
    assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"], strict=True))
    assert all(torch.equal(x, y) for x, y in zip(a["optimizer"], b["optimizer"], strict=True))
    assert a["lr"] == b["lr"] and torch.equal(a["rng"], b["rng"])


# ---- /save ----------------------------------------------------------------------------------------------
def test_a_failed_overwrite_leaves_the_old_checkpoint(server, client, monkeypatch):
    root = Path(server.state.cfg.checkpoint_root)
    assert client.post("/save", json={"path": "keep", "data_state": {"epoch": 1}}).status_code == 200
    old = _files(root / "keep")
    assert _train(client, _rollout(client)).status_code == 200  # the live weights are not the checkpoint's
    real = torch.save

    def disk_full(obj, f, *a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)  # after the safetensors files were written
    r = client.post("/save", json={"path": "keep", "overwrite": True})
    monkeypatch.setattr(torch, "save", real)
    assert r.status_code == 507 and "No space left" in _error(r), r.text
    assert _files(root / "keep") == old
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []  # no temporary folder left
    loaded = client.post("/load", json={"path": "keep"})
    assert loaded.status_code == 200 and loaded.json()["data_state"] == {"epoch": 1}, loaded.text
    ok = client.post("/save", json={"path": "keep", "overwrite": True, "data_state": {"epoch": 2}})
    assert ok.status_code == 200 and _files(root / "keep") != old
    assert client.post("/load", json={"path": "keep"}).json()["data_state"] == {"epoch": 2}


def _nested(depth: int) -> dict:
    x: dict = {}
    for _ in range(depth):
        x = {"a": x}
    return x


DATA_STATES = {
    "nested 512 deep": (json.dumps({"path": "keep", "overwrite": True, "data_state": _nested(512)}),
                        "nested more than"),
    "700-digit int": ('{"path": "keep", "overwrite": true, "data_state": {"n": ' + "7" * 700 + "}}", "64-bit"),
    "NaN": ('{"path": "keep", "overwrite": true, "data_state": {"x": [NaN]}}', "not a finite number"),
    "Infinity": ('{"path": "keep", "overwrite": true, "data_state": {"x": -Infinity}}', "not a finite number"),
    "a lone surrogate": ('{"path": "keep", "overwrite": true, "data_state": {"s": "a\\ud800b"}}', "valid unicode"),
    "a lone surrogate key": ('{"path": "keep", "overwrite": true, "data_state": {"\\udfff": 1}}', "valid unicode"),
}


def test_a_data_state_that_cannot_round_trip_is_refused_before_anything_is_written(server, client):
    root = Path(server.state.cfg.checkpoint_root)
    assert client.post("/save", json={"path": "keep", "overwrite": True, "data_state": {"epoch": 3}}).status_code == 200
    old = _files(root / "keep")
    failures = []
    for name, (body, message) in DATA_STATES.items():
        for target in ("keep", "fresh"):
            r = client.post("/save", content=body.replace('"keep"', f'"{target}"'),
                            headers={"content-type": "application/json"})
            if r.status_code != 400 or message not in _error(r):
                failures.append(f"{name} -> {target}: {r.status_code} {r.text[:300]}")
    assert not failures, "\n".join(failures)
    assert _files(root / "keep") == old and not (root / "fresh").exists()
    assert client.post("/load", json={"path": "keep"}).json()["data_state"] == {"epoch": 3}


def test_overwrite_never_replaces_a_folder_that_is_not_a_checkpoint(server, client):
    root = Path(server.state.cfg.checkpoint_root)
    (root / "runs" / "other").mkdir(parents=True)
    (root / "runs" / "other" / "notes.txt").write_text("mine")
    r = client.post("/save", json={"path": "runs", "overwrite": True})
    assert r.status_code == 400 and "not a checkpoint" in _error(r), r.text
    assert (root / "runs" / "other" / "notes.txt").read_text() == "mine"


KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys, torch
    from rollplex.models import load_model
    from rollplex.rl.run_state import save_checkpoint
    from rollplex.rl.config import RLConfig
    from rollplex.rl.step import RLStep

    tiny, out, where = sys.argv[1:4]
    step = RLStep(load_model(tiny), None, RLConfig(kl_coef=0.05))
    save_checkpoint(step, out, data_state={"run": "first"})
    print("saved", flush=True)
    with torch.no_grad():
        for p in step.model.parameters():
            p.add_(1.0)
    kill = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    if where == "trainer_state":  # after the policy's and the reference's safetensors were written
        torch.save = kill
    else:  # while the reference policy is written, the policy's files already there
        import rollplex.rl.run_state as ck
        real = ck.save_model
        ck.save_model = lambda model, path, **k: kill() if path.name == "ref" else real(model, path, **k)
    save_checkpoint(step, out, data_state={"run": "second"})
    print("not killed", flush=True)
""")


@pytest.mark.parametrize("where", ["trainer_state", "ref"])
def test_a_process_killed_mid_save_leaves_the_old_checkpoint(tiny_dir, tmp_path, where):
    out = tmp_path / "ck"
    p = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(tiny_dir), str(out), where], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == -9 and "saved" in p.stdout and "not killed" not in p.stdout, p.stdout + p.stderr[-3000:]

    from rollplex.models import load_model
    from rollplex.rl.run_state import load_checkpoint
    from rollplex.rl.step import RLStep

    step = RLStep(load_model(tiny_dir), None, RLConfig(kl_coef=0.05))
    fresh = [p.detach().clone() for p in step.model.parameters()]
    assert load_checkpoint(step, out) == {"run": "first"}  # whole, and the first save's
    assert all(torch.equal(a, b) for a, b in zip(fresh, step.model.parameters()))  # not the +1.0 weights


@pytest.mark.parametrize("exchange", [True, False])
def test_replace_dir_swaps_a_folder_in_whole(tmp_path, monkeypatch, exchange):
    from rollplex.rl import atomic_dir

    if not exchange:  # a kernel or file system without renameat2's exchange: two renames
        monkeypatch.setattr(atomic_dir, "exchange", lambda a, b: False)
    else:
        seen = []
        real = atomic_dir.exchange
        monkeypatch.setattr(atomic_dir, "exchange", lambda a, b: seen.append(real(a, b)) or seen[-1])
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "old.txt").write_text("old")
    (tmp_path / ".ck.partial" / "sub").mkdir(parents=True)
    (tmp_path / ".ck.partial" / "sub" / "new.txt").write_text("new")
    atomic_dir.sync_tree(tmp_path / ".ck.partial")
    atomic_dir.replace_dir(tmp_path / ".ck.partial", tmp_path / "ck")
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["ck", "ck/sub", "ck/sub/new.txt"]
    if exchange:
        assert seen == [True]  # Linux: one atomic swap


# ---- /load ----------------------------------------------------------------------------------------------
def _edit_tensors(f: Path, fn) -> None:
    t = load_file(str(f))
    fn(t)
    save_file(t, str(f), metadata={"format": "pt"})


def _edit_state(f: Path, fn) -> None:
    s = torch.load(f, weights_only=True)
    fn(s)
    torch.save(s, f)


def _first_weight(t: dict) -> str:
    return next(k for k in sorted(t) if k.endswith("weight") and t[k].ndim == 2)


def _set(t: dict, fn) -> None:
    k = _first_weight(t)
    t[k] = fn(t[k])


def _group(s: dict, key: str, value) -> None:
    s["actor"]["optimizer"]["opt"]["param_groups"][0][key] = value


def _moment(s: dict, key: str, fn) -> None:
    st = s["actor"]["optimizer"]["opt"]["state"]
    st[min(st)][key] = fn(st[min(st)][key])


def _index(d: Path, name_for) -> None:
    """Replace model.safetensors by an index that maps every tensor to name_for(d)."""
    keys = list(load_file(str(d / "model.safetensors")))
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: name_for(d) for k in keys}}))


def _symlink(d: Path, name: str) -> None:
    target = d.parent / "good" / name
    (d / name).unlink()
    (d / name).symlink_to(target)


POISON = {
    "float64 weight of 1e300": (lambda d: _edit_tensors(d / "model.safetensors", lambda t: _set(
        t, lambda w: torch.full_like(w, 1e300, dtype=torch.float64))), "non-finite values (in the live dtype"),
    "float8 weight": (lambda d: _edit_tensors(d / "model.safetensors", lambda t: _set(
        t, lambda w: w.to(torch.float8_e4m3fn))), "not one of float16"),
    "float64 reference weight of 1e300": (lambda d: _edit_tensors(d / "ref" / "model.safetensors", lambda t: _set(
        t, lambda w: torch.full_like(w, -1e300, dtype=torch.float64))), "non-finite values (in the live dtype"),
    "lr NaN": (lambda d: _edit_state(d / "trainer_state.pt", lambda s: _group(s, "lr", math.nan)), "lr=nan"),
    "lr 1e6": (lambda d: _edit_state(d / "trainer_state.pt", lambda s: _group(s, "lr", 1e6)), "lr=1000000.0"),
    "weight_decay 1e6": (lambda d: _edit_state(d / "trainer_state.pt", lambda s: _group(s, "weight_decay", 1e6)),
                         "weight_decay=1000000.0"),
    "maximize": (lambda d: _edit_state(d / "trainer_state.pt", lambda s: _group(s, "maximize", True)), "maximize"),
    "amsgrad": (lambda d: _edit_state(d / "trainer_state.pt", lambda s: _group(s, "amsgrad", True)), "amsgrad"),
    "betas": (lambda d: _edit_state(d / "trainer_state.pt", lambda s: _group(s, "betas", (1.5, 0.999))), "betas"),
    "eps 0": (lambda d: _edit_state(d / "trainer_state.pt", lambda s: _group(s, "eps", 0.0)), "eps"),
    "negative exp_avg_sq": (lambda d: _edit_state(d / "trainer_state.pt", lambda s: _moment(
        s, "exp_avg_sq", lambda t: t - 1.0)), "exp_avg_sq of parameter"),
    "float64 moment": (lambda d: _edit_state(d / "trainer_state.pt", lambda s: _moment(
        s, "exp_avg", lambda t: t.double())), "not a float32 tensor"),
    "float64 master of 1e300": (lambda d: _edit_state(d / "trainer_state.pt", lambda s: s["actor"]["optimizer"][
        "master"].__setitem__(0, torch.full(s["actor"]["optimizer"]["opt"]["state"][min(s["actor"]["optimizer"][
            "opt"]["state"])]["exp_avg"].shape, 1e300, dtype=torch.float64))), "master weights of parameter 0"),
    "scheduler lr_lambdas": (lambda d: _edit_state(d / "trainer_state.pt", lambda s: s["actor"]["scheduler"].update(
        lr_lambdas=[{"__call__": 1}])), "lr_lambdas"),
    "an optimizer setting AdamW lacks": (lambda d: _edit_state(d / "trainer_state.pt", lambda s: _group(
        s, "momentum", 0.9)), "other settings"),
    "scheduler replacing its optimizer": (lambda d: _edit_state(d / "trainer_state.pt", lambda s: s["actor"][
        "scheduler"].update(optimizer={})), "state is not this run's"),
    "scheduler base_lrs": (lambda d: _edit_state(d / "trainer_state.pt", lambda s: s["actor"]["scheduler"].update(
        base_lrs=[1e6])), "base_lrs"),
    "torch RNG state": (lambda d: _edit_state(d / "trainer_state.pt", lambda s: s["rng"]["torch"].fill_(255)),
                        "torch RNG state"),
    "python RNG state": (lambda d: _edit_state(d / "trainer_state.pt", lambda s: s["rng"].update(
        python=(3, (1 << 40,) * 625, None))), "python RNG state"),
    "data state NaN": (lambda d: _edit_state(d / "trainer_state.pt", lambda s: s.update(data={"x": math.nan})),
                       "not a finite number"),
    "step_idx 1e30": (lambda d: _edit_state(d / "trainer_state.pt", lambda s: s.update(step_idx=10**30)),
                      "step_idx"),
    "index naming a file outside": (lambda d: _index(d, lambda d: "../good/model.safetensors"), "names"),
    "index naming an absolute path": (lambda d: _index(d, lambda d: str(d.parent / "good" / "model.safetensors")),
                                      "names"),
    "symlinked model.safetensors": (lambda d: _symlink(d, "model.safetensors"), "not a regular file"),
    "symlinked trainer_state.pt": (lambda d: _symlink(d, "trainer_state.pt"), "not a regular file"),
}


def test_load_refuses_states_that_would_poison_training(server, client):
    import shutil

    root = Path(server.state.cfg.checkpoint_root)
    assert client.post("/save", json={"path": "good"}).status_code == 200
    assert _train(client, _rollout(client)).status_code == 200  # the live state is not the checkpoint's
    rid = _rollout(client)  # a load would drop it
    before = _snapshot(server, client)
    failures = []
    for name, (poison, message) in POISON.items():
        bad = root / f"poison-{name.replace(' ', '-')}"
        shutil.copytree(root / "good", bad, symlinks=True)
        poison(bad)
        r = client.post("/load", json={"path": bad.name})
        if r.status_code != 400 or message not in _error(r):
            failures.append(f"{name}: {r.status_code} {r.text[:300]}")
    assert not failures, "\n".join(failures)
    _assert_same(before, _snapshot(server, client))  # version not bumped, the rollout still retained
    assert _train(client, rid).status_code == 200  # and on-policy
    loaded = client.post("/load", json={"path": "good"})  # the sound checkpoint still loads, and trains
    assert loaded.status_code == 200, loaded.text
    assert _train(client, _rollout(client)).status_code == 200
    assert client.get("/checksum").json()["weights_finite"]


def test_a_checkpoint_from_an_older_torch_still_loads(server, client):
    """Settings a newer torch added (AdamW's decoupled_weight_decay, the scheduler's _is_initial) are absent
    from older checkpoints: they take the live defaults instead of failing the load."""
    import shutil

    root = Path(server.state.cfg.checkpoint_root)
    assert client.post("/save", json={"path": "older", "overwrite": True}).status_code == 200

    def older(s):
        for g in s["actor"]["optimizer"]["opt"]["param_groups"]:
            g.pop("decoupled_weight_decay", None)
        s["actor"]["scheduler"].pop("_is_initial", None)

    _edit_state(root / "older" / "trainer_state.pt", older)
    r = client.post("/load", json={"path": "older"})
    assert r.status_code == 200, r.text
    assert _train(client, _rollout(client)).status_code == 200
    shutil.rmtree(root / "older")
