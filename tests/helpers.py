"""Shared helpers for the CPU tests: a tiny Qwen2.5-VL config, random inputs, HF model twins."""

from __future__ import annotations

import torch

from rollplex.models import ModelConfig, ModelInputs, Qwen25VL, hf_to_rollplex, init_weights

IMG, VID, VS, VE = 300, 301, 302, 303


def tiny_hf_config(tie: bool = False, vocab: int = 320):
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, rope_theta=10000.0,
            max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
        ),
        vision_config=dict(
            depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14, spatial_merge_size=2,
            temporal_patch_size=2, window_size=56, out_hidden_size=64, fullatt_block_indexes=[1],
            tokens_per_second=2,
        ),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE,
        tie_word_embeddings=tie,
    )


def hf_twin(tie: bool = False, seed: int = 0):
    """(transformers model, our model) with identical random fp32 weights."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    hf_cfg = tiny_hf_config(tie)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = Qwen2_5_VLForConditionalGeneration(hf_cfg).eval()
    with torch.no_grad():  # HF's default init leaves biases at zero; make them matter
        for n, p in hf.named_parameters():
            if n.endswith("bias") or "norm" in n or "ln_q" in n:
                p.add_(torch.randn_like(p) * 0.1)
    cfg = ModelConfig.from_hf(hf_cfg)
    ours = Qwen25VL(cfg)
    ours.load_state_dict(hf_to_rollplex(hf.state_dict(), cfg), strict=True)
    return hf, ours.eval()


def tiny_model(seed: int = 0, tie: bool = False) -> Qwen25VL:
    return init_weights(Qwen25VL(ModelConfig.from_hf(tiny_hf_config(tie))), seed=seed, std=0.1)


def kernel_model(device: str = "cuda") -> Qwen25VL:
    """A small model whose head_dim (64) the Triton decode kernels take: the GPU engine tests' model."""
    from rollplex.models import TextConfig, VisionConfig

    cfg = ModelConfig(
        text=TextConfig(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, mrope_section=(8, 12, 12),
                        tie_word_embeddings=False),
        vision=VisionConfig(depth=2, hidden_size=64, intermediate_size=96, num_heads=2, window_size=56,
                            out_hidden_size=256, fullatt_block_indexes=(1,)),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE, eos_token_id=2)
    with torch.device(device):
        return init_weights(Qwen25VL(cfg), seed=0, std=0.05).eval()


def make_prompt(gen: torch.Generator, images=(), videos=(), text_len=(5, 4), patch_dim=3 * 2 * 14 * 14,
                vocab=290, secs=1.0) -> ModelInputs:
    """Random prompt: text, then for each image/video grid a vision block, then more text."""
    def rand_text(n):
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    ids = rand_text(text_len[0])
    pv, pvv = [], []
    for t, h, w in images:
        ids += [VS] + [IMG] * (t * h * w // 4) + [VE] + rand_text(2)
        pv.append(torch.randn(t * h * w, patch_dim, generator=gen))
    for t, h, w in videos:
        ids += [VS] + [VID] * (t * h * w // 4) + [VE] + rand_text(2)
        pvv.append(torch.randn(t * h * w, patch_dim, generator=gen))
    ids += rand_text(text_len[1])
    return ModelInputs(
        ids,
        torch.cat(pv) if pv else None,
        torch.tensor(list(images)) if images else None,
        torch.cat(pvv) if pvv else None,
        torch.tensor(list(videos)) if videos else None,
        [secs] * len(videos) if videos else None,
    )


def hf_logits(hf, p: ModelInputs) -> torch.Tensor:
    ids = torch.tensor([p.input_ids])
    mm = torch.zeros_like(ids)
    mm[ids == IMG] = 1
    mm[ids == VID] = 2
    kw = dict(input_ids=ids, mm_token_type_ids=mm)
    if p.pixel_values is not None:
        kw.update(pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw)
    if p.pixel_values_videos is not None:
        kw.update(pixel_values_videos=p.pixel_values_videos, video_grid_thw=p.video_grid_thw,
                  second_per_grid_ts=torch.tensor(p.second_per_grid_ts))
    with torch.no_grad():
        return hf(**kw).logits[0]


def recording_timer(outs: list):
    """A `timer(call, reps)` for the kernel tuners that runs the calls eagerly, keeps their outputs in
    `outs` and reports 1 µs: tests check which weights/caches the timed calls used."""

    def timer(call, reps):
        outs.extend(call() for _ in range(reps))
        return 1.0

    return timer
