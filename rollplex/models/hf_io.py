"""HF weight I/O: checkpoint directories in and out, the state-dict adapter between HF names and ours.

Our layout fuses q/k/v and gate/up into single GEMMs and runs the patch-embedding Conv3d as a
Linear; the adapter maps both ways:

    HF (released Qwen2.5-VL / transformers)           Rollplex
    model[.language_model].layers.i.self_attn.{q,k,v}_proj  -> model.layers.i.self_attn.qkv_proj
    model[.language_model].layers.i.mlp.{gate,up}_proj      -> model.layers.i.mlp.gate_up_proj
    [model.]visual.blocks.i.mlp.{gate,up}_proj              -> visual.blocks.i.mlp.gate_up_proj
    [model.]visual.patch_embed.proj.weight [E,C,T,P,P]      -> visual.patch_embed.weight [E, C*T*P*P]
    [model.]visual.merger.mlp.{0,2}                         -> visual.merger.fc{1,2}

We write the released checkpoints' names (`model.layers…`, `visual…`), which both transformers
(through its conversion mapping) and our loader read; we read either spelling. Qwen3-VL keeps HF's
module names for its tower (vision3.py); its released checkpoints, and what we write for it, use
`model.language_model.…` / `model.visual.…`, and its patch embedding has a bias.

The model class comes from the config's family (family.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ModelConfig
from .family import build_model
from .layers import rotary_inv_freq
from .qwen2_5_vl import Qwen25VL

_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "video_preprocessor_config.json",
    "processor_config.json", "generation_config.json", "added_tokens.json",
)


def _canonical(name: str) -> str:
    name = re.sub(r"^model\.language_model\.", "model.", name)
    name = re.sub(r"^model\.visual\.", "visual.", name)
    name = re.sub(r"^visual\.merger\.mlp\.0\.", "visual.merger.fc1.", name)
    name = re.sub(r"^visual\.merger\.mlp\.2\.", "visual.merger.fc2.", name)
    name = name.replace("visual.patch_embed.proj.bias", "visual.patch_embed.bias")
    return name.replace("visual.patch_embed.proj.weight", "visual.patch_embed.weight")


def hf_to_rollplex(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    parts: dict[tuple[str, str, str], dict[str, torch.Tensor]] = {}
    for name, t in hf.items():
        name = _canonical(name)
        if name == "lm_head.weight" and cfg.text.tie_word_embeddings:
            continue
        if name == "visual.patch_embed.weight":
            t = t.reshape(t.shape[0], -1)
        m = re.match(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$", name)
        if m:
            fused = next(f for f, srcs in _FUSED.items() if m.group(2) in srcs)
            parts.setdefault((m.group(1), fused, m.group(3)), {})[m.group(2)] = t
            continue
        out[name] = t
    for (prefix, fused, kind), got in parts.items():
        missing = [s for s in _FUSED[fused] if s not in got]
        if missing:
            raise ValueError(f"checkpoint lacks {prefix}.{missing[0]}.{kind}")
        out[f"{prefix}.{fused}.{kind}"] = torch.cat([got[s] for s in _FUSED[fused]], dim=0)
    return out


def rollplex_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    t, v = cfg.text, cfg.vision
    out: dict[str, torch.Tensor] = {}
    for name, x in state.items():
        m = re.match(r"^(.*)\.(qkv_proj|gate_up_proj)\.(weight|bias)$", name)
        if m:
            if m.group(2) == "qkv_proj":
                sizes = [t.num_attention_heads * t.head_dim] + [t.num_key_value_heads * t.head_dim] * 2
            else:
                sizes = [x.shape[0] // 2] * 2
            for src, piece in zip(_FUSED[m.group(2)], x.split(sizes, dim=0)):
                out[f"{m.group(1)}.{src}.{m.group(3)}"] = piece.contiguous()
            continue
        if name == "visual.patch_embed.weight":
            name = "visual.patch_embed.proj.weight"
            x = x.reshape(x.shape[0], v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
        name = name.replace("visual.patch_embed.bias", "visual.patch_embed.proj.bias")
        name = name.replace("visual.merger.fc1.", "visual.merger.mlp.0.")
        name = name.replace("visual.merger.fc2.", "visual.merger.mlp.2.")
        out[name] = x.contiguous()
    if cfg.family == "qwen3_vl":  # the released Qwen3-VL layout
        out = {re.sub(r"^(model|visual)\.", lambda m: "model.language_model." if m.group(1) == "model"
                      else "model.visual.", k): x for k, x in out.items()}
    if t.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json")
    state = {}
    for f in files:
        with safe_open(str(path / f), framework="pt") as fh:
            for k in fh.keys():
                state[k] = fh.get_tensor(k)
    return state


def init_weights(model: Qwen25VL, seed: int = 0, std: float = 0.02) -> Qwen25VL:
    """Random init like transformers' (normal(0, std) matrices, zero biases, unit norms), seeded.

    The numbers are drawn on the parameters' device: on CPU they are the same on every machine (the
    tiny checkpoints depend on that); on a GPU they come from its generator, far faster than a
    host-side draw of billions of numbers followed by a copy."""
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.ndim == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, device=device) * std)
    return model


def load_model(
    path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> Qwen25VL:
    """Build our model from an HF Qwen2.5-VL or Qwen3-VL directory (config.json + safetensors)."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise ValueError(f"{path} is not an HF checkpoint directory (no config.json)")
    cfg = ModelConfig.from_hf(str(path))
    with torch.device("meta"):
        model = build_model(cfg)
    state = hf_to_rollplex(read_safetensors(path), cfg)
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return _with_rotary(model, device)


