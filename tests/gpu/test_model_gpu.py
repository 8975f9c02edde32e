"""GPU-only checks of the model's fast paths (skipped without CUDA): the flash varlen vision
attention and the compiled vision blocks compute what the padded-SDPA eager path computes, and
our bf16 model stays within bf16 noise of its own fp32 copy."""

import pytest
import torch
from helpers import make_prompt, random_text_ids, tiny_model

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


def test_compiled_whole_vision_blocks_match_eager_in_training():
    """The compiled whole-block path (norm, qkv, rotary, varlen attention, MLP in one graph) gives the
    eager varlen path's output and weight gradients."""
    x, grids = _vision_inputs()
    outs, grads = [], []
    for compiled in (False, True):
        model = tiny_model(seed=5).cuda().to(torch.bfloat16)
        if compiled:
            model.visual.compile()
        y = model.visual(x.to(torch.bfloat16), grids)
        (y.float() * torch.linspace(-1, 1, y.shape[-1], device="cuda")).sum().backward()
        outs.append(y.float().detach())
        grads.append(model.visual.blocks[0].attn.qkv.weight.grad.float())
    assert (outs[0] - outs[1]).abs().mean() / outs[0].abs().mean() < 1e-2
    assert (grads[0] - grads[1]).norm() / grads[0].norm() < 3e-2


def test_bf16_close_to_fp32():
    model = tiny_model().cuda().eval()
    p = make_prompt(torch.Generator().manual_seed(1), images=[(1, 6, 10)])
    with torch.no_grad():
        ref = model([p]).float()
        got = model.to(torch.bfloat16)([p]).float()
    assert (got - ref).abs().mean() / ref.abs().mean() < 2e-2


def test_shared_prefix_varlen_path_matches_masked_sdpa(monkeypatch):
    """The flash varlen shared-prefix attention (bottom-right causal) equals the masked-SDPA path."""
    import rollplex.models.attention as att

    model = tiny_model().cuda().to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [make_prompt(g, images=[(1, 6, 10)]), make_prompt(g, text_len=(9, 3))]
    for p in prompts:
        if p.pixel_values is not None:
            p.pixel_values = p.pixel_values.cuda()
    resp = random_text_ids((5, 11), g, vocab=290).cuda()
    index = torch.tensor([0, 0, 1, 1, 1]).cuda()
    assert att.varlen_bottom_right_ok("cuda:0", torch.bfloat16)
    outs = []
    for flash in (True, False):
        if not flash:
            monkeypatch.setattr(att, "_use_flash_varlen", lambda q: False)
        prefix = model.prefix(prompts)
        outs.append(model.response_hidden(prefix, resp, index).float())
    assert (outs[0] - outs[1]).abs().mean() / outs[1].abs().mean() < 1e-2


def test_packed_varlen_path_matches_dense_mask(monkeypatch):
    """group_hidden's one varlen call per layer (prompts + responses packed) equals its dense-mask
    SDPA path, values and gradients, in bf16 on the GPU."""
    import rollplex.models.attention as att

    g = torch.Generator().manual_seed(3)
    prompts = [make_prompt(g, images=[(1, 6, 10)]), make_prompt(g, text_len=(9, 3))]
    for p in prompts:
        if p.pixel_values is not None:
            p.pixel_values = p.pixel_values.cuda().to(torch.bfloat16)
    resp = random_text_ids((5, 11), g, vocab=290).cuda()
    lens, group = [11, 1, 4, 11, 7], [0, 1, 0, 1, 1]
    print("native GQA in varlen:", att.varlen_native_gqa_ok("cuda:0", torch.bfloat16))
    outs, grads = [], []
    for flash in (True, False):
        if not flash:
            monkeypatch.setattr(att, "_use_flash_varlen", lambda q: False)
        model = tiny_model(seed=4).cuda().to(torch.bfloat16)
        h = model.group_hidden(prompts, resp, lens, group)
        (h.float() * torch.linspace(-1, 1, h.shape[-1], device="cuda")).sum().backward()
        outs.append(h.float().detach())
        grads.append(model.model.layers[0].self_attn.qkv_proj.weight.grad.float())
    assert (outs[0] - outs[1]).abs().mean() / outs[1].abs().mean() < 1e-2
    assert (grads[0] - grads[1]).norm() / grads[1].norm() < 3e-2


def test_packed_sequences_varlen_matches_dense_and_group_hidden(monkeypatch):
    """sequence_hidden (serial mode: each sample a whole sequence, packed) in bf16 on the GPU: its varlen
    calls equal its dense-mask SDPA path, values and gradients, and its values equal group_hidden's."""
    import rollplex.models.attention as att

    g = torch.Generator().manual_seed(5)
    prompts = [make_prompt(g, images=[(1, 6, 10)]), make_prompt(g, text_len=(9, 3))]
    for p in prompts:
        if p.pixel_values is not None:
            p.pixel_values = p.pixel_values.cuda().to(torch.bfloat16)
    resp = random_text_ids((5, 11), g, vocab=290).cuda()
    lens, group = [11, 1, 4, 11, 7], [0, 1, 0, 1, 1]
    outs, grads = [], []
    for flash in (True, False):
        if not flash:
            monkeypatch.setattr(att, "_use_flash_varlen", lambda q: False)
        model = tiny_model(seed=4).cuda().to(torch.bfloat16)
        h = model.sequence_hidden(prompts, resp, lens, group)
        (h.float() * torch.linspace(-1, 1, h.shape[-1], device="cuda")).sum().backward()
        outs.append(h.float().detach())
        grads.append(model.model.layers[0].self_attn.qkv_proj.weight.grad.float())
        if flash:
            with torch.no_grad():
                shared = model.group_hidden(prompts, resp, lens, group).float()
            assert (shared - outs[0]).abs().mean() / shared.abs().mean() < 1e-2
    assert (outs[0] - outs[1]).abs().mean() / outs[1].abs().mean() < 1e-2
    assert (grads[0] - grads[1]).norm() / grads[1].norm() < 3e-2
