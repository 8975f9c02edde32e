"""POST /rollout, /train_step, /save, /load: the RL loop over HTTP.

/rollout   prompts (chat messages + images, verl rows, or ids) x n samples through the shared engine
           -> {"rollout_id", "weights_version", "samples": [{"prompt_index", "sample_index", "token_ids",
           "text", "logprobs", "finish_reason"}], ...}; finish_reason has /generate's (SGLang's) dict
           form (logprobs that are not finite, from non-finite weights, as null). With for_training
           (default) the RolloutBatch is retained under rollout_id (TTL, and caps per client in count and
           bytes and over all clients in bytes: store.py; a client's own oldest are evicted to fit, never
           another's, and a rollout that cannot fit is 507) with the weights version it was sampled
           from. Temperature must be > 0 for training rollouts.
/train_step rollout_id + `rewards` (one per sample, prompt-major as returned) or `reward` (a name
           registered at startup, rewards.py: nothing a request names is imported; scored against the
           rows' ground truths; default: the server's --reward) + per-step overrides -> the step's
           verl-named metrics. One step at a time: a
           call that arrives while a step trains gets 409 (it is not queued). Rewards are scored
           before the step takes the training lock (on a thread), so a slow reward function holds up
           no other client's step; once scored, a step waits for one in progress, and a rollout
           another step trained meanwhile is 404. Unknown / expired id -> 404. A request
           rejected before training (bad rewards, bad overrides, failing reward function) leaves the
           rollout retained; it is consumed only by a successful step. On-policy by default: a
           rollout sampled before the weights changed (a train step or a load since) gets 409 and
           stays retained; `off_policy: true` trains it with its sampling logprobs as old logprobs.
           Overrides are bounded (schemas.py) and rewards finite with |r| <= 1e6 (400 otherwise).
           Overlong reward shaping (overlong_buffer_len > 0) applies to the rewards the server scores,
           measured against the rollout's max_new_tokens; rewards a client sends are taken as final.
           With filter_groups (DAPO's dynamic sampling, rl/dynamic_sampling.py) the groups whose samples
           all have the same filter_groups_metric are dropped and the rest trained. The refill is the
           client's (the server holds no data): `more_rollout_ids` trains further retained rollouts (same
           weights version, temperature and max_new_tokens) in the same step, their groups after
           rollout_id's, and `train_batch_size` trims the kept groups to that many; fewer kept (or none)
           is a 400 whose message starts "filter_groups:", every rollout still retained, so the client
           rolls out more prompts and asks again with their ids added.
           A failed step changes nothing, or says exactly what changed: before its first optimizer
           step (scoring, the first mini-batch) weights, optimizer state, LR schedule, global_step,
           weights_version and the rollout store are as they were; after it (out of memory in a
           later mini-batch or inside an optimizer step, a later mini-batch's non-finite loss, any
           other error) the answer says how many optimizer steps were applied (and whether one
           stopped part-way), global_step, the LR schedule and weights_version count them, and the
           retained rollout is stale (off-policy only). Out of memory is 507; a non-finite loss or
           gradient norm skips that optimizer step and is 422; another error after an optimizer step
           is 500.
/save {"path", "data_state"?, "overwrite"?} -> HF checkpoint + trainer state, written atomically
           (rl/run_state.py; a full disk is 507 with the old checkpoint kept); never into the root
           itself (400), and onto an existing checkpoint (a non-empty folder) only with overwrite:
           true (409 otherwise). /load {"path"} -> checks everything first (400, nothing changed, for
           a missing, truncated or corrupt file, or values that would poison training:
           rl/run_state_checks.py), then restores it, returns the saved data_state, how
           many fp32 masters were rebuilt from edited weights (`masters_rebuilt`), and drops retained
           rollouts (sampled from the previous weights).
           Paths lie under --checkpoint-root (relative ones are taken from it); others are 400.
Training, save and load are `drain` jobs: they start once in-flight engine requests have finished.
With a rollout backend outside the engine loop (`--rollout-backend sglang`), or over a process group
(every rank's engine samples a share; group.py), a /rollout is one worker job: its prompts are encoded
on an intake thread, then sampled all at once. Prompt counts and sizes are checked (limits.py)
before anything is tokenised, and images and videos are read under the media policy (media.py).
"""

