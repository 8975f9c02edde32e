"""SGLang's utility endpoints, answered in SGLang's shapes, so that its clients and routers connect unchanged.

    GET      /health_generate   200 (empty) once a one-token greedy generation of token id 0 came back
                                through the engine loop, or at once while the engine is already running
                                requests (SGLang's rule); 503 (empty) when none came back within
                                HEALTH_GENERATE_TIMEOUT_S. With another rollout backend (--rollout-backend
                                sglang) there is no engine loop here: 200 as /health.
    GET      /get_model_info    (and /model_info) SGLang's model info: model_path, tokenizer_path,
                                served_model_name, is_generation, has_image_understanding, weight_version, ...
    GET      /get_server_info   (and /server_info) the launch settings under SGLang's names (model_path,
                                context_length, max_running_requests, max_total_num_tokens, ...), plus
                                internal_states (one per engine), startup_time, version
    GET|POST /flush_cache       200 "Cache flushed..." (text): the native engine keeps no prefix cache
                                between requests (a prompt's prefix is shared only inside its own group),
                                so there is nothing to drop; the `timeout` query is checked as SGLang's
    GET      /v1/models         OpenAI's model list: one card, id = the served model name

Shapes are those of SGLang's `srt/entrypoints/http_server.py` (checked against 0.5.23); fields SGLang has
and Rollplex has no value for (LoRA parents, parsers, disaggregation) are null. Auth and request counting
are the app's middleware's (app.py): every one needs the API key when the server has one.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Query
from fastapi.responses import PlainTextResponse, Response

from .. import __version__
from ..engine.sampling_params import SamplingParams
from .inflight import collect, submit

HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. "
           "(When there are running or waiting requests, the operation will not be performed.)\n")


def served_name(state) -> str:
    """The name clients address the model by: its path, as SGLang's default `served_model_name`."""
    return str(state.model_path or state.cfg.model)


def model_info(state) -> dict:
    hf = state.model.cfg.to_hf_dict()
    return {"model_path": served_name(state), "served_model_name": served_name(state),
            "tokenizer_path": str(state.model_path) if state.processor is not None else None,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": str(state.weights_version),
            "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
            "has_image_understanding": True, "has_audio_understanding": False, "model_type": hf.get("model_type"),
            "architectures": hf.get("architectures"), "max_model_len": state.cfg.engine.max_model_len}


def server_info(state) -> dict:
    cfg, engine = state.cfg, state.engine
    kv_tokens = engine.blocks.num_blocks * engine.cfg.block_size if engine is not None else None
    counts = state.engine_counts()
    internal = {"world_size": state.world_size, "startup_time": state.startup_s.get("ready"),
                "effective_max_running_requests_per_dp": cfg.engine.max_num_seqs,
                "num_running_reqs": counts["running"] if counts else None,
                "num_waiting_reqs": counts["waiting"] if counts else None}
    return {"model_path": served_name(state), "tokenizer_path": model_info(state)["tokenizer_path"],
            "served_model_name": served_name(state), "dtype": cfg.dtype, "device": cfg.device,
            "context_length": cfg.engine.max_model_len, "max_running_requests": cfg.engine.max_num_seqs,
            "max_total_num_tokens": kv_tokens, "max_req_input_len": cfg.engine.max_model_len - 1,
            "page_size": engine.cfg.block_size if engine is not None else None,
            "tp_size": state.world_size, "dp_size": 1, "random_seed": cfg.rl.seed,
            "api_key": None if cfg.api_key is None else "<redacted>",
            "rollout_backend": state.rl.rollout_backend, "mode": cfg.rl.mode,
            "status": "ready", "startup_time": state.startup_s.get("ready"), "internal_states": [internal],
            "version": __version__, "frontend": "python"}


async def _generate_one(state) -> bool:
    """True once a one-token greedy generation of token id 0 came back from the engine loop."""
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    tickets, _ = await submit(state, [lambda: state.engine.encode([0])], [params], inline=True)
    await collect(state, tickets, None)
    return True


def router(state) -> APIRouter:
    r = APIRouter()

    @r.get("/health_generate")
    async def health_generate():
        counts = state.engine_counts()
        if counts is None or counts["running"] > 0:  # no engine loop here, or it is generating already
            return Response(status_code=200)
        try:
            await asyncio.wait_for(_generate_one(state), HEALTH_GENERATE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - any failure to generate is an unhealthy server, which is the answer
            return Response(status_code=503)
        return Response(status_code=200)

    @r.get("/get_model_info")
    @r.get("/model_info")
    async def get_model_info():
        return model_info(state)

    @r.get("/get_server_info")
    @r.get("/server_info")
    async def get_server_info():
        return server_info(state)

    @r.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout: float = Query(0.0, ge=0.0)):
        return PlainTextResponse(FLUSHED)

    @r.get("/v1/models")
    async def models():
        name = served_name(state)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(state.started),
                                            "owned_by": "rollplex", "root": name, "parent": None,
                                            "max_model_len": state.cfg.engine.max_model_len}]}

    return r
