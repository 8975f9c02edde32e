"""SGLang in a process of its own (engine_patches/sglang/remote.py), against the fake SGLang put on that
process's PYTHONPATH only: this process never imports it, as the trainer with the machine's transformers
never imports SGLang 0.5.17 with its own.

- the RL step through the engine process takes the native engine's two steps (tokens, logprobs, losses,
  weights): the policy reaches SGLang's copy as payloads serialized here, the hook's control ops reach its
  scheduler, an error there comes back with its type and the engine keeps serving
- the fused schedule gets each group as it finishes there, streamed over the socket; a stream closed early
  is cancelled and the engine keeps serving
- an engine process that cannot start says why
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from helpers import FORWARD_TERMS, assert_fp32_close, assert_weights_close

from engine_patches.sglang.outputs import generate_kwargs, sample_seeds
from engine_patches.sglang.remote import RemoteEngine
from rollplex import backends
from rollplex.backends import BackendConfig
from rollplex.engine import Engine, EngineConfig, SamplingParams
from rollplex.models import ModelInputs, load_model
from rollplex.rl.config import RLConfig
from rollplex.rl.step import RLStep, rollout_requests
from rollplex.tiny import shape_color

FAKE = Path(__file__).resolve().parent / "fake_sglang"
ROWS = shape_color.make_rows(4, seed=3)
BASE = dict(n=3, max_new_tokens=6, lr=1e-3, kl_coef=0.05, micro_batch_prompts=2, micro_batch_samples=4)
REMOTE = BackendConfig("sglang", sglang_pythonpath=str(FAKE))


def _step(tiny_dir, proc, rollout, **cfg) -> RLStep:
    return RLStep(load_model(tiny_dir), rollout, RLConfig(**{**BASE, **cfg}), proc, reward_fn="shape_color")


def test_remote_engine_takes_the_native_steps(tiny_dir, proc):
    model = load_model(tiny_dir)
    native = RLStep(model, Engine(model, proc, EngineConfig(max_num_seqs=64, max_model_len=256)),
                    RLConfig(**BASE), proc, reward_fn="shape_color")
    assert backends.require_backend("sglang", REMOTE) == "0.5.23+rollplex.fake"  # seen under its PYTHONPATH
    sgl = _step(tiny_dir, proc, backends.rollout_backend(REMOTE, str(tiny_dir), proc, "float32", seed=0))
    be = sgl.backend
    assert isinstance(be.engine, RemoteEngine) and be.version == "0.5.23+rollplex.fake"
    try:
        for step in range(2):
            a, b = native.rollout(ROWS), sgl.rollout(ROWS)
            assert torch.equal(a.responses, b.responses) and torch.equal(a.mask, b.mask)
            assert_fp32_close(b.rollout_logprobs, a.rollout_logprobs, "rollout logprobs", FORWARD_TERMS)
            rewards = torch.tensor([float((i + step) % 3 == 0) for i in range(a.num_samples)])
            a.rewards, b.rewards = rewards, rewards.clone()
            ma, mb = native.train(a), sgl.train(b)
            for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
                assert_fp32_close(mb[k], ma[k], k, scale=1.0)
            for (name, wa), wb in zip(native.model.state_dict().items(), sgl.model.state_dict().values()):
                assert_weights_close(wb, wa, name)
        assert be.weight_pushes == 2  # step 2 sampled the same tokens: the update reached SGLang's copy
        # the hooked scheduler in the fake's scheduler process, two processes away, counted the decode steps
        assert be.engine.hook_metrics()["rollplex/sglang_decode_steps"] >= 2 * 5
        with pytest.raises(RuntimeError, match="SGLang engine process.*unknown control op .nope."):
            be.engine.call("nope")
        with pytest.raises(NotImplementedError, match="batch of input_ids"):  # the fake's refusal, typed
            be.engine.generate(prompt="text")
        be.enter_phase("rollout")
        assert be.engine.generate(**generate_kwargs([ModelInputs([5, 6])], [SamplingParams(max_new_tokens=2)],
                                                    [[1]]))[0]["output_ids"]  # still serving
    finally:
        be.close()
    assert be.engine.proc.poll() is not None
    assert not any(m == "sglang" or m.startswith("sglang.") for m in sys.modules)


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer\.step\(\)`")
def test_remote_groups_stream_as_they_finish(tiny_dir, proc, tail):
    lengths = [3, 9, 5, 12]  # the fake answers a batch request after 20 ms per token of its longest
    rl = _step(tiny_dir, proc, backends.rollout_backend(REMOTE, str(tiny_dir), proc, "float32", seed=0),
               schedule="fused", lr=1e-4)
    engine = rl.backend.engine
    try:
        prompts, params, per_prompt = rollout_requests(rl.processor, ROWS, rl.cfg, rl.step_idx)
        params = [SamplingParams(n=p.n, max_new_tokens=k, seed=p.seed, ignore_eos=True)
                  for p, k in zip(params, lengths)]
        batch, m = rl.run(prompts, params, rewards=lambda b, ids: (torch.ones(b.num_samples), {}), **per_prompt)
        order = batch.finish_order()
        assert sorted(order) == [0, 1, 2, 3] and order[0] == 0 and order[-1] == 3
        assert m["rollplex/fused_groups_in_rollout"] >= 2
        # a stream closed after its first answer cancels the rest; the engine serves the next request
        rl.backend.enter_phase("rollout")
        kw = generate_kwargs(prompts, params, sample_seeds(params, random.Random(0)))
        starts = [0, 3, 6, 9, 12]
        stream = engine.generate_groups(kw, starts)
        first = next(stream)
        stream.close()
        assert first[0] == 0 and len(first[1]) == 3
        again = list(engine.generate_groups(kw, starts))
        order = [i for i, _ in again]  # 0 first and 3 last even on a busy machine
        assert sorted(order) == [0, 1, 2, 3] and order[0] == 0 and order[-1] == 3
    finally:
        rl.backend.close()


def test_an_engine_process_that_cannot_start_says_why(tmp_path):
    with pytest.raises(ImportError, match=r"none found under sglang_pythonpath"):
        backends.require_backend("sglang", BackendConfig("sglang", sglang_pythonpath=str(tmp_path)))
    with pytest.raises(RuntimeError, match=r"start failed in the SGLang engine process: ModuleNotFoundError"):
        RemoteEngine(pythonpath=str(tmp_path), model_path="unused")
    with pytest.raises(ValueError, match="sglang_pythonpath"):
        BackendConfig("sglang", sglang_pythonpath="")