from __future__ import annotations

import asyncio
import errno
import math
import time
from dataclasses import replace

import torch
from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import Response

from ..rl.batch import RolloutBatch
from ..rl.dynamic_sampling import kept_groups, metric_values
from ..rl.errors import NonFiniteUpdate, TrainOOM, TrainStepError
from ..rl.remax import greedy_samples, set_baselines
from ..rl.rewards import score_batch
from . import limits
from .body import JSONOffLoop
from .errors import bad_request
from .inflight import ClientGone, collect, prepared, submit
from .schemas import LoadRequest, RolloutRequest, SaveRequest, TrainStepRequest
from .sglang import finish_reason, group_params, sampling_params
from .state import CheckpointExists
from .store import RetainedRollout, StaleRollout, StoreFull


def _client(request: Request) -> str:
    """Who sent a request, for the rollout store's per-client caps: the peer's address."""
    return request.client.host if request.client is not None else ""


def _json_floats(xs: list[float] | None) -> list[float | None] | None:
    """Logprobs as JSON can carry them: NaN or inf (non-finite weights, see /checksum) as null."""
    if xs is None or all(map(math.isfinite, xs)):
        return xs
    return [x if math.isfinite(x) else None for x in xs]


def _finite(m: dict) -> dict:
    return {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in m.items()}


