"""The rollout engine on the tiny Qwen3-VL checkpoint (CPU, fp32): greedy tokens equal transformers'
`generate`, sampled logprobs equal the trainer's (full forward and the packed training pass), the n
samples of a prompt share its KV, preemption and re-prefill change nothing."""

import pytest
import torch
from PIL import Image

from rollplex.engine import Engine, EngineConfig, SamplingParams
from rollplex.generate import generate
from rollplex.models import Qwen3VL, load_model
from rollplex.processor import VLProcessor
from rollplex.tiny import write_tiny
from rollplex.tiny.shape_color import demo_image


@pytest.fixture(scope="module")
def q3_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny_qwen3"), seed=1, family="qwen3_vl")


@pytest.fixture(scope="module")
def q3_proc(q3_dir):
    return VLProcessor.from_pretrained(q3_dir)


def _engine(path, proc, **cfg):
    model = load_model(path).eval()
    assert isinstance(model, Qwen3VL)
    return Engine(model, proc, EngineConfig(**cfg))


def _prompts(proc):
    msgs = lambda k: [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"What is {k}?"}]}]  # noqa: E731
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Same?"}]}]
    return [
        proc.encode(messages=msgs("this"), images=[demo_image("red")]),
        proc.encode(messages=msgs("that shape"), images=[Image.new("RGB", (45, 90), "green")]),
        proc.encode(messages=two, images=[demo_image("blue"), demo_image("yellow", 40)]),
        proc.encode(text="<|im_start|>user\nNo image at all<|im_end|>\n<|im_start|>assistant\n"),
    ]


def test_processor_matches_transformers(q3_dir, q3_proc):
    """Pixels and grids equal transformers' image processor configured from the checkpoint (16-pixel
    patches), and each image takes the pad tokens `Qwen3VLProcessor.replace_image_token` gives it."""
    import itertools
    import json
    from types import SimpleNamespace

    import numpy as np
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    cfg = json.loads((q3_dir / "preprocessor_config.json").read_text())
    keys = ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")
    hf_ip = Qwen2VLImageProcessorPil(**{k: cfg[k] for k in keys})
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in [(61, 93), (150, 40)]]
    content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Which is red?"}]
    out = q3_proc.encode(messages=[{"role": "user", "content": content}], images=images)
    ref = hf_ip(images=images, return_tensors="pt")
    assert out.pixel_values.shape[1] == 3 * 2 * 16 * 16
    assert torch.equal(out.pixel_values, ref["pixel_values"]) and torch.equal(out.image_grid_thw, ref["image_grid_thw"])
    fake = SimpleNamespace(image_processor=hf_ip, image_token="<|image_pad|>")
    pads = [Qwen3VLProcessor.replace_image_token(fake, ref, i).count("<|image_pad|>") for i in range(2)]
    ids, img = out.input_ids, q3_proc.image_token_id
    runs = [sum(1 for _ in g) for k, g in itertools.groupby(ids) if k == img]
    assert runs == pads


def test_greedy_matches_transformers_generate(q3_dir, q3_proc):
    from transformers import Qwen3VLForConditionalGeneration

    hf = Qwen3VLForConditionalGeneration.from_pretrained(q3_dir, attn_implementation="eager").eval()
    eng = _engine(q3_dir, q3_proc)
    prompts = _prompts(q3_proc)
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p.input_ids])
        mm = (ids == q3_proc.image_token_id).int()
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=mm)
        if p.pixel_values is not None:
            kw.update(pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw)
        with torch.no_grad():
            ref = hf.generate(**kw, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert o.samples[0].token_ids == ref[0, ids.shape[1]:].tolist()
        assert o.samples[0].token_ids == generate(eng.model, p, max_new_tokens=10).token_ids


def test_sampled_logprobs_equal_the_trainers(q3_dir, q3_proc):
    """Engine logprobs == a full forward's and == the packed training pass (`group_hidden`) over the
    same prompts and sampled responses."""
    eng = _engine(q3_dir, q3_proc)
    prompts = _prompts(q3_proc)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12, ignore_eos=True, n=2, seed=11)
    outs = eng.generate(prompts, params)
    samples = [(g, s) for g, o in enumerate(outs) for s in o.samples]
    R = max(len(s.token_ids) for _, s in samples)
    resp = torch.zeros(len(samples), R, dtype=torch.long)
    for i, (_, s) in enumerate(samples):
        resp[i, : len(s.token_ids)] = torch.tensor(s.token_ids)
    lens = [len(s.token_ids) for _, s in samples]
    with torch.no_grad():
        hidden = eng.model.group_hidden(prompts, resp, lens, [g for g, _ in samples])
        packed = torch.log_softmax(eng.model.logits(hidden) / 0.7, -1).gather(-1, resp[..., None])[..., 0]
        for i, (g, s) in enumerate(samples):
            full = prompts[g].with_response(s.token_ids)
            P = len(prompts[g].input_ids)
            rows = torch.log_softmax(eng.model([full])[0][P - 1 : P - 1 + lens[i]] / 0.7, -1)
            ref = rows.gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
            assert (torch.tensor(s.logprobs) - ref).abs().max().item() <= 1e-5
            assert (packed[i, : lens[i]] - ref).abs().max().item() <= 1e-5


