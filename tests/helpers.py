"""Shared helpers for the CPU tests: a tiny Qwen2.5-VL config, random inputs, HF model twins, and the
tolerance of comparisons between fp32 computations that sum in different orders."""

from __future__ import annotations

import math

import torch

from rollplex.models import ModelConfig, ModelInputs, Qwen25VL, hf_to_rollplex, init_weights

IMG, VID, VS, VE = 300, 301, 302, 303


# fp32 unit roundoff (round to nearest): every rounded operation has a relative error of at most u
FP32_U = 2.0**-24


def fp32_rtol(terms: int, safety: float = 8.0) -> float:
    """Norm-wise relative difference ‖a−b‖/‖b‖ allowed between two fp32 computations of one result that
    add the same terms in different orders (several ranks against one process, packed against
    per-sample passes, prefixes co-scheduled against in-line, tensor-parallel against whole matmuls).

    A computed sum of n terms is within γ_n·Σ|x_i| of the exact sum, γ_n = n·u/(1−n·u) (Higham,
    Accuracy and Stability of Numerical Algorithms, §4.2). That worst case assumes every rounding
    error has the same sign; modelled as independent and zero-mean, they give λ·sqrt(n)·u·Σ|x_i| with
    probability ≥ 1 − 2·exp(−λ²/2) (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019). A result made
    by a chain of dependent reductions of n_1, n_2, … terms (matmuls, norms, softmax, the backward's
    transposed matmuls, a gradient's sum over tokens and micro-batches) carries, to first order, the
    sum of their independent errors: about sqrt(Σ n_i)·u relative. `terms` is that Σ n_i; two orders
    differ by at most twice one's error. `safety` covers λ and the conditioning of the chain
    (cancellation in a gradient's sum over tokens of both signs, the Jacobians of softmax and RMS
    norm): the suite's worst difference across machines was 3e-5, twice the estimate for the RL step,
    and 8 keeps 4x above that while a real bug (a dropped micro-batch or sample, a wrong normaliser:
    ≥ 1e-3) stays 8x beyond the bound."""
    return safety * 2.0 * math.sqrt(terms) * FP32_U


# The chains of the tiny test models (hidden 64, intermediate 112, head dim 16, 2 text layers, vocab
# 320; vision hidden 32, intermediate 48, 3 blocks; sequences ≤ 256 tokens). Forward: a text layer sums
# 64 (norm) + 64 (q/k/v) + 16 (scores) + 2·256 (softmax, values) + 64 (o) + 64 (norm) + 64 (gate/up)
# + 112 (down) ≈ 960 terms, twice; the head 64 + 320 (log-softmax); a vision block ≈ 350, three, and
# the merger ≈ 250: ≈ 3.6k, rounded up to 2^12. A training step adds the backward (as many again) and
# a gradient's sum over a mini-batch's tokens (≤ 2k): ≈ 9.3k, rounded up to 2^14.
FORWARD_TERMS = 2**12
STEP_TERMS = 2**14
FORWARD_RTOL = fp32_rtol(FORWARD_TERMS)  # ≈ 6.1e-5: logits, logprobs, hidden states
STEP_RTOL = fp32_rtol(STEP_TERMS)  # ≈ 1.2e-4: gradients, metrics and weights of an update


def fp32_rel_err(a, b, scale: float | None = None) -> float:
    """‖a−b‖ / max(‖b‖, scale) in fp64 for tensors, lists or numbers. `scale` is the magnitude of the
    terms a scalar sums, where it may cancel to near zero (a policy loss over zero-mean advantages):
    rounding is relative to Σ|x_i|, not to the sum."""
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    denom = max(b.norm().item(), scale or 0.0, 1e-30)
    return (a - b).norm().item() / denom


def assert_fp32_close(a, b, what: str = "", terms: int = STEP_TERMS, scale: float | None = None) -> float:
    """a equals b up to fp32 summation order: fp32_rel_err(a, b, scale) ≤ fp32_rtol(terms). Returns the
    error. Comparisons whose computation order is identical by design use torch.equal instead."""
    err = fp32_rel_err(a, b, scale)
    tol = fp32_rtol(terms)
    assert err <= tol, f"{what}: relative difference {err:.2e} > {tol:.2e} (fp32 bound for {terms} terms)"
    return err


# the smallest init std of the test models' matrices (the tiny checkpoint's; the multi-process tests use 0.1)
WEIGHT_RMS = 0.02


def assert_weights_close(a: torch.Tensor, b: torch.Tensor, what: str = "", rms: float = WEIGHT_RMS) -> float:
    """Updated weights equal up to fp32 summation order, at the scale of the model's weights:
    ‖a−b‖ ≤ STEP_RTOL·max(‖b‖, rms·sqrt(numel)). Not relative to a zero-initialised bias's own small
    update: Adam divides each gradient element by its own RMS, so an element whose exact gradient is
    zero (the key projection's bias: softmax ignores a shift of every score) moves by whatever rounding
    gives it, up to lr per step, and two summation orders move it differently. At the weights' scale
    that stays rounding (≤ 1e-8 per element seen), while a lost, doubled or unsynced update (lr per
    element: 1e-4 in these tests, 40x the bound at rms 0.02) fails."""
    return assert_fp32_close(a, b, what, STEP_TERMS, scale=rms * math.sqrt(b.numel()))


def random_text_ids(size, gen: torch.Generator | None = None, vocab: int | None = None, cfg=None) -> torch.Tensor:
    """Random token ids of `size` that are plain text: from 3 (past pad/bos/eos) to below the smallest
    vision special id of `cfg` (a ModelConfig; default the tiny configs') and below `vocab`, so a random
    prompt never holds an image/video placeholder or a vision start/end by chance."""
    specials = ((cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id)
                if cfg is not None else (IMG, VID, VS, VE))
    high = min(specials) if vocab is None else min(vocab, *specials)
    if high <= 3:
        raise ValueError(f"no plain-text ids below {high}")
    return torch.randint(3, high, (size,) if isinstance(size, int) else tuple(size), generator=gen)


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
        return random_text_ids(n, gen, vocab).tolist()

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


def capture_grads(rl) -> list[dict]:
    """The gradients an RLStep's optimizer steps on, one {name: grad} per optimizer step, appended to the
    list returned as they happen (the optimizer's `step` wrapped on the instance)."""
    grads = []
    opt_step = rl.actor.optimizer.step

    def step():
        grads.append({n: p.grad.clone() for n, p in rl.model.named_parameters() if p.grad is not None})
        opt_step()

    rl.actor.optimizer.step = step
    return grads