def router(state) -> APIRouter:
    r = APIRouter(route_class=JSONOffLoop)
    cfg, rl = state.cfg, state.cfg.rl
    train_lock = asyncio.Lock()

    @r.post("/rollout")
    async def rollout(req: RolloutRequest, request: Request):
        t0 = time.perf_counter()
        sp_n = (req.sampling_params or {}).get("n")
        if req.n is not None and sp_n is not None and sp_n != req.n:
            raise bad_request(f"n={req.n} and sampling_params.n={sp_n} disagree")
        n = req.n or sp_n or rl.n
        defaults = {"max_new_tokens": rl.max_new_tokens, "temperature": rl.temperature, "top_p": rl.top_p}
        sp = sampling_params(req.sampling_params, defaults, cfg.engine.max_num_seqs, limits=cfg.limits, n=n)
        if req.for_training and sp.temperature <= 0:
            raise bad_request("training rollouts need temperature > 0 (the trainer scores that distribution)")
        params = group_params(sp, len(req.prompts), cfg.limits)  # prompt i: seed + i*n (400 past int64)
        if req.for_training and greedy_samples(rl):  # ReMax: each prompt's greedy response in the same call
            params = [replace(p, n_greedy=greedy_samples(rl)) for p in params]
        try:  # before any prompt is tokenised (limits.py)
            limits.check_count(cfg.limits, len(req.prompts), "prompts")
            for i, p in enumerate(req.prompts):
                if p.input_ids is not None:
                    limits.check_ids(cfg.engine.max_model_len, len(p.input_ids), f"prompts[{i}]")
                else:
                    limits.check_text(cfg.limits, cfg.engine.max_model_len, limits.chat_chars(p.chat()),
                                      f"prompts[{i}]")
        except ValueError as e:
            raise bad_request(str(e)) from None
        pixels = state.media.request()  # one decode budget for the request's images (media.py)
        encoders = [(lambda p=p: state.encode_prompt(p, pixels)) for p in req.prompts]
        # a frozen vision tower's encodings from the prefill stand in for the trainer's vision passes; under a
        # process group the other ranks never prefilled these prompts, so every rank runs the frozen tower
        keep_vision = req.for_training and rl.freeze_vision_tower and rl.mode == "rollplex" and state.world_size == 1
        if state.engine is None or state.world_size > 1:  # the backend, or every rank's engine, samples it whole
            try:
                outs, inputs, version = await _backend_rollout(state, encoders, params, keep_vision, request)
            except ClientGone:
                return Response(status_code=499)
        else:
            try:
                tickets, inputs = await submit(state, encoders, params, what="prompts", keep_vision=keep_vision,
                                               request=request)
            except ClientGone:
                return Response(status_code=499)
            try:
                results = await collect(state, tickets, request)
            except ClientGone:
                return Response(status_code=499)
            outs = [results[i][0] for i in range(len(req.prompts))]
            version = tickets[0].weights_version
        gen_s = time.perf_counter() - t0
        samples = [{"prompt_index": i, "sample_index": j, "token_ids": s.token_ids, "text": s.text or "",
                    "logprobs": _json_floats(s.logprobs),
                    "finish_reason": finish_reason(s.finish_reason, s.matched_stop, len(s.token_ids))}
                   for i, out in enumerate(outs) for j, s in enumerate(out.samples)]
        greedy = [{"prompt_index": i, "token_ids": s.token_ids, "text": s.text or "",
                   "logprobs": _json_floats(s.logprobs),
                   "finish_reason": finish_reason(s.finish_reason, s.matched_stop, len(s.token_ids))}
                  for i, out in enumerate(outs) for s in getattr(out, "greedy", [])]
        state.metrics.inc("rollplex_rollouts_total")
        rollout_id = None
        if req.for_training and all(s.finish_reason != "abort" for out in outs for s in out.samples):
            batch = RolloutBatch.from_outputs(
                inputs, outs, pad_id=state.model.cfg.pad_token_id or 0,
                data_sources=[p.data_source for p in req.prompts], ground_truths=[p.truth() for p in req.prompts],
                extra_infos=[p.extra_info for p in req.prompts])
            if keep_vision:
                batch.prompts = [p if o.vision_embeds is None else replace(p, vision_embeds=o.vision_embeds)
                                 for p, o in zip(batch.prompts, outs)]
            entry = RetainedRollout(batch, temperature=sp.temperature, gen_s=gen_s, weights_version=version,
                                    max_new_tokens=sp.max_new_tokens, client=_client(request))
            try:
                state.store.put(entry)
            except StoreFull as e:  # 507 Insufficient Storage: nothing was evicted
                raise HTTPException(507, str(e)) from None
            rollout_id = entry.rollout_id
        return {"rollout_id": rollout_id, "weights_version": version, "num_prompts": len(req.prompts), "n": n,
                "num_samples": len(samples), "samples": samples, "timing_s": gen_s,
                **({"greedy": greedy} if greedy else {}),
                "expires_in_s": cfg.rollout_ttl_s if rollout_id else None}

    @r.post("/train_step")
    async def train_step(req: TrainStepRequest):
        if train_lock.locked():
            raise HTTPException(409, "a training step is already running; retry when it has finished")
        ids = [req.rollout_id, *req.more_rollout_ids]
        entries = [state.store.get(i) for i in ids]
        for i, entry in zip(ids, entries):
            if entry is None:
                raise HTTPException(404, f"unknown or expired rollout_id {i!r}")
            if entry.weights_version != state.weights_version and not req.off_policy:  # before scoring rewards
                raise HTTPException(409, str(StaleRollout(entry.weights_version, state.weights_version)))
        try:  # this step's config, for the reward shaping and the group filter (state.train checks it too)
            cfg = replace(state.rl.cfg, **req.overrides())
            entry = _combine(state, entries)
        except ValueError as e:
            raise bad_request(f"train step rejected: {e}") from None
        if req.train_batch_size is not None and not cfg.filter_groups:
            raise bad_request("train_batch_size trims the groups filter_groups keeps: it needs filter_groups")
        N = entry.batch.num_samples
        extra, reward_s = {}, 0.0
        if req.rewards is not None:
            if len(req.rewards) != N:
                raise bad_request(f"got {len(req.rewards)} rewards for {N} samples (one per sample, in the "
                                  "order /rollout returned them, rollout after rollout); the rollout is still "
                                  "retained")
            rewards = scores = list(req.rewards)
            if req.greedy_rewards is not None:  # ReMax: the client's rewards of the greedy responses
                if entry.batch.greedy is None:
                    raise bad_request("greedy_rewards given for rollouts without greedy responses (a /rollout of a "
                                      "server started with --adv-estimator remax has them)")
                try:
                    set_baselines(entry.batch, req.greedy_rewards)
                except ValueError as e:
                    raise bad_request(f"{e} (one per prompt, rollout after rollout); the rollout is still "
                                      "retained") from None
        else:
            t0 = time.perf_counter()
            try:  # the RL step's reward loop, on a thread and outside the training lock: a slow reward
                # function holds up no other client's step (it touches no model state)
                scores, rewards, extra = await asyncio.get_running_loop().run_in_executor(
                    state.scoring, _score, state, entry, req.reward, cfg)
            except ValueError as e:
                raise bad_request(str(e)) from None
            rewards = rewards.tolist()
            reward_s = time.perf_counter() - t0
        if cfg.filter_groups:  # dynamic sampling's filter over the step's rollouts (the refill is the client's)
            entry, rewards, filtered = _filter_groups(entry, rewards, scores, cfg.filter_groups_metric,
                                                      req.train_batch_size, len(ids))
            extra.update(filtered)
        async with train_lock:  # a step that began while these rewards were scored finishes first
            for i, e in zip(ids, entries):  # another step may have trained (consumed) them meanwhile
                if state.store.get(i) is not e:
                    raise HTTPException(404, f"rollout_id {i!r} was trained or expired while its rewards were "
                                             "scored")
            try:
                m = await state.worker.run(lambda: state.train(entry, rewards, req.overrides(), reward_s,
                                                               off_policy=req.off_policy), drain=True)
            except StaleRollout as e:  # the weights changed while the rewards were scored
                raise HTTPException(409, str(e)) from None
            except ValueError as e:
                raise bad_request(f"train step rejected: {e}") from None
            except TrainStepError as e:  # the rollout stays retained; stale when part of the step was applied
                oom, nonfinite = isinstance(e, TrainOOM), isinstance(e, NonFiniteUpdate)
                if oom or nonfinite:
                    state.metrics.inc("rollplex_train_oom_total" if oom else "rollplex_train_nonfinite_total")
                if e.weights_changed:
                    state.metrics.inc("rollplex_train_steps_partial_total")
                    left = (f"global_step is now {state.rl.step_idx} and weights_version {state.weights_version}: "
                            "the rollout is still retained but stale (train it with off_policy: true)")
                else:
                    left = "the rollout is still retained"
                # 507 Insufficient Storage: the step did not fit; 422: the loss or gradients were not finite;
                # 500: another error after part of the step was applied (TrainStepFailed)
                code = 507 if oom else 422 if nonfinite else 500
                raise HTTPException(code, f"{e} ({e.applied()}; {left})") from None
            m.update(extra)
            for i in ids:
                state.store.pop(i)
            state.metrics.inc("rollplex_train_steps_total")
            return _finite(m)

    @r.post("/save")
    async def save(req: SaveRequest):
        try:
            return await state.worker.run(lambda: state.save(req.path, req.data_state, req.overwrite), drain=True)
        except CheckpointExists as e:
            raise HTTPException(409, f"cannot save to {req.path!r}: {e}") from None
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):  # 507 Insufficient Storage: the old checkpoint is kept
                raise HTTPException(507, f"cannot save to {req.path!r}: {e}") from None
            raise bad_request(f"cannot save to {req.path!r}: {e}") from None
        except ValueError as e:
            raise bad_request(f"cannot save to {req.path!r}: {e}") from None

    @r.post("/load")
    async def load(req: LoadRequest):
        try:
            return await state.worker.run(lambda: state.load(req.path), drain=True)
        except (ValueError, OSError) as e:
            raise bad_request(f"cannot load {req.path!r}: {e}") from None

    return r