def test_n_samples_share_prefix_equal_independent_requests(q3_dir, q3_proc):
    eng = _engine(q3_dir, q3_proc)
    p = _prompts(q3_proc)[2]
    grouped = eng.generate([p], SamplingParams(temperature=1.0, max_new_tokens=9, n=4, seed=100, ignore_eos=True))[0]
    singles = eng.generate([p] * 4, [SamplingParams(temperature=1.0, max_new_tokens=9, seed=100 + i, ignore_eos=True)
                                     for i in range(4)])
    assert [s.token_ids for s in grouped.samples] == [o.samples[0].token_ids for o in singles]
    assert len({tuple(s.token_ids) for s in grouped.samples}) > 1


def test_preemption_under_tiny_kv_gives_same_outputs(q3_dir, q3_proc):
    prompts = _prompts(q3_proc)
    params = [SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True, n=3, seed=5)] * 2
    roomy = _engine(q3_dir, q3_proc).generate(prompts, params)
    tight = _engine(q3_dir, q3_proc, kv_cache_tokens=16 * 14)
    outs = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    for a, b in zip(roomy, outs):
        assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
        for x, y in zip(a.samples, b.samples):
            assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) <= 1e-5


def _video(n, size=(40, 56)):
    return [Image.new("RGB", size, (40 * i % 255, 90, 200 - 30 * i)) for i in range(n)]


@pytest.mark.parametrize("frames", [4, 3])  # 3: padded to 4 by the last frame, as the timestamps are
def test_video_prompt_matches_transformers(q3_dir, q3_proc, frames):
    """A video becomes `Qwen3VLProcessor.replace_video_token`'s timestamped frame blocks (the template's
    wrapper dropped), token for token."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    assert q3_proc.video_timestamps
    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What moves?"}]}]
    out = q3_proc.encode(messages=msgs, videos=[_video(frames)], fps=2.0)
    t, h, w = out.video_grid_thw[0].tolist()
    assert t == 2 and out.pixel_values_videos.shape == (t * h * w, 3 * 2 * 16 * 16)
    vp = q3_proc.video_processor
    fake = SimpleNamespace(video_processor=vp, video_token="<|video_pad|>", vision_start_token="<|vision_start|>",
                           vision_end_token="<|vision_end|>",
                           _calculate_timestamps=lambda *a: Qwen3VLProcessor._calculate_timestamps(None, *a))
    meta = SimpleNamespace(fps=2.0, frames_indices=list(range(frames)))
    inputs = {"video_grid_thw": out.video_grid_thw, "video_metadata": [meta]}
    blocks = Qwen3VLProcessor.replace_video_token(fake, inputs, 0)
    text = q3_proc.apply_chat_template(msgs).replace("<|vision_start|><|video_pad|><|vision_end|>", blocks)
    assert out.input_ids == AutoTokenizer.from_pretrained(q3_dir)(text, add_special_tokens=False)["input_ids"]


def test_video_generation_matches_transformers(q3_dir, q3_proc):
    from transformers import Qwen3VLForConditionalGeneration

    hf = Qwen3VLForConditionalGeneration.from_pretrained(q3_dir, attn_implementation="eager").eval()
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Same?"}]}]
    p = q3_proc.encode(messages=msgs, images=[demo_image("red")], videos=[_video(4)])
    eng = _engine(q3_dir, q3_proc)
    out = eng.generate([p], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))[0].samples[0]
    ids = torch.tensor([p.input_ids])
    mm = (ids == q3_proc.image_token_id).int() + 2 * (ids == q3_proc.video_token_id).int()
    with torch.no_grad():
        ref = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=mm,
                          pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw,
                          pixel_values_videos=p.pixel_values_videos, video_grid_thw=p.video_grid_thw,
                          max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.token_ids == ref[0, ids.shape[1]:].tolist()
    assert (torch.tensor(out.logprobs) - _full_logprobs(eng.model, p, out.token_ids)).abs().max().item() <= 1e-5


def _full_logprobs(model, p, tokens):
    with torch.no_grad():
        logits = model([p.with_response(tokens)])[0]
    P = len(p.input_ids)
    return torch.log_softmax(logits[P - 1 : P - 1 + len(tokens)], -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
