"""Qwen3-VL's weights as SGLang's Qwen3-VL loader takes them, checked against the real releases' source.

SGLang's `Qwen3VLForConditionalGeneration.load_weights` renames each name it is sent, fuses the text
side's q/k/v and gate/up, and loads it into the parameter of that name; a name it does not know is
skipped without a word, which would leave SGLang decoding with its dummy weights. So:

- `hf_named_tensors` of a Rollplex Qwen3-VL gives transformers' own `state_dict()` names and shapes
  (the released checkpoints' layout, which SGLang loads), with `lm_head.weight` last;
- the `load_weights` method of each checked release (its source, compiled here from the wheel; SGLang
  is never imported) runs on those tensors against the parameters SGLang's model registers. Those
  parameters are written out below from the module structure of SGLang's qwen3_vl.py / qwen3.py /
  qwen2.py / vision attention (the contract's `self_attr` entries keep that structure checked); the
  weight loaders are stand-ins that record what lands where, and check shapes (a stacked shard's rows,
  or the whole parameter). Every name sent must land, every parameter (every shard) must be filled, and
  the tensors it ends up with must be the Rollplex model's own (fused back, reshaped back).
"""

from __future__ import annotations

import ast
import dataclasses
import typing

import pytest
import torch

from engine_patches.sglang.contract import LAYER_UTILS, QWEN3_VL
from engine_patches.sglang.memory import hf_named_tensors
from rollplex.models import build_model, hf_model, init_weights
from rollplex.presets import preset
from rollplex.tiny.checkpoint import tiny_qwen3_config
from rollplex.tiny.tokenizer import build_tiny_tokenizer, special_token_ids


def _tiny(tied: bool):
    cfg = tiny_qwen3_config(special_token_ids(build_tiny_tokenizer()))
    return dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, tie_word_embeddings=tied))


@pytest.mark.parametrize("tied", [False, True])
def test_names_and_shapes_are_transformers_state_dict(tied):
    cfg = _tiny(tied)
    torch.manual_seed(0)
    named = hf_named_tensors(init_weights(build_model(cfg), seed=0))
    hf = hf_model(cfg).state_dict()
    if tied:  # transformers lists the tied head under both names; the released files hold it once
        assert hf["lm_head.weight"].data_ptr() == hf["model.language_model.embed_tokens.weight"].data_ptr()
        del hf["lm_head.weight"]
    ours = dict(named)
    assert len(ours) == len(named)
    assert sorted(ours) == sorted(hf)
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in hf.items()}
    if not tied:
        assert named[-1][0] == "lm_head.weight"  # after embed_tokens: 0.5.7 copies the embedding into the head


