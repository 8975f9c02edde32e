"""The rollout engine on the tiny model (CPU, fp32): parity with transformers and with our own
full forward, shared-prompt forking, stop conditions, preemption, live weights, the decode hook."""


import pytest
import torch
from PIL import Image

from rollplex.engine import Engine, EngineConfig, RecordingHook, SamplingParams
from rollplex.generate import generate
from rollplex.models import load_model
from rollplex.tiny.shape_color import demo_image


def _engine(tiny_dir, proc, **cfg):
    model = load_model(tiny_dir).eval()
    return Engine(model, proc, EngineConfig(**cfg))


def _prompts(proc):
    msgs = lambda k: [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"What is {k}?"}]}]  # noqa: E731
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Same?"}]}]
    return [
        proc.encode(messages=msgs("this"), images=[demo_image("red")]),
        proc.encode(messages=msgs("that shape"), images=[Image.new("RGB", (45, 70), "green")]),
        proc.encode(messages=two, images=[demo_image("blue"), demo_image("yellow", 40)]),
        proc.encode(text="<|im_start|>user\nNo image at all<|im_end|>\n<|im_start|>assistant\n"),
    ]


def _full_logprobs(model, prompt, out_ids, temperature):
    full = prompt.with_response(out_ids)  # sampled vision placeholder ids are text in a response
    with torch.no_grad():
        logits = model([full])[0]
    P = len(prompt.input_ids)
    rows = torch.log_softmax(logits[P - 1 : P - 1 + len(out_ids)] / temperature, -1)
    return rows.gather(-1, torch.tensor(out_ids)[:, None]).squeeze(-1)


def test_greedy_matches_transformers_generate(tiny_dir, proc):
    from transformers import Qwen2_5_VLForConditionalGeneration

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_dir, attn_implementation="eager").eval()
    eng = _engine(tiny_dir, proc)
    prompts = _prompts(proc)
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p.input_ids])
        mm = (ids == proc.image_token_id).int()
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=mm)
        if p.pixel_values is not None:
            kw.update(pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw)
        with torch.no_grad():
            ref = hf.generate(**kw, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert o.samples[0].token_ids == ref[0, ids.shape[1] :].tolist()
        assert o.samples[0].finish_reason == "length"


def test_sampled_logprobs_equal_full_forward(tiny_dir, proc):
    eng = _engine(tiny_dir, proc)
    prompts = _prompts(proc)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12, ignore_eos=True, n=2, seed=11)
    for p, o in zip(prompts, eng.generate(prompts, params)):
        for s in o.samples:
            ref = _full_logprobs(eng.model, p, s.token_ids, 0.7)
            assert (torch.tensor(s.logprobs) - ref).abs().max().item() <= 1e-5


def test_n_samples_share_prefix_equal_independent_requests(tiny_dir, proc):
    eng = _engine(tiny_dir, proc)
    p = _prompts(proc)[2]
    grouped = eng.generate([p], SamplingParams(temperature=1.0, max_new_tokens=9, n=4, seed=100, ignore_eos=True))[0]
    singles = eng.generate([p] * 4, [SamplingParams(temperature=1.0, max_new_tokens=9, seed=100 + i, ignore_eos=True)
                                     for i in range(4)])
    assert [s.token_ids for s in grouped.samples] == [o.samples[0].token_ids for o in singles]
    assert len({tuple(s.token_ids) for s in grouped.samples}) > 1  # the samples differ
    for a, b in zip(grouped.samples, singles):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.samples[0].logprobs)) <= 1e-5


def test_per_sample_length_caps_end_each_sample_where_given(tiny_dir, proc):
    """`sample_max_new_tokens`: each sample of a group stops at its own cap, with the tokens it would have
    drawn without one (the caps only cut), and a cap outside [1, max_new_tokens] or of the wrong count is
    refused."""
    eng = _engine(tiny_dir, proc)
    p = _prompts(proc)[0]
    base = dict(temperature=1.0, max_new_tokens=9, n=3, seed=7, ignore_eos=True)
    whole = eng.generate([p], SamplingParams(**base))[0].samples
    cut = eng.generate([p], SamplingParams(**base, sample_max_new_tokens=(2, 9, 5)))[0].samples
    assert [len(s.token_ids) for s in cut] == [2, 9, 5]
    assert [s.token_ids for s in cut] == [w.token_ids[: len(s.token_ids)] for s, w in zip(cut, whole)]
    assert all(s.finish_reason == "length" for s in cut)
    for bad in ((2, 9), (0, 1, 2), (1, 2, 10)):
        with pytest.raises(ValueError, match="sample_max_new_tokens"):
            SamplingParams(**base, sample_max_new_tokens=bad)