def empty_model(cfg: ModelConfig, device: str | torch.device, dtype: torch.dtype) -> Qwen25VL:
    """The model with uninitialised parameters allocated once on `device` in `dtype` (no default init, no
    float32 copy): for `init_weights` or a state dict to fill."""
    with torch.device("meta"):
        model = build_model(cfg).to(dtype)
    return _with_rotary(model.to_empty(device=device), device)


def _with_rotary(model: Qwen25VL, device) -> Qwen25VL:
    """The rotary frequencies (non-persistent buffers, float32) on `device`."""
    cfg = model.cfg
    model.inv_freq = rotary_inv_freq(cfg.text.head_dim, cfg.text.rope_theta).to(device)
    model.visual.inv_freq = rotary_inv_freq(cfg.vision.head_dim // 2, cfg.vision.rope_theta).to(device)
    return model


def save_model(
    model: Qwen25VL,
    out_dir: str | os.PathLike,
    copy_tokenizer_from: str | os.PathLike | None = None,
    max_shard_bytes: int = 4 << 30,
    dtype: torch.dtype | None = None,
    state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write an HF directory (config.json, [sharded] safetensors [+ index], tokenizer files). state: the
    full tensors to write instead of `model.state_dict()` (e.g. gathered from shards)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype or v.dtype) for k, v in (state or model.state_dict()).items()}
    hf = rollplex_to_hf(state, model.cfg)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k in sorted(hf):
        nbytes = hf[k].numel() * hf[k].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = hf[k]
        size += nbytes
    for stale in out.glob("model*.safetensors*"):
        stale.unlink()
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / fname), metadata=meta)
            weight_map.update({k: fname for k in shard})
        total = sum(v.numel() * v.element_size() for v in hf.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = model.cfg.to_hf_dict()
    config["torch_dtype"] = str(next(iter(hf.values())).dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if copy_tokenizer_from is not None and Path(copy_tokenizer_from).resolve() != out.resolve():
        for f in _TOKENIZER_FILES:
            src = Path(copy_tokenizer_from) / f
            if src.exists():
                shutil.copy(src, out / f)
    return out