def _score(state, entry: RetainedRollout, reward: str | None, cfg) -> tuple[list[float], torch.Tensor, dict]:
    """(scores, rewards, metrics) by a reward registered at startup (rewards.py; None: the server's --reward),
    with cfg's overlong reward shaping against the rollout's max_new_tokens."""
    fn = state.rewards.default if reward is None else state.rewards.get(reward)
    limit = entry.max_new_tokens or cfg.max_new_tokens
    out = score_batch(fn, entry.batch, limit, cfg.overlong_buffer_len, cfg.overlong_penalty_factor)
    if entry.batch.greedy is not None:  # ReMax: the greedy responses' rewards are the samples' baselines
        _, greedy, _ = score_batch(fn, entry.batch.greedy, limit, cfg.overlong_buffer_len, cfg.overlong_penalty_factor)
        set_baselines(entry.batch, greedy)
    return out


def _combine(state, entries: list[RetainedRollout]) -> RetainedRollout:
    """One entry of the retained rollouts trained in one step, their groups in order; ValueError for
    rollouts that cannot train together."""
    if len(entries) == 1:
        return entries[0]
    first = entries[0]
    for what in ("temperature", "max_new_tokens", "weights_version"):
        if len({getattr(e, what) for e in entries}) > 1:
            raise ValueError(f"the rollouts of one step must share their {what}")
    batch = RolloutBatch.concat([e.batch for e in entries], pad_id=state.model.cfg.pad_token_id or 0)
    return replace(first, batch=batch, gen_s=sum(e.gen_s for e in entries))


