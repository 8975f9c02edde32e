"""Qwen3-VL on CUDA (skipped without it): our bf16 model against transformers' in bf16 at the real
Qwen3-VL-2B widths (head dim 128, the 1024-wide tower, a 448x448 image; fewer layers), and the engine's
graphed decode (Triton paged attention, the q/k head norm before the kernel's rotary) giving the
reference decoder's greedy tokens and the full forward's logprobs."""

import inspect
from dataclasses import replace

import pytest
import torch

from rollplex.engine import Engine, EngineConfig, SamplingParams
from rollplex.generate import generate
from rollplex.models import ModelInputs, Qwen3VL, init_weights, save_model
from rollplex.presets import preset

pytestmark = pytest.mark.gpu


def _reduced_2b():
    cfg = preset("qwen3-vl-2b")
    return replace(cfg, text=replace(cfg.text, num_hidden_layers=4),
                   vision=replace(cfg.vision, depth=8, deepstack_visual_indexes=(1, 3, 5)))


def _image_prompt(cfg, g: torch.Generator, grid=(1, 28, 28), text=(12, 9)) -> ModelInputs:
    t, h, w = grid
    ids = torch.randint(1000, 100000, (text[0],), generator=g).tolist()
    ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * (t * h * w // 4) + [cfg.vision_end_token_id]
    ids += torch.randint(1000, 100000, (text[1],), generator=g).tolist()
    pixels = torch.randn(t * h * w, cfg.vision.patch_dim, generator=g)
    return ModelInputs(ids, pixels, torch.tensor([grid]))


def test_bf16_logits_match_transformers(tmp_path):
    from transformers import Qwen3VLForConditionalGeneration

    cfg = _reduced_2b()
    with torch.device("cuda"):
        ours = init_weights(Qwen3VL(cfg), seed=0, std=0.02).to(torch.bfloat16).eval()
    save_model(ours, tmp_path / "ckpt")
    hf = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16,
                                                         attn_implementation="sdpa").cuda().eval()
    p = _image_prompt(cfg, torch.Generator().manual_seed(0))
    ids = torch.tensor([p.input_ids], device="cuda")
    kw = dict(input_ids=ids, pixel_values=p.pixel_values.cuda(), image_grid_thw=p.image_grid_thw.cuda())
    if "mm_token_type_ids" in inspect.signature(hf.forward).parameters:
        kw["mm_token_type_ids"] = (ids == cfg.image_token_id).int()
    with torch.no_grad():
        ref = hf(**kw).logits[0].float()
        got = ours([replace(p, pixel_values=p.pixel_values.cuda())])[0].float()
    assert got.shape == ref.shape
    assert (got - ref).abs().mean() / ref.abs().mean() < 2e-2
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def _kernel_qwen3():
    """A small fp32 Qwen3-VL whose head dim (128) the Triton decode kernels take."""
    cfg = _reduced_2b()
    cfg = replace(cfg, text=replace(cfg.text, vocab_size=2048, hidden_size=256, intermediate_size=512,
                                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
                  vision=replace(cfg.vision, depth=3, hidden_size=128, intermediate_size=256, num_heads=2,
                                 out_hidden_size=256, deepstack_visual_indexes=(0, 1, 2)),
                  image_token_id=2000, video_token_id=2001, vision_start_token_id=2002, vision_end_token_id=2003,
                  eos_token_id=2, bos_token_id=1, pad_token_id=0)
    with torch.device("cuda"):
        return init_weights(Qwen3VL(cfg), seed=0, std=0.05).eval()


def _small_prompt(cfg, g, i):
    ids = torch.randint(3, 1990, (3 + i,), generator=g).tolist()
    n = (4 + 2 * i) * 6
    ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * (n // 4) + [cfg.vision_end_token_id]
    ids += torch.randint(3, 1990, (5,), generator=g).tolist()
    return ModelInputs(ids, torch.randn(n, cfg.vision.patch_dim, generator=g).cuda(), torch.tensor([[1, 4 + 2 * i, 6]]))


def test_graphed_engine_matches_reference_decoder():
    model = _kernel_qwen3()
    eng = Engine(model, None, EngineConfig(max_num_seqs=32, max_model_len=512, kv_cache_tokens=64 * 512,
                                           cuda_graph_max_bs=32))
    assert eng.runner.graphs
    g = torch.Generator().manual_seed(0)
    prompts = [_small_prompt(model.cfg, g, i) for i in range(5)]
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.samples[0].token_ids == generate(model, p, 40).token_ids
    sampled = eng.generate(prompts, SamplingParams(temperature=0.9, max_new_tokens=30, ignore_eos=True, n=3, seed=4))
    for p, o in zip(prompts, sampled):
        for s in o.samples:
            full = p.with_response(s.token_ids)
            with torch.no_grad():
                logits = model([full])[0].float()
            P = len(p.input_ids)
            ref = torch.log_softmax(logits[P - 1 : P - 1 + len(s.token_ids)] / 0.9, -1)
            ref = ref.gather(-1, torch.tensor(s.token_ids, device="cuda")[:, None]).squeeze(-1)
            assert (ref.cpu() - torch.tensor(s.logprobs)).abs().max().item() < 1e-4
