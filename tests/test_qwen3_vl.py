"""Qwen3-VL: our model vs transformers' `Qwen3VLForConditionalGeneration` on identical random fp32 weights
(logits within 1e-4), checkpoint directories both ways, and the runtime's exactness promises for the
family: shared prefix == full forwards (logits and gradients, DeepStack included), one vision pass per
prompt reused through `vision_embeds`."""

import json
from dataclasses import replace

import pytest
import torch
from helpers import FORWARD_TERMS, IMG, assert_fp32_close, hf_logits, random_text_ids
from qwen3_helpers import (
    hf_logits_qwen3,
    qwen3_prompt,
    qwen3_twin,
    qwen3_video_prompt,
    tiny_qwen3,
    tiny_qwen3_hf_config,
)

from rollplex.models import ModelConfig, Qwen3VL, Qwen3VLConfig, load_model, save_model
from rollplex.models.rope import mrope_cos_sin

CASES = {
    "text": dict(),
    "one_image": dict(images=[(1, 4, 6)]),
    # grids smaller and larger than the 4x4 position table, so interpolation both shrinks and stretches
    "two_images": dict(images=[(1, 10, 6), (1, 2, 2)]),
}


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def twins(request):
    return qwen3_twin(tie=request.param)


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(twins, case):
    hf, ours = twins
    p = qwen3_prompt(torch.Generator().manual_seed(len(case)), **CASES[case])
    ref = hf_logits(hf, p)
    with torch.no_grad():
        got = ours([p])[0]
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-4


def test_deepstack_and_positions_matter(twins):
    """The parity above can fail: without the DeepStack features, or with sectioned M-RoPE, the
    logits move far past the bound."""
    hf, ours = twins
    p = qwen3_prompt(torch.Generator().manual_seed(5), images=[(1, 4, 6)])
    ref = hf_logits(hf, p)
    with torch.no_grad():
        e = ours.embed_prompts([p])
        assert e.deepstack is not None and len(e.deepstack.feats) == 2
        no_ds = ours.logits(ours.forward_embeds(e.embeds, e.positions, lambda i, q, k, v: _causal(q, k, v)))[0]
        cos, sin = mrope_cos_sin(e.positions, ours.inv_freq, ours.cfg.text.mrope_section, torch.float32)
        cos_i, _ = ours.rope(e.positions, torch.float32)
    assert (no_ds - ref).abs().max().item() > 1e-2
    assert (cos - cos_i).abs().max().item() > 1e-2


def _causal(q, k, v):
    from rollplex.models.attention import sdpa

    return sdpa(q, k, v, causal=True)


def test_batched_prompts_match_single(twins):
    _, ours = twins
    g = torch.Generator().manual_seed(1)
    prompts = [qwen3_prompt(g, **CASES[c]) for c in ("two_images", "text", "one_image")]
    with torch.no_grad():
        batch = ours(prompts)
        for b, p in enumerate(prompts):
            assert_fp32_close(batch[b, : len(p.input_ids)], ours([p])[0], f"prompt {b}", FORWARD_TERMS)


