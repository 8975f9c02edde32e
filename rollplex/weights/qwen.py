"""ParamSpecs of Rollplex's Qwen2.5-VL and Qwen3-VL: the real parameter names and shapes, with their TP roles.

Names and shapes come from `Qwen25VL(cfg)` built on the meta device (no weights allocated), so the
plan follows the model as it is. Every parameter must match exactly one rule below; a new parameter
without a rule is a ValueError rather than a silently unplanned tensor.

    embed_tokens, lm_head           vocab-parallel, Shard(0)
    qkv_proj (weight, bias)         column-parallel per part: q (heads), k, v (KV heads, replicated
                                    when TP exceeds their count)
    o_proj                          row-parallel, Shard(1) over heads
    gate_up_proj                    column-parallel per part: gate, up
    down_proj                       row-parallel, Shard(1)
    norms                           replicated (Qwen3's q/k head norms too: one [head_dim] for all heads)
    vision blocks                   the same roles (qkv parts of num_heads heads; proj / down biases
                                    replicated); patch embed and merger replicated
    Qwen3-VL tower                  its MLP (linear_fc1 column-, linear_fc2 row-parallel), LayerNorm
                                    biases, position table and DeepStack mergers replicated
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from .layout import ParamSpec, Part

if TYPE_CHECKING:  # the package stays importable without torch; only param_shapes needs it
    from ..models.config import ModelConfig

_Rule = Callable[["ModelConfig"], tuple["int | None", tuple[Part, ...]]]


def _text_qkv(c: ModelConfig):
    t = c.text
    kv = Part(t.num_key_value_heads * t.head_dim, t.num_key_value_heads, replicable=True)
    return 0, (Part(t.num_attention_heads * t.head_dim, t.num_attention_heads), kv, kv)


def _vis_qkv(c: ModelConfig):
    v = c.vision
    return 0, (Part(v.hidden_size, v.num_heads),) * 3


RULES: tuple[tuple[str, str, _Rule], ...] = (
    (r"model\.embed_tokens\.weight|lm_head\.weight", "text",
     lambda c: (0, (Part(c.text.vocab_size, c.text.vocab_size),))),
    (r"model\.(layers\.\d+\.(input|post_attention)_layernorm|layers\.\d+\.self_attn\.[qk]_norm|norm)\.weight", "text",
     lambda c: (None, ())),
    (r"model\.layers\.\d+\.self_attn\.qkv_proj\.(weight|bias)", "text", _text_qkv),
    (r"model\.layers\.\d+\.self_attn\.o_proj\.weight", "text",
     lambda c: (1, (Part(c.text.num_attention_heads * c.text.head_dim, c.text.num_attention_heads),))),
    (r"model\.layers\.\d+\.mlp\.gate_up_proj\.weight", "text",
     lambda c: (0, (Part(c.text.intermediate_size, c.text.intermediate_size),) * 2)),
    (r"model\.layers\.\d+\.mlp\.down_proj\.weight", "text",
     lambda c: (1, (Part(c.text.intermediate_size, c.text.intermediate_size),))),
    (r"visual\.patch_embed\.(weight|bias)|visual\.pos_embed\.weight|visual\.blocks\.\d+\.norm[12]\.(weight|bias)"
     r"|visual\.(merger|deepstack_merger_list)\..*", "vision", lambda c: (None, ())),
    (r"visual\.blocks\.\d+\.attn\.qkv\.(weight|bias)", "vision", _vis_qkv),
    (r"visual\.blocks\.\d+\.attn\.proj\.weight", "vision",
     lambda c: (1, (Part(c.vision.hidden_size, c.vision.num_heads),))),
    (r"visual\.blocks\.\d+\.(attn\.proj|mlp\.down_proj|mlp\.linear_fc2)\.bias", "vision", lambda c: (None, ())),
    (r"visual\.blocks\.\d+\.mlp\.gate_up_proj\.(weight|bias)", "vision",
     lambda c: (0, (Part(c.vision.intermediate_size, c.vision.intermediate_size),) * 2)),
    (r"visual\.blocks\.\d+\.mlp\.down_proj\.weight", "vision",
     lambda c: (1, (Part(c.vision.intermediate_size, c.vision.intermediate_size),))),
    (r"visual\.blocks\.\d+\.mlp\.linear_fc1\.(weight|bias)", "vision",
     lambda c: (0, (Part(c.vision.intermediate_size, c.vision.intermediate_size),))),
    (r"visual\.blocks\.\d+\.mlp\.linear_fc2\.weight", "vision",
     lambda c: (1, (Part(c.vision.intermediate_size, c.vision.intermediate_size),))),
)


def param_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of Qwen25VL(cfg) (the model of cfg's family), built on the meta device."""
    import torch

    from ..models import Qwen25VL

    with torch.device("meta"):
        model = Qwen25VL(cfg)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def model_specs(cfg: ModelConfig, shapes: list[tuple[str, tuple[int, ...]]] | None = None) -> list[ParamSpec]:
    out = []
    for name, shape in shapes if shapes is not None else param_shapes(cfg):
        hits = [(tower, rule) for pat, tower, rule in RULES if re.fullmatch(pat, name)]
        if len(hits) != 1:
            raise ValueError(f"parameter {name!r} matches {len(hits)} layout rules (needs exactly one)")
        tower, rule = hits[0]
        tp_dim, parts = rule(cfg)
        out.append(ParamSpec(name, shape, tp_dim, parts, tower))
    return out


def preset_specs(name: str) -> list[ParamSpec]:
    from ..presets import preset

    return model_specs(preset(name))
