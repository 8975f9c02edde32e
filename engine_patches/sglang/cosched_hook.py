"""The co-scheduler as an SGLang scheduler hook: prefix work beside SGLang's decode steps.

`HookSpec("engine_patches.sglang.cosched_hook:CoschedHook", {"ref_path": ..., ...})` builds, in each
scheduler process, a `CoschedHook`: Rollplex's reference model (and, for several updates per rollout,
a copy of the policy for the old-policy prefix) on the scheduler's device, and a CoScheduler
(rollplex/cosched) driven by the patched Scheduler's decode hook. SGLang's model decodes; the prefix
jobs run Rollplex's own models, unit by unit, on the co-scheduler's stream beside it — the same ops as
in their normal phase, so the results are exact wherever they ran.

Control ops (driver.OPS, reached through RollplexEngine's methods):

    start_admission(prompts_path)        plan the rollout's prefix jobs (PrefixRows, as RLStep does)
                                         and begin admitting them beside decode steps
    stop_admission()                     CoScheduler.finish(): its metrics
    metrics()                            the last finished rollout's metrics (live ones while running)
    export_prefix_states(states_path)    complete whatever was never admitted (timed: it calibrates the
                                         cost model), write each job's PrefixState by CUDA IPC handle;
                                         `received_rows` rebuilds PrefixRows from them on the trainer side
    release_prefix_states()              drop them (the trainer is done mapping them)
    update_weights(weights_path)         copy the trained policy's parameters into the policy copy
    export_weights(model, weights_path)  the reference's (or policy copy's) parameters by CUDA IPC handle:
                                         the trainer's reference model can alias them instead of holding a
                                         second copy on the same device

Not carried over from the native engine: reuse of the engine's vision encodings (SGLang's prefill
encodings are not Rollplex's) and decode on a high-priority stream (SGLang picks its own streams).
"""

from __future__ import annotations

import time

import torch

from rollplex.cosched import CoschedConfig, CoScheduler, PrefixRows
from rollplex.models import load_model

from . import tensor_ipc


def _scheduler_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class CoschedHook:
    def __init__(self, ref_path: str | None = None, policy_path: str | None = None, dtype: str = "bfloat16",
                 config: dict | None = None, device: str | None = None, tflops: float | None = None):
        if ref_path is None and policy_path is None:
            raise ValueError("CoschedHook needs ref_path (reference prefixes) and/or policy_path (old-policy ones)")
        dt = getattr(torch, dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"dtype must name a torch dtype, got {dtype!r}")
        self.device = torch.device(device) if device else _scheduler_device()
        self.ref = load_model(ref_path, self.device, dt).eval().requires_grad_(False) if ref_path else None
        self.policy = load_model(policy_path, self.device, dt).eval().requires_grad_(False) if policy_path else None
        self.config = CoschedConfig(**(config or {}))
        self.cosched = CoScheduler(self.config, self.device, tflops=tflops)
        self.rows: dict[str, PrefixRows] = {}
        self.active = False
        self._metrics: dict[str, float] = {}
        self._exported: dict | None = None

    # ---- decode hook ----------------------------------------------------------------------------
    def on_decode_step(self, info) -> None:
        self.cosched.on_decode_step(info)

    def after_decode_launch(self, info) -> None:
        self.cosched.after_decode_launch(info)

    # ---- control ops ----------------------------------------------------------------------------
    def start_admission(self, prompts_path: str) -> dict:
        if self.active:
            raise RuntimeError("admission already runs: stop_admission() first")
        if self._exported is not None:
            raise RuntimeError("the last rollout's prefix states are still exported: release_prefix_states() first")
        prompts = tensor_ipc.load(prompts_path)
        if not prompts:
            raise ValueError("start_admission needs at least one prompt")
        per_job = self.config.job_prompts
        self.rows = {}
        if self.ref is not None:
            self.rows["ref"] = PrefixRows.plan(self.ref, prompts, per_job, "ref")
        if self.policy is not None:
            self.rows["old"] = PrefixRows.plan(self.policy, prompts, per_job, "old")
        jobs = [(job, i) for i, job in enumerate(j for rows in self.rows.values() for j in rows.jobs)]
        self.cosched.begin(jobs)
        self.active = True
        return {"prompts": len(prompts), "jobs": len(jobs)}

    def stop_admission(self) -> dict:
        if not self.active:
            raise RuntimeError("admission is not running: start_admission() first")
        self.active = False
        self._metrics = self.cosched.finish()
        return dict(self._metrics)

    def metrics(self) -> dict:
        return self.cosched.ctrl.metrics() if self.active else dict(self._metrics)

    def export_prefix_states(self, states_path: str) -> dict:
        if self.active:
            raise RuntimeError("stop_admission() before exporting prefix states")
        if not self.rows:
            raise RuntimeError("no rollout's prefix work to export (start_admission first)")
        left = [j for rows in self.rows.values() for j in rows.jobs if not j.done]
        flops = sum(j.left_flops() for j in left)
        self._sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            for j in left:
                j.complete()
        self._sync()
        dt = time.perf_counter() - t0
        if left:
            self.cosched.calibrate(flops, dt)
        out = {}
        for key, rows in self.rows.items():
            jobs = rows.jobs
            index = {id(j): i for i, j in enumerate(jobs)}
            out[key] = {"states": [j.state for j in jobs], "rows": [(index[id(j)], r) for j, r in rows.rows]}
        tensor_ipc.dump(out, states_path)
        self._exported = out  # the trainer maps this memory: it stays alive until release_prefix_states()
        return {"consumers": sorted(out), "normal_phase_s": dt}

    def release_prefix_states(self) -> None:
        self._exported = None
        self.rows = {}

    def update_weights(self, weights_path: str) -> dict:
        if self.policy is None:
            raise ValueError("this hook has no policy copy (policy_path was not given)")
        named = tensor_ipc.load(weights_path)
        params = dict(self.policy.named_parameters())
        unknown = sorted(set(named) - set(params))
        if unknown:
            raise ValueError(f"unknown parameters {unknown[:3]}{'...' if len(unknown) > 3 else ''}")
        for name, t in named.items():
            if tuple(t.shape) != tuple(params[name].shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)} != {tuple(params[name].shape)}")
        with torch.no_grad():
            for name, t in named.items():
                params[name].copy_(t)
        self._sync()  # the sender frees its tensors once the RPC returns
        return {"updated": len(named)}

    def export_weights(self, model: str, weights_path: str) -> dict:
        m = {"ref": self.ref, "policy": self.policy}.get(model)
        if m is None:
            raise ValueError(f"this hook has no {model!r} model (models: ref, policy, as given at start)")
        named = {n: p.detach() for n, p in m.named_parameters()}
        tensor_ipc.dump(named, weights_path)  # the hook keeps the model alive for as long as the trainer maps it
        return {"tensors": len(named)}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class _ReceivedJob:
    """A prefix job whose state was computed in SGLang's scheduler process (PrefixRows' job interface)."""

    def __init__(self, key: str, state):
        self.key, self.state = key, state
        self.done = True

    def complete(self):
        return self.state


def received_rows(exported: dict) -> dict[str, PrefixRows]:
    """{consumer: PrefixRows} from RollplexEngine.prefix_states(): what RolloutBatch.prefix holds."""
    out = {}
    for key, part in exported.items():
        jobs = [_ReceivedJob(f"{key}/{i}", s) for i, s in enumerate(part["states"])]
        out[key] = PrefixRows([(jobs[j], r) for j, r in part["rows"]])
    return out
