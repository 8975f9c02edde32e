"""Shared helpers for the Qwen3-VL CPU tests: a tiny random Qwen3-VL (transformers config and our
twin with identical weights) and random image prompts in its patch size."""

from __future__ import annotations

import torch
from helpers import IMG, VE, VID, VS, make_prompt, random_text_ids

from rollplex.models import ModelConfig, ModelInputs, Qwen3VL, hf_to_rollplex, init_weights

PATCH_DIM = 3 * 2 * 16 * 16


def tiny_qwen3_hf_config(tie: bool = False, vocab: int = 320):
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=vocab, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
            rope_scaling={"rope_type": "default", "mrope_section": [6, 5, 5], "mrope_interleaved": True},
            rope_theta=10000.0, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
            attention_bias=False,
        ),
        vision_config=dict(
            depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=16, spatial_merge_size=2,
            temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[0, 2],
        ),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE,
        tie_word_embeddings=tie,
    )


def qwen3_twin(tie: bool = False, seed: int = 0):
    """(transformers Qwen3VLForConditionalGeneration, our Qwen3VL) with identical random fp32 weights."""
    from transformers import Qwen3VLForConditionalGeneration

    hf_cfg = tiny_qwen3_hf_config(tie)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = Qwen3VLForConditionalGeneration(hf_cfg).eval()
    with torch.no_grad():  # HF's init leaves biases at zero and norms at one; make them matter
        for n, p in hf.named_parameters():
            if n.endswith("bias") or "norm" in n or "pos_embed" in n:
                p.add_(torch.randn_like(p) * 0.1)
    cfg = ModelConfig.from_hf(hf_cfg)
    ours = Qwen3VL(cfg)
    ours.load_state_dict(hf_to_rollplex(hf.state_dict(), cfg), strict=True)
    return hf, ours.eval()


def tiny_qwen3(seed: int = 0, tie: bool = False) -> Qwen3VL:
    return init_weights(Qwen3VL(ModelConfig.from_hf(tiny_qwen3_hf_config(tie))), seed=seed, std=0.1)


def qwen3_prompt(gen: torch.Generator, images=(), text_len=(5, 4)):
    return make_prompt(gen, images=images, text_len=text_len, patch_dim=PATCH_DIM)


def qwen3_video_prompt(gen: torch.Generator, video=(2, 4, 6), images=(), stamp_len: int = 3) -> ModelInputs:
    """Text, the images, then a video as Qwen3-VL lays it out: per temporal patch, a timestamp (random
    text tokens here) and the frame's `<|vision_start|><|video_pad|>... <|vision_end|>` block; more text."""
    def text(n):
        return random_text_ids(n, gen, 290).tolist()

    p = qwen3_prompt(gen, images=images, text_len=(4, 0))
    t, h, w = video
    ids = list(p.input_ids)
    for _ in range(t):
        ids += text(stamp_len) + [VS] + [VID] * (h * w // 4) + [VE]
    ids += text(3)
    return ModelInputs(ids, p.pixel_values, p.image_grid_thw, torch.randn(t * h * w, PATCH_DIM, generator=gen),
                       torch.tensor([video]))


def hf_logits_qwen3(hf, p: ModelInputs) -> torch.Tensor:
    """transformers' logits for one prompt (token types: 1 image, 2 video)."""
    ids = torch.tensor([p.input_ids])
    kw = dict(input_ids=ids, mm_token_type_ids=(ids == IMG).int() + 2 * (ids == VID).int())
    if p.pixel_values is not None:
        kw.update(pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw)
    if p.pixel_values_videos is not None:
        kw.update(pixel_values_videos=p.pixel_values_videos, video_grid_thw=p.video_grid_thw)
    with torch.no_grad():
        return hf(**kw).logits[0]