def test_stop_conditions(tiny_dir, proc):
    eng = _engine(tiny_dir, proc)
    p = _prompts(proc)[0]
    free = eng.generate([p], SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))[0].samples[0]
    stop_tok = free.token_ids[4]
    first = free.token_ids.index(stop_tok)
    out = eng.generate([p], SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=[stop_tok]))[0].samples[0]
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop" and out.matched_stop == stop_tok
    # eos stops unless ignore_eos
    eng.eos_token_id = stop_tok
    out = eng.generate([p], SamplingParams(temperature=0, max_new_tokens=12))[0].samples[0]
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"
    eng.eos_token_id = proc.eos_token_id
    # stop strings: stop at the first occurrence, text trimmed before it
    text = proc.decode(free.token_ids[:6], skip_special_tokens=False)
    stop_str = text[-3:] if len(text.strip()) >= 3 else text
    out = eng.generate([p], SamplingParams(temperature=0, max_new_tokens=12, stop=[stop_str], ignore_eos=True,
                                           skip_special_tokens=False))[0].samples[0]
    assert out.finish_reason == "stop" and out.matched_stop == stop_str and len(out.token_ids) <= 6
    assert stop_str not in out.text
    out = eng.generate([p], SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True))[0].samples[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_preemption_under_tiny_kv_gives_same_outputs(tiny_dir, proc):
    prompts = _prompts(proc)
    params = [SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True, n=3, seed=5)] * 2
    roomy = _engine(tiny_dir, proc).generate(prompts, params)
    tight = _engine(tiny_dir, proc, kv_cache_tokens=16 * 14)
    outs = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    for a, b in zip(roomy, outs):
        assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
        for x, y in zip(a.samples, b.samples):
            assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) <= 1e-5
    assert tight.blocks.num_free == tight.blocks.num_blocks - 1  # everything freed


def test_decode_split_k_gives_same_outputs(tiny_dir, proc):
    """Split-K o/down projections (fp32 partials summed by the next norm) change where the sums run,
    not what the engine generates."""
    prompts = _prompts(proc)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, n=2, seed=3)
    plain = _engine(tiny_dir, proc).generate(prompts, params)
    split = _engine(tiny_dir, proc, decode_split_k=(2, 4)).generate(prompts, params)
    for a, b in zip(plain, split):
        assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
        for x, y in zip(a.samples, b.samples):
            assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) <= 1e-5
    with pytest.raises(ValueError, match="decode_split_k"):
        EngineConfig(decode_split_k=(0, 2))


def test_block_size_defaults_per_device(tiny_dir, proc) -> None:
    """None picks 64-token blocks on CUDA (the TMA attention reads one block per tile) and 16 on CPU; an
    explicit size is kept, and other sizes are refused."""
    assert EngineConfig().for_device("cuda").block_size == 64
    assert EngineConfig().for_device("cpu").block_size == 16
    assert EngineConfig(block_size=32).for_device("cuda").block_size == 32
    assert _engine(tiny_dir, proc).cfg.block_size == 16
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=48)


def test_tuner_candidates_come_from_the_config_and_are_validated() -> None:
    """None leaves the kernel package's defaults to the tuners; given candidates are checked up front."""
    from rollplex.kernels.paged_attention import DECODE_CANDIDATES, attn_variant

    gather = tuple(c for c in DECODE_CANDIDATES if attn_variant(c[1]) == "gather")
    cfg = EngineConfig(attn_candidates=gather, split_k_candidates=(1, 2), swiglu_candidates=((64, 64, 64, 4, 4),))
    assert cfg.attn_candidates == gather and EngineConfig().attn_candidates is None
    for bad in ((), ((1, {"early_v": True}),), ((0, {}),), ((None, {"tile_n": 48}),), ((1, {"tma": 1}),), [(1, {})]):
        with pytest.raises(ValueError):
            EngineConfig(attn_candidates=bad)
    for bad in ((), (0, 2), (1.5,)):
        with pytest.raises(ValueError, match="split-K"):
            EngineConfig(split_k_candidates=bad)
    for bad in ((), ((64, 24, 64, 4, 4),), ((64, 64, 64, 4),)):
        with pytest.raises(ValueError):
            EngineConfig(swiglu_candidates=bad)


