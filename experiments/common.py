"""What the experiments share beyond rollplex.bench.common: the rollout experiment's W3B image prompts
(`w3b_prompts`), and the decode-state helpers: `set_decode_state` fills a graphed bucket's static inputs
at a chosen context, `gemms_str` prints the bucket's GEMM plan."""

from __future__ import annotations

import torch

from rollplex.models import ModelConfig, ModelInputs


def w3b_prompts(cfg: ModelConfig, n_prompts: int, size: int = 448, text: int = 96, seed: int = 0, device="cuda"):
    """`n_prompts` prompts of one size x size image between two halves of `text` random text tokens (bf16)."""
    g = torch.Generator().manual_seed(seed)
    side = size // cfg.vision.patch_size
    n_img = side * side // cfg.vision.spatial_merge_size**2
    out = []
    for _ in range(n_prompts):
        ids = torch.randint(0, 150000, (text // 2,), generator=g).tolist()
        ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * n_img + [cfg.vision_end_token_id]
        ids += torch.randint(0, 150000, (text - text // 2 - 2,), generator=g).tolist()
        pix = torch.randn(side * side, cfg.vision.patch_dim, generator=g).to(device, torch.bfloat16)
        out.append(ModelInputs(ids, pix, torch.tensor([[1, side, side]])))
    return out


def set_decode_state(runner, B: int, ctx: int, seed: int = 0) -> None:
    """Fill the runner's static decode inputs for B sequences that each hold `ctx` cached tokens in
    their own blocks (blocks 1.. are handed out in order; block 0 is scratch)."""
    bs = runner.block_size
    per = -(-ctx // bs)
    if 1 + B * per > runner.num_blocks:
        raise ValueError(f"{B} x {ctx} tokens do not fit {runner.num_blocks} KV blocks")
    g = torch.Generator().manual_seed(seed)
    table = 1 + torch.arange(B * per).view(B, per)
    meta = torch.stack([torch.randint(0, 150000, (B,), generator=g), torch.full((B,), ctx - 1),
                        torch.full((B,), ctx), table[:, (ctx - 1) // bs] * bs + (ctx - 1) % bs])
    runner.static_meta[:, :B].copy_(meta)
    runner.static_bt[:B].zero_()
    runner.static_bt[:B, :per].copy_(table.to(torch.int32))


def gemms_str(g) -> str:
    """A graphed bucket's SkinnyGemms in one line (the fused SwiGLU as its Triton config)."""
    if g is None:
        return "None"
    sw = getattr(g.gate_up_swiglu, "keywords", {}).get("config") if g.gate_up_swiglu else None
    return f"o_splits={g.o_splits} down_splits={g.down_splits} swiglu={sw}"
