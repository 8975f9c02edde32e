"""GPU-only checks of the model's fast paths (skipped without CUDA): the flash varlen vision
attention and the compiled vision blocks compute what the padded-SDPA eager path computes, and
our bf16 model stays within bf16 noise of its own fp32 copy."""

import pytest
import torch
from helpers import make_prompt, tiny_model

pytestmark = pytest.mark.gpu


def _vision_inputs():
    g = torch.Generator().manual_seed(0)
    grids = [(1, 14, 8), (1, 6, 10), (2, 8, 8)]
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, 3 * 2 * 14 * 14, generator=g).cuda(), grids


def test_varlen_and_compiled_vision_match_eager():
    model = tiny_model().cuda().to(torch.bfloat16).eval()
    x, grids = _vision_inputs()
    with torch.no_grad():
        model.visual.set_attention_backend("sdpa")
        ref = model.visual(x, grids).float()
        model.visual.set_attention_backend("auto")
        varlen = model.visual(x, grids).float()
        model.visual.compile()
        compiled = model.visual(x, grids).float()
    scale = ref.abs().mean()
    assert (varlen - ref).abs().mean() / scale < 1e-2
    assert (compiled - ref).abs().mean() / scale < 1e-2


def test_bf16_close_to_fp32():
    model = tiny_model().cuda().eval()
    p = make_prompt(torch.Generator().manual_seed(1), images=[(1, 6, 10)])
    with torch.no_grad():
        ref = model([p]).float()
        got = model.to(torch.bfloat16)([p]).float()
    assert (got - ref).abs().mean() / ref.abs().mean() < 2e-2