# ---- SGLang's Qwen3-VL parameters, by its module structure ----------------------------------------------
def sglang_parameters(cfg) -> dict[str, tuple[int, ...]]:
    """name -> shape of the parameters SGLang's Qwen3VLForConditionalGeneration registers (TP 1).

    visual = Qwen3VLMoeVisionModel: patch_embed.proj (Conv3dLayer / nn.Conv3d weight [E, C, T, P, P] + bias),
    pos_embed [num_position_embeddings, E], blocks.i (Qwen3_VisionBlock: norm1, norm2 LayerNorms, attn =
    VisionAttention with qkv_proj [3E, E] + proj, mlp = Qwen3_VisionMLP linear_fc1/linear_fc2), merger and
    deepstack_merger_list.k (Qwen3VLMoeVisionPatchMerger: norm over E, or over 4E after the shuffle for the
    DeepStack ones; linear_fc1 [4E, 4E], linear_fc2 [out, 4E]). model = Qwen3LLMModel (Qwen2Model: embed_tokens,
    layers.l, norm; Qwen3DecoderLayer: self_attn = Qwen3Attention qkv_proj/o_proj/q_norm/k_norm, mlp = Qwen2MLP
    gate_up_proj/down_proj, input_layernorm, post_attention_layernorm). lm_head: ParallelLMHead, or the
    embedding itself when tied (listed under both names: named_parameters(remove_duplicate=False)).
    """
    t, v = cfg.text, cfg.vision
    E, M = v.hidden_size, v.hidden_size * v.spatial_merge_size ** 2
    p: dict[str, tuple[int, ...]] = {
        "visual.patch_embed.proj.weight": (E, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size),
        "visual.patch_embed.proj.bias": (E,),
        "visual.pos_embed.weight": (v.num_position_embeddings, E),
    }
    for i in range(v.depth):
        b = f"visual.blocks.{i}."
        p.update({b + "norm1.weight": (E,), b + "norm1.bias": (E,), b + "norm2.weight": (E,), b + "norm2.bias": (E,),
                  b + "attn.qkv_proj.weight": (3 * E, E), b + "attn.qkv_proj.bias": (3 * E,),
                  b + "attn.proj.weight": (E, E), b + "attn.proj.bias": (E,),
                  b + "mlp.linear_fc1.weight": (v.intermediate_size, E),
                  b + "mlp.linear_fc1.bias": (v.intermediate_size,),
                  b + "mlp.linear_fc2.weight": (E, v.intermediate_size), b + "mlp.linear_fc2.bias": (E,)})
    for m, norm in [("visual.merger.", E)] + [(f"visual.deepstack_merger_list.{k}.", M)
                                               for k in range(len(v.deepstack_visual_indexes))]:
        p.update({m + "norm.weight": (norm,), m + "norm.bias": (norm,), m + "linear_fc1.weight": (M, M),
                  m + "linear_fc1.bias": (M,), m + "linear_fc2.weight": (v.out_hidden_size, M),
                  m + "linear_fc2.bias": (v.out_hidden_size,)})
    H, D = t.hidden_size, t.head_dim
    p["model.embed_tokens.weight"] = (t.vocab_size, H)
    for i in range(t.num_hidden_layers):
        b = f"model.layers.{i}."
        p.update({b + "self_attn.qkv_proj.weight": ((t.num_attention_heads + 2 * t.num_key_value_heads) * D, H),
                  b + "self_attn.o_proj.weight": (H, t.num_attention_heads * D),
                  b + "self_attn.q_norm.weight": (D,), b + "self_attn.k_norm.weight": (D,),
                  b + "mlp.gate_up_proj.weight": (2 * t.intermediate_size, H),
                  b + "mlp.down_proj.weight": (H, t.intermediate_size),
                  b + "input_layernorm.weight": (H,), b + "post_attention_layernorm.weight": (H,)})
    p["model.norm.weight"] = (H,)
    p["lm_head.weight"] = (t.vocab_size, H)
    return p


def _shard_rows(cfg, name: str, shard) -> int:
    """Rows of one stacked shard (QKVParallelLinear / MergedColumnParallelLinear's weight_loader at TP 1)."""
    t = cfg.text
    if ".qkv_proj." in name:
        heads = {"q": t.num_attention_heads, "k": t.num_key_value_heads, "v": t.num_key_value_heads}[shard]
        return heads * t.head_dim
    assert ".gate_up_proj." in name and shard in (0, 1), (name, shard)
    return t.intermediate_size


class FakeParam:
    """A parameter whose weight_loader records (sent name, shard, tensor) instead of copying."""

    def __init__(self, name, shape, cfg, sending):
        self.name, self.shape, self.cfg, self.sending = name, shape, cfg, sending
        self.loads: list[tuple[str, object, torch.Tensor]] = []

    def weight_loader(self, param, loaded, shard_id=None):
        assert param is self
        if shard_id is None:
            want = self.shape
        else:
            want = (_shard_rows(self.cfg, self.name, shard_id), *self.shape[1:])
        assert tuple(loaded.shape) == want, (f"{self.sending[0]} -> {self.name} shard {shard_id}: "
                                             f"{tuple(loaded.shape)}, SGLang's parameter takes {want}")
        self.loads.append((self.sending[0], shard_id, loaded))