def test_config_round_trip_and_dispatch():
    hf_cfg = tiny_qwen3_hf_config()
    cfg = ModelConfig.from_hf(hf_cfg)
    assert isinstance(cfg, Qwen3VLConfig) and cfg.family == "qwen3_vl"
    assert cfg.text.head_dim == 32 and cfg.text.qk_norm and not cfg.text.attention_bias
    assert cfg.text.mrope_interleaved and cfg.vision.deepstack_visual_indexes == (0, 2)
    assert ModelConfig.from_hf(cfg.to_hf_dict()) == cfg
    assert Qwen3VLConfig.from_hf(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg


def test_config_rejects_bad_values():
    cfg = ModelConfig.from_hf(tiny_qwen3_hf_config())
    with pytest.raises(ValueError, match="deepstack_visual_indexes"):
        replace(cfg.vision, deepstack_visual_indexes=(3,))
    with pytest.raises(ValueError, match="square"):
        replace(cfg.vision, num_position_embeddings=15)
    with pytest.raises(ValueError, match="mrope_section"):
        replace(cfg.text, mrope_section=(6, 5, 4))
    with pytest.raises(ValueError, match="Qwen3VLConfig"):
        Qwen3VL(ModelConfig())
    for kind in ("qwen3_vl_moe", "qwen3_5"):  # other model types are refused, not misread
        with pytest.raises(ValueError, match="not supported"):
            ModelConfig.from_hf({**cfg.to_hf_dict(), "model_type": kind})


@pytest.mark.parametrize("shard", [False, True], ids=["one_file", "sharded"])
def test_checkpoint_directory_round_trip(tmp_path, shard):
    """We write a directory transformers loads (same logits) and load it back (same state)."""
    from transformers import Qwen3VLForConditionalGeneration

    ours = tiny_qwen3(seed=2)
    out = save_model(ours, tmp_path / "ckpt", max_shard_bytes=64 << 10 if shard else 4 << 30)
    assert (out / "model.safetensors.index.json").exists() == shard
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl" and config["text_config"]["head_dim"] == 32
    back = load_model(out)
    assert isinstance(back, Qwen3VL) and back.cfg == ours.cfg
    for (n, a), (m, b) in zip(ours.state_dict().items(), back.state_dict().items()):
        assert n == m and torch.equal(a, b), n
    hf = Qwen3VLForConditionalGeneration.from_pretrained(out, attn_implementation="eager").eval()
    p = qwen3_prompt(torch.Generator().manual_seed(3), images=[(1, 4, 6)])
    with torch.no_grad():
        assert (ours([p])[0] - hf_logits(hf, p)).abs().max().item() <= 1e-4


N = 3


def _group(seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [qwen3_prompt(g, images=[(1, 6, 4), (1, 2, 2)]), qwen3_prompt(g, text_len=(7, 2)),
               qwen3_video_prompt(g, video=(2, 4, 4), images=[(1, 4, 4)])]
    lens = [5, 3, 7, 1, 6, 4, 7, 7, 2]
    resp = random_text_ids((len(prompts) * N, 7), g, vocab=290)
    resp[1, 2] = IMG  # a generated placeholder id is plain text
    return prompts, resp, torch.tensor(lens), torch.arange(len(prompts)).repeat_interleave(N)


def _full(model, prompts, resp, lens, index):
    out = []
    for i in range(resp.shape[0]):
        p, n = prompts[index[i]], int(lens[i])
        P = len(p.input_ids)
        out.append(model([p.with_response(resp[i, :n].tolist())])[0][P - 1 : P - 1 + n])
    return out


def _shared(model, path, prompts, resp, lens, index):
    if path == "packed":
        rows = model.logits(model.group_hidden(prompts, resp, lens.tolist(), index.tolist()))
    elif path == "sequences":  # no sharing: every sample its own packed sequence (serial mode)
        rows = model.logits(model.sequence_hidden(prompts, resp, lens.tolist(), index.tolist()))
    elif path == "prefix_packed":
        prefix = model.prefix(prompts)
        rows = model.logits(model.prefix_group_hidden(prefix, resp, lens.tolist(), index.tolist()))
    else:
        rows = model.response_logits(model.prefix(prompts), resp, index)
    return [rows[i] for i in range(rows.shape[0])]


def _loss(rows, resp, lens):
    total = 0.0
    for i, r in enumerate(rows):
        n = int(lens[i])
        lp = torch.log_softmax(r[:n].float(), -1).gather(-1, resp[i, :n, None]).squeeze(-1)
        total = total + (lp * torch.linspace(0.5, 1.5, n)).sum()
    return total


@pytest.mark.parametrize("path", ["prefix_state", "packed", "prefix_packed", "sequences"])
def test_shared_prefix_equals_full_forwards(path):
    """Logits, loss and every gradient (DeepStack mergers included) of the shared-prefix paths equal
    per-sample full forwards."""
    prompts, resp, lens, index = _group(1)
    perm = torch.tensor([4, 0, 8, 2, 6, 1, 3, 7, 5])
    resp, lens, index = resp[perm], lens[perm], index[perm]
    grads, losses = [], []
    for shared in (False, True):
        model = tiny_qwen3(seed=3)
        rows = _shared(model, path, prompts, resp, lens, index) if shared else _full(model, prompts, resp, lens, index)
        loss = _loss(rows, resp, lens)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert_fp32_close(losses[1], losses[0], "loss", FORWARD_TERMS)
    ref, got = grads
    assert ref.keys() == got.keys()
    for name in ref:
        assert_fp32_close(got[name], ref[name], f"grad {name}")
    assert ref["visual.deepstack_merger_list.0.linear_fc2.weight"].abs().sum() > 0
    assert ref["visual.pos_embed.weight"].abs().sum() > 0


def test_reused_vision_embeds_skip_the_tower():
    """A frozen tower's features, kept from one pass (`vision_embeds`, DeepStack columns included), give
    the same logits without running the tower again."""
    model = tiny_qwen3(seed=4).eval()
    prompts, _, _, _ = _group(2)
    with torch.no_grad():
        ref = model(prompts)
        e = model.embed_prompts(prompts)
        kept = [p if f is None else replace(p, vision_embeds=f) for p, f in zip(prompts, e.visual)]
        assert e.visual[0].shape[1] == 64 * 3  # merged + 2 DeepStack blocks
        calls = []
        hook = model.visual.register_forward_hook(lambda *a: calls.append(1))
        got = model(kept)
        hook.remove()
    assert not calls
    assert torch.equal(got, ref)
    with pytest.raises(ValueError, match="width"):
        model([replace(kept[0], vision_embeds=e.visual[0][:, :64])])


@pytest.mark.parametrize("case", ["video", "image_and_video"])
def test_video_logits_match_transformers(twins, case):
    """Videos as Qwen3-VL lays them out (a timestamp before each frame block), alone and after an image."""
    hf, ours = twins
    images = [(1, 6, 4)] if case == "image_and_video" else []
    p = qwen3_video_prompt(torch.Generator().manual_seed(7), video=(3, 4, 6), images=images)
    ref = hf_logits_qwen3(hf, p)
    with torch.no_grad():
        got = ours([p])[0]
    assert (got - ref).abs().max().item() <= 1e-4


def test_video_placeholders_must_match_frames():
    model = tiny_qwen3()
    p = qwen3_video_prompt(torch.Generator().manual_seed(0), video=(2, 4, 4))
    with pytest.raises(ValueError, match="visual tokens|placeholder"):
        model([replace(p, video_grid_thw=torch.tensor([[2, 4, 8]]), pixel_values_videos=torch.zeros(64, 1536))])


def test_the_family_seam_builds_qwen3():
    """`Qwen25VL(cfg)` builds the model of cfg's family, so code written against it runs Qwen3-VL."""
    from rollplex.models import Qwen25VL, build_model

    cfg = ModelConfig.from_hf(tiny_qwen3_hf_config())
    assert type(Qwen25VL(cfg)) is Qwen3VL and type(build_model(cfg)) is Qwen3VL
    with torch.device("meta"):  # the default config is the 3B: its type, without its weights
        assert type(Qwen25VL(ModelConfig())) is Qwen25VL


@pytest.mark.parametrize("frozen", [False, True], ids=["tower", "vision_embeds"])
def test_coscheduled_prefix_job_equals_prefix(frozen):
    """The co-scheduler's unit-at-a-time prefix (tower blocks, embed, layers) adds the DeepStack
    features as the model's own prefix does."""
    from rollplex.cosched import PrefixJob

    model = tiny_qwen3(seed=5).eval()
    prompts, _, _, _ = _group(3)
    with torch.no_grad():
        ref = model.prefix(prompts)
        if frozen:
            e = model.embed_prompts(prompts)
            prompts = [p if f is None else replace(p, vision_embeds=f) for p, f in zip(prompts, e.visual)]
        job = PrefixJob(model, prompts, "k")
        job.run(0, job.units)
        got = job.complete()
    assert torch.equal(got.lens, ref.lens) and torch.equal(got.rope_delta, ref.rope_delta)
    assert_fp32_close(got.last_hidden, ref.last_hidden, "last hidden", FORWARD_TERMS)
    for a, b in zip(got.keys + got.values, ref.keys + ref.values):
        assert_fp32_close(a, b, "prefix K/V", FORWARD_TERMS)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_compiled_glue_matches_eager():
    """torch.compile of the Qwen3 glue (q/k head norm + rotary, the tower's LayerNorm / GELU blocks)
    computes the eager packed pass: hidden states and gradients (CPU inductor; skipped without a C++
    toolchain)."""
    try:
        torch.compile(lambda x: x * 2 + 1)(torch.randn(4))
    except Exception as e:  # noqa: BLE001 - any toolchain failure
        pytest.skip(f"torch.compile cannot build CPU kernels here: {type(e).__name__}")
    prompts, resp, lens, index = _group(4)
    out = []
    for compiled in (False, True):
        model = tiny_qwen3(seed=6)
        if compiled:
            model.compile()
        h = model.group_hidden(prompts, resp, lens.tolist(), index.tolist())
        (h * torch.linspace(-1, 1, h.shape[-1])).sum().backward()
        out.append((h.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (h0, g0), (h1, g1) = out
    assert_fp32_close(h1, h0, "hidden", FORWARD_TERMS)
    for name in ("model.layers.0.self_attn.q_norm.weight", "visual.blocks.0.attn.qkv.weight",
                 "visual.deepstack_merger_list.0.linear_fc1.weight", "model.layers.1.mlp.gate_up_proj.weight"):
        assert_fp32_close(g1[name], g0[name], f"grad {name}")