def test_weight_updates_are_visible_without_copy(tiny_dir, proc):
    eng = _engine(tiny_dir, proc)
    p = _prompts(proc)[1]
    sp = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    before = eng.generate([p], sp)[0].samples[0].token_ids
    with torch.no_grad():  # what an optimizer step does: in-place update of the shared parameters
        for prm in eng.model.parameters():
            prm.add_(torch.randn_like(prm) * 0.05)
    after = eng.generate([p], sp)[0].samples[0].token_ids
    assert after != before
    assert after == generate(eng.model, p, max_new_tokens=8).token_ids


def _module_state(model) -> dict:
    """Every module's attributes, parameters, buffers and children, by identity."""
    return {name: {k: id(v) for k, v in [*vars(m).items(), *m._parameters.items(), *m._buffers.items(),
                                         *m._modules.items()]}
            for name, m in model.named_modules()}


def test_engine_leaves_the_trainer_model_uncompiled_and_unpatched(tiny_dir, proc, monkeypatch):
    """The engine compiles only its own decode functions (forced on CPU here; torch.compile is recorded,
    not run): after building an engine and generating, every module of the model holds the same
    attributes, parameters and submodules (its forward and glue functions are not swapped), and the
    model computes what it computed before."""
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(fn) or fn)
    model = load_model(tiny_dir).eval()
    p = _prompts(proc)[0]
    state = _module_state(model)
    with torch.no_grad():
        before = model([p])
    Engine(model, proc, EngineConfig())  # CPU default: nothing compiled
    assert not compiled
    eng = Engine(model, proc, EngineConfig(compile_decode=True))
    out = eng.generate([p], SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
    assert compiled and all(fn.__module__ != "torch.nn.modules.module" for fn in compiled)
    assert out[0].samples[0].token_ids == generate(model, p, max_new_tokens=6).token_ids
    assert _module_state(model) == state
    assert "forward" not in vars(model) and "forward" not in vars(model.model)
    with torch.no_grad():
        assert torch.equal(model([p]), before)


def test_decode_hook_and_input_logprobs(tiny_dir, proc):
    hook = RecordingHook()
    model = load_model(tiny_dir).eval()
    eng = Engine(model, proc, EngineConfig(), hooks=[hook])
    p = _prompts(proc)[0]
    out = eng.generate([p, p], SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True, logprob_start_len=3))
    assert [i.step for i in hook.infos] == list(range(4)) and hook.infos[0].batch_size == 2
    # the most recent *completed* step's time: with overlap scheduling that lags one more step
    assert hook.infos[0].last_step_ms is None and all(i.last_step_ms > 0 for i in hook.infos[2:])
    lp = out[0].input_token_logprobs  # prompt tokens 3 .. L-1, each given the tokens before it
    assert len(lp) == len(p.input_ids) - 3 and None not in lp
    with torch.no_grad():
        logits = model([p])[0]
    ref = torch.log_softmax(logits[2:-1], -1).gather(-1, torch.tensor(p.input_ids[3:])[:, None]).squeeze(-1)
    assert (torch.tensor(lp) - ref).abs().max().item() <= 1e-5
    out0 = eng.generate([p], SamplingParams(temperature=0, max_new_tokens=1, logprob_start_len=0))
    assert out0[0].input_token_logprobs[0] is None and len(out0[0].input_token_logprobs) == len(p.input_ids)


def test_bad_requests_raise_value_error_and_leave_engine_usable(tiny_dir, proc):
    eng = _engine(tiny_dir, proc, max_model_len=64)
    with pytest.raises(ValueError):
        eng.add_request([10**6])
    with pytest.raises(ValueError):
        eng.add_request(list(range(3, 80)))  # longer than max_model_len
    with pytest.raises(ValueError):
        eng.add_request([proc.image_token_id, 5])  # an image placeholder without an image
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    out = eng.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True))
    assert len(out[0].samples[0].token_ids) == 2 and not eng.has_work