class FakeModel:
    """`self` for SGLang's load_weights: its parameters, last pipeline rank, all layers, not encoder-only."""

    def __init__(self, cfg):
        self.sending = [None]
        self.params = {n: FakeParam(n, s, cfg, self.sending) for n, s in sglang_parameters(cfg).items()}
        if cfg.text.tie_word_embeddings:
            self.params["lm_head.weight"] = self.params["model.embed_tokens.weight"]
        self.pp_group = type("PP", (), {"is_last_rank": True, "world_size": 1})()
        self.config = type("Cfg", (), {"tie_word_embeddings": cfg.text.tie_word_embeddings,
                                       "encoder_only": False, "language_only": False})()
        self.model = type("LM", (), {"start_layer": 0, "end_layer": cfg.text.num_hidden_layers})()

    def named_parameters(self, remove_duplicate=True):
        assert remove_duplicate is False  # the tied head is listed under its own name too
        return iter(self.params.items())

    def feed(self, named):
        for name, t in named:
            self.sending[0] = name
            yield name, t


def _function(text: str, filename: str, cls: str | None, name: str):
    mod = ast.parse(text, filename=filename)
    body = mod.body
    if cls is not None:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    fn = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)
    return ast.Module(body=[fn], type_ignores=[])


def sglang_load_weights(root):
    """SGLang's own Qwen3VLForConditionalGeneration.load_weights (and get_layer_id), compiled from its source."""
    import re

    def default_weight_loader(param, loaded):
        param.weight_loader(param, loaded)

    # the names its annotations and body use besides get_layer_id
    ns = {"re": re, "torch": torch, "Iterable": typing.Iterable, "Tuple": tuple,
          "default_weight_loader": default_weight_loader}
    for file, cls, fn in ((LAYER_UTILS, None, "get_layer_id"),
                          (QWEN3_VL, "Qwen3VLForConditionalGeneration", "load_weights")):
        path = root / file
        exec(compile(_function(path.read_text(encoding="utf-8"), str(path), cls, fn), str(path), "exec"), ns)
    return ns["load_weights"]


def _cases():
    return [pytest.param(lambda: _tiny(False), "cpu", id="tiny"),
            pytest.param(lambda: _tiny(True), "cpu", id="tiny-tied"),
            pytest.param(lambda: preset("qwen3-vl-4b"), "meta", id="4b"),
            pytest.param(lambda: preset("qwen3-vl-8b"), "meta", id="8b")]


@pytest.mark.parametrize("make_cfg,device", _cases())
def test_sglang_loader_takes_every_name_into_every_parameter(sglang_source, make_cfg, device):
    version, root = sglang_source
    cfg = make_cfg()
    with torch.device(device):
        model = build_model(cfg)
    if device == "cpu":
        init_weights(model, seed=0)
    named = hf_named_tensors(model)
    fake = FakeModel(cfg)
    sglang_load_weights(root)(fake, fake.feed(named))

    landed = {src for p in fake.params.values() for src, _, _ in p.loads}
    skipped = [n for n, _ in named if n not in landed]
    assert skipped == [], f"SGLang {version} skips {len(skipped)} names (its dummy weights stay): {skipped[:8]}"
    for name, p in fake.params.items():
        shards = {s for _, s, _ in p.loads}
        want = ({"q", "k", "v"} if name.startswith("model.") and ".qkv_proj." in name
                else {0, 1} if ".gate_up_proj." in name else {None})
        assert shards == want, f"SGLang {version}: {name} got shards {shards}, needs {want}"
    # the last tensor loaded is the one SGLang decodes with: the head must not be the embedding when untied
    head = fake.params["lm_head.weight"].loads[-1][0]
    assert head == ("model.language_model.embed_tokens.weight" if cfg.text.tie_word_embeddings else "lm_head.weight")
    if device == "meta":
        return
    # values: what each SGLang parameter ends up holding is the Rollplex model's tensor
    ours = model.state_dict()
    for name, p in fake.params.items():
        if name == "lm_head.weight" and cfg.text.tie_word_embeddings:
            continue
        last = {}
        for _, shard, t in p.loads:
            last[shard] = t
        order = ["q", "k", "v"] if set(last) == {"q", "k", "v"} else sorted(last, key=lambda s: (s is None, s))
        got = torch.cat([last[s] for s in order]) if len(order) > 1 else last[order[0]]
        key = name.replace("patch_embed.proj.", "patch_embed.")
        if key.startswith("visual."):  # Rollplex's tower keeps HF's attn.qkv
            key = key.replace(".attn.qkv_proj.", ".attn.qkv.")
        assert torch.equal(got.reshape(ours[key].shape), ours[key]), name
