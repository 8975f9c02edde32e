"""`python -m torch.distributed.run -m rollplex.server` on CPU (gloo, 2 ranks): rank 0 serves HTTP, the
rollouts and the train step run on both ranks, and the weights after a seeded rollout + train step equal
those of a one-process server given the same requests, also after a checkpoint is saved and loaded back;
SIGTERM to rank 0 stops the group and torchrun exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from helpers import assert_fp32_close
from server_helpers import free_port, wait_for_health, wire_rows

from rollplex.server import serve_in_thread
from rollplex.server.__main__ import config_from_args, parser

ROOT = Path(__file__).resolve().parents[1]
SAMPLING = {"seed": 11, "temperature": 1.0, "max_new_tokens": 4}
REWARDS = [1.0, 0.0, 0.25, 0.75]


def _flags(tiny_dir) -> list[str]:
    return ["--model", str(tiny_dir), "--device", "cpu", "--max-model-len", "256", "--kv-cache-tokens", "4096",
            "--lr", "1e-5", "--kl-coef", "0.05", "--max-new-tokens", "4", "--micro-batch-prompts", "1",
            "--log-level", "warning"]


def _rank0_pid(parent: int) -> int:
    """The pid of the descendant of `parent` whose environment says RANK=0 (torchrun's rank-0 worker)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    todo = list(children.get(parent, []))
    while todo:
        pid = todo.pop()
        try:
            env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"RANK=0" in env and b"LOCAL_RANK=0" in env:
            return pid
        todo += children.get(pid, [])
    raise AssertionError("no rank-0 process under torchrun")


def _steps(client: httpx.Client) -> dict:
    """A seeded training rollout, a rejected step, a step with given rewards, and a second rollout."""
    first = client.post("/rollout", json={"prompts": wire_rows(2), "n": 2, "sampling_params": SAMPLING})
    assert first.status_code == 200, first.text
    rid = first.json()["rollout_id"]
    # a prompt no engine can run is refused before any rank samples, and nothing is lost
    too_long = client.post("/rollout", json={"prompts": [{"input_ids": [5] * 300}], "n": 2,
                                             "sampling_params": SAMPLING})
    assert too_long.status_code == 400 and "prompts[0]" in too_long.text, too_long.text
    bad = client.post("/train_step", json={"rollout_id": rid, "rewards": REWARDS, "loss_agg_mode": "nope"})
    assert bad.status_code == 400, bad.text  # rejected before any rank trains
    step = client.post("/train_step", json={"rollout_id": rid, "rewards": REWARDS})
    assert step.status_code == 200, step.text
    second = client.post("/rollout", json={"prompts": wire_rows(2, seed=1), "n": 2, "sampling_params": SAMPLING})
    assert second.status_code == 200, second.text
    health = {**client.get("/health").json(), **client.get("/checksum").json()}
    return {"tokens": [[s["token_ids"] for s in r.json()["samples"]] for r in (first, second)],
            "loss": step.json()["actor/pg_loss"], "grad_norm": step.json()["actor/grad_norm"], "health": health,
            "second": second.json()["rollout_id"]}


def _checkpoint_round(client: httpx.Client, rollout_id: str) -> float:
    """Save, train the retained rollout, load the checkpoint back (weights as saved), then roll out and
    train again from the restored state; the weights checksum after that."""
    checksum = lambda: client.get("/checksum").json()["weights_checksum"]  # noqa: E731
    save = client.post("/save", json={"path": "ck", "data_state": {"epoch": 1}})
    assert save.status_code == 200, save.text
    saved = checksum()
    step = client.post("/train_step", json={"rollout_id": rollout_id, "rewards": REWARDS})
    assert step.status_code == 200, step.text
    assert checksum() != saved
    load = client.post("/load", json={"path": "ck"})
    assert load.status_code == 200 and load.json()["data_state"] == {"epoch": 1}, load.text
    assert checksum() == saved
    again = client.post("/rollout", json={"prompts": wire_rows(2, seed=2), "n": 2, "sampling_params": SAMPLING})
    assert again.status_code == 200, again.text
    step = client.post("/train_step", json={"rollout_id": again.json()["rollout_id"], "rewards": REWARDS})
    assert step.status_code == 200, step.text
    return checksum()


@pytest.mark.slow
@pytest.mark.parametrize("extra, group_extra, world", [([], [], 2),
                                                       (["--freeze-vision-tower"],
                                                        ["--layers-per-unit", "2", "--no-reduce-every-pass"], 2),
                                                       ([], ["--tensor-parallel", "2"], 2),
                                                       ([], ["--tensor-parallel", "2"], 4)],
                         ids=["trained", "frozen-vision", "tensor-parallel", "tensor-parallel-groups"])
def test_server_over_a_group_matches_one_process(tiny_dir, tmp_path, extra, group_extra, world):
    # frozen: the one-process server reuses its prefill's vision encodings, the group runs the frozen tower
    # (in FSDP units of two layers, gradients reduced once per mini-batch);
    # tensor-parallel: both ranks' engines decode every prompt of a rollout with their shards of the policy;
    # tensor-parallel groups: 4 ranks, two 2-rank engines, each decoding its share of a rollout
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    flags = _flags(tiny_dir) + extra
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", "-m",
           "rollplex.server", *flags, *group_extra, "--port", str(port), "--checkpoint-root", str(tmp_path / "group"),
           "--log-level", "info"]
    out = open(tmp_path / "group.log", "wb")  # a file, not a pipe: nobody reads while the ranks log
    # a session of its own, so a failed test can end torchrun and its ranks together
    group = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # the one-process server on the same flags, in this process, while the group starts
        cfg = config_from_args(parser().parse_args(flags + ["--checkpoint-root", str(tmp_path / "one")]))
        # one intra-op thread, as each rank has (OMP_NUM_THREADS=1): a BLAS that picks its thread count by the
        # machine's load would otherwise change the summation order, and a near-tie sample with it
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with serve_in_thread(cfg) as single, httpx.Client(base_url=single.url, timeout=120) as c:
                start = c.get("/checksum").json()["weights_checksum"]
                one = _steps(c)
                one["resumed"] = _checkpoint_round(c, one["second"])
        finally:
            torch.set_num_threads(threads)
        url = f"http://127.0.0.1:{port}"
        wait_for_health(url, group, 90)
        with httpx.Client(base_url=url, timeout=120) as c:
            two = _steps(c)
            if "--tensor-parallel" in group_extra:
                gen = c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
                assert gen.status_code == 400 and "tensor-parallel" in gen.text, gen.text
            # every rank writes and restores its part: the run resumes as the one-process server's does
            two["resumed"] = _checkpoint_round(c, two["second"])
            assert c.get("/health").json()["status"] == "ok"
        assert one["health"]["world_size"] == 1 and two["health"]["world_size"] == world
        assert two["health"]["weights_version"] == one["health"]["weights_version"] == 1
        assert two["tokens"] == one["tokens"]  # the second rollout decodes the synced weights
        # equal up to fp32 summation order (helpers.fp32_rtol): the loss and grad norm are O(1), the weights'
        # checksum is compared relative to how far the update moved it
        assert_fp32_close(two["loss"], one["loss"], "loss", scale=1.0)
        assert_fp32_close(two["grad_norm"], one["grad_norm"], "grad norm", scale=1.0)
        moved = abs(one["health"]["weights_checksum"] - start)
        assert_fp32_close(two["health"]["weights_checksum"], one["health"]["weights_checksum"], "checksum", scale=moved)
        assert_fp32_close(two["resumed"], one["resumed"], "resumed checksum", scale=moved)
        os.kill(_rank0_pid(group.pid), signal.SIGTERM)
        rc = group.wait(60)
        log = (tmp_path / "group.log").read_text()
        assert rc == 0, log[-4000:]
        # the three rollouts ran on every rank: rank 1's engine sampled one of the two prompts each time, or
        # (one tensor-parallel engine over both ranks) decoded both with rank 0
        want = ("rank 1: sampled 2 of the rollout's 2 prompts" if "--tensor-parallel" in group_extra and world == 2
                else "rank 1: sampled 1 of the rollout's 2 prompts")
        assert log.count(want) == 3, log[-4000:]
    finally:
        if group.poll() is None:
            os.killpg(group.pid, signal.SIGKILL)
            group.wait(10)
        out.close()


@pytest.mark.parametrize("flags, message", [
    (["--tensor-parallel", "4"], "must divide 2"),
    (["--tensor-parallel", "3"], "must divide 2"),
    (["--no-packed"], "packed=True"),
])
def test_group_refuses_what_it_cannot_run(flags, message):
    from rollplex.server.group import check_config

    cfg = config_from_args(parser().parse_args(["--device", "cpu", *flags]))
    check_config(config_from_args(parser().parse_args(["--device", "cpu"])), 2)  # the defaults run
    check_config(config_from_args(parser().parse_args(["--device", "cpu", "--tensor-parallel", "2"])), 2)
    with pytest.raises(ValueError, match=message):
        check_config(cfg, 2)
