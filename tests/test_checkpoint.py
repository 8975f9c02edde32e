"""HF checkpoint directories both ways: ours -> transformers, transformers -> ours, sharded too."""

import json

import torch
from helpers import hf_logits, hf_twin, make_prompt, tiny_model

from rollplex.models import load_model, save_model


def _prompt():
    return make_prompt(torch.Generator().manual_seed(5), images=[(1, 6, 4)])


def test_ours_to_transformers(tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    for tie in (False, True):
        ours = tiny_model(seed=7, tie=tie).eval()
        out = save_model(ours, tmp_path / f"ck{tie}")
        hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(out, attn_implementation="eager").eval()
        p = _prompt()
        with torch.no_grad():
            assert (hf_logits(hf, p) - ours([p])[0]).abs().max().item() <= 1e-4


def test_transformers_to_ours(tmp_path):
    hf, ref = hf_twin(seed=2)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf").eval()
    p = _prompt()
    with torch.no_grad():
        assert (ours([p])[0] - hf_logits(hf, p)).abs().max().item() <= 1e-4
    for (n1, a), (n2, b) in zip(ref.state_dict().items(), ours.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b)


def test_sharded_round_trip_and_dtype(tmp_path):
    ours = tiny_model(seed=1)
    out = save_model(ours, tmp_path / "sharded", max_shard_bytes=50_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    back = load_model(out)
    for (n1, a), (n2, b) in zip(ours.state_dict().items(), back.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b)
    bf = load_model(out, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in bf.parameters())
    # re-saving into the same directory replaces the shards
    save_model(back, out)
    assert not (out / "model.safetensors.index.json").exists() and (out / "model.safetensors").exists()


def test_hub_ids_resolve_from_the_local_cache(tmp_path):
    import shutil

    import pytest

    from rollplex.models import load_model
    from rollplex.models.hub import looks_like_hub_id, resolve_model_dir
    from rollplex.tiny import write_tiny

    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-vl"
    snap = repo / "snapshots" / ("0" * 40)
    shutil.copytree(write_tiny(tmp_path / "src"), snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    assert looks_like_hub_id("acme/tiny-vl") and not looks_like_hub_id("./acme/tiny") and not looks_like_hub_id("x")
    path = resolve_model_dir("acme/tiny-vl", cache_dir=cache)
    assert path == snap and load_model(path).cfg.text.hidden_size == 128
    assert resolve_model_dir(str(snap)) == snap
    with pytest.raises(ValueError, match="huggingface-cli download acme/absent"):
        resolve_model_dir("acme/absent", cache_dir=cache)


def test_empty_model_then_init_equals_float32_init_cast():
    """The accelerator path of a random preset (parameters allocated once in the target dtype, drawn in
    float32 and rounded in) gives the weights of a float32 model initialised and then cast."""
    from rollplex.models import ModelConfig, Qwen25VL, init_weights
    from rollplex.models.hf_io import empty_model
    from rollplex.tiny import ensure_tiny

    cfg = ModelConfig.from_hf(str(ensure_tiny()))
    ref = init_weights(Qwen25VL(cfg), seed=3).to(torch.bfloat16)
    got = init_weights(empty_model(cfg, "cpu", torch.bfloat16), seed=3)
    want, have = ref.state_dict(), got.state_dict()
    assert want.keys() == have.keys()
    for k in want:
        assert have[k].dtype == torch.bfloat16 and torch.equal(want[k], have[k]), k
    assert got.inv_freq.dtype == torch.float32  # rotary frequencies stay float32, as a loaded checkpoint's