def _filter_groups(entry: RetainedRollout, rewards: list, scores: list, metric: str, target: int | None,
                   rollouts: int):
    """(entry, rewards) of the groups whose samples' `metric` differs (rl/dynamic_sampling.py), the first
    `target` of them when given, and the filter's metrics; 400 (the rollouts retained) when none is left
    to train, or fewer than `target`."""
    batch = entry.batch
    if metric in ("seq_reward", "score"):
        values = torch.tensor(rewards if metric == "seq_reward" else scores, dtype=torch.float32)
    else:  # a key of the server's reward function's dict (a client's rewards have none)
        try:
            values = metric_values(metric, batch, None)
        except ValueError as e:
            raise bad_request(f"filter_groups: {e}") from None
    kept = kept_groups(values, batch.group, batch.num_prompts)
    if not kept or (target is not None and len(kept) < target):
        raise bad_request(f"filter_groups: {len(kept)} of the {batch.num_prompts} groups have samples whose {metric} "
                          f"differs{'' if target is None else f', of the {target} train_batch_size asks'}: roll out "
                          "more prompts and add their rollout ids to more_rollout_ids (every rollout is still "
                          "retained)")
    metrics = {"train/num_gen_batches": rollouts, "train/num_groups_kept": len(kept),
               "train/num_groups_dropped": batch.num_prompts - len(kept)}
    kept = kept[:target]
    if len(kept) == batch.num_prompts:
        return entry, rewards, metrics
    sub, idx = batch.select_prompts(kept)
    return replace(entry, batch=sub), [rewards[i] for i in idx.tolist()], metrics


async def _backend_rollout(state, encoders: list, params: list, keep_vision: bool,
                           request: Request) -> tuple[list, list, int]:
    """(outputs, encoded prompts, weights version) of a rollout through the RL step's backend: prompts
    encoded on the intake threads, a prompt at a time in turn with other requests' (400 for a bad one;
    ClientGone, the rest not started, if the client leaves meanwhile), then sampled in one worker job."""
    def prepare(i: int):
        try:
            x = encoders[i]()
            if state.engine is not None:  # what the engines would refuse, refused before any rank starts
                state.engine.prepare(x, params[i], processor=state.intake_processor)
        except Exception as e:  # processor / image errors, prompts the engine cannot run: the client's input
            raise ValueError(f"prompts[{i}]: {e}") from e
        return x

    try:
        inputs = await prepared(state, [lambda i=i: prepare(i) for i in range(len(encoders))], request)
    except ValueError as e:
        raise bad_request(str(e)) from None
    try:  # over a process group the engine's in-flight requests finish first: the job drives it alone
        outs, version = await state.worker.run(lambda: state.sample(inputs, params, keep_vision),
                                               drain=state.engine is not None)
    except ValueError as e:  # a prompt the backend refuses (e.g. video with SGLang)
        raise bad_request(str(e)) from None
    for out in outs:
        state.metrics.inc("rollplex_prompt_tokens_total", len(out.prompt_token_ids))
        state.metrics.inc("rollplex_generation_tokens_total", sum(len(s.token_ids) for s in out.samples))
    return outs, inputs, version
