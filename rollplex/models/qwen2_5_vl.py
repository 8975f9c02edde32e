"""Qwen2.5-VL for Rollplex: one model for the rollout engine, the reference scorer and the trainer.

The forward splits at the prompt/response boundary:

    prefix(prompts)                    vision tower + prompt tokens  -> PrefixState
    response_hidden(prefix, ids, idx)  response tokens attending to a PrefixState -> hidden
    forward(prompts)                   the composition (full sequences)
    sequence_hidden(prompts, ids, ...) full sequences, one per sample, packed without padding (serial)

A PrefixState holds, per layer, the prompt's rotated K/V ([B, Hkv, Pmax, D], right-padded), the
prompt lengths, the M-RoPE delta and the last prompt token's final hidden state. Response i attends
to prefix `prefix_index[i]`, so the n samples of a GRPO group share one prefix computed once; with
autograd on, the gather `keys[prefix_index]` sends every response's gradient back into the one
prefix graph. Shared-prefix == n full forwards (logits and gradients) is held by the tests.

`forward_embeds(embeds, positions, attend)` is the incremental path for the engine: positions and
the attention callable (which owns the KV cache) are explicit arguments. The engine's paths
(`embed`, `embed_prompts`, `forward_embeds`, `hidden`) also take `ops` (ops.ForwardOps): the token
lookup and the post-attention functions to run instead of the model's own, e.g. with the collectives
that combine a tensor-parallel rank's shards (rollplex.parallel.tp); the model object is never changed
for them.

Prompts are `ModelInputs` (inputs.py): token ids plus pixel tensors and grids, what
`rollplex.processor.VLProcessor.encode` returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import (
    PackedLayout,
    PrefixPackedLayout,
    SharedPrefixLayout,
    packed_attention,
    prefix_packed_attention,
    sdpa,
    shared_prefix_attention,
)
from .config import ModelConfig
from .inputs import ModelInputs
from .layers import rotary_inv_freq
from .ops import ForwardOps
from .rope import mrope_cos_sin, mrope_positions
from .text import AttendFn, DeepStack, TextDecoder
from .transfer import as_device_tensor, to_device
from .vision import VisionTower


@dataclass
class PrefixState:
    keys: list[torch.Tensor]  # per layer [B, Hkv, Pmax, D], rotated, right-padded
    values: list[torch.Tensor]  # per layer [B, Hkv, Pmax, D]
    lens: torch.Tensor  # [B] long, prompt lengths
    rope_delta: torch.Tensor  # [B] long: response token j sits at position lens + j + delta
    last_hidden: torch.Tensor  # [B, C] final-normed hidden of the last prompt token

    @property
    def batch_size(self) -> int:
        return self.lens.shape[0]

    @staticmethod
    def from_rows(rows: Sequence[tuple[PrefixState, int]]) -> PrefixState:
        """A PrefixState of the given rows of other states (in order), right-padded to the longest."""
        if not rows:
            raise ValueError("no prefix rows")
        P = max(int(s.keys[0].shape[2]) for s, _ in rows)

        def take(t: torch.Tensor, r: int) -> torch.Tensor:
            t = t[r : r + 1]
            return t if t.shape[2] == P else F.pad(t, (0, 0, 0, P - t.shape[2]))

        layers = range(len(rows[0][0].keys))
        return PrefixState(
            [torch.cat([take(s.keys[i], r) for s, r in rows]) for i in layers],
            [torch.cat([take(s.values[i], r) for s, r in rows]) for i in layers],
            torch.cat([s.lens[r : r + 1] for s, r in rows]),
            torch.cat([s.rope_delta[r : r + 1] for s, r in rows]),
            torch.cat([s.last_hidden[r : r + 1] for s, r in rows]))


@dataclass
class EmbeddedPrompts:
    embeds: torch.Tensor  # [B, Pmax, C], right-padded
    positions: torch.Tensor  # [3, B, Pmax]
    lens: torch.Tensor  # [B]
    rope_delta: torch.Tensor  # [B]
    visual: list[torch.Tensor | None] | None = None  # per prompt: merged visual features, images then videos
    deepstack: DeepStack | None = None  # Qwen3-VL: features for the first layers at the visual rows of [B * Pmax]


class Qwen25VL(nn.Module):
    # a tower whose output rows carry, after the merged features, this many more [C] blocks: the
    # DeepStack features of the first text layers (Qwen3-VL; vision_embeds keep the same layout)
    deepstack_layers = 0
    family = "qwen2_5_vl"  # the `ModelConfig.family` this class builds
    # family -> model class: each family's class enters here when it is defined (qwen3_vl.py), so
    # this module names no other family
    _families: dict[str, type[Qwen25VL]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "family" in cls.__dict__:
            Qwen25VL._families[cls.family] = cls

    def __new__(cls, cfg: ModelConfig | None = None, *args, **kwargs):
        # `Qwen25VL(cfg)` builds the model of cfg's family, so code written against this class
        # (benchmarks, weight plans) runs any family unchanged; a subclass is built as asked
        if cls is Qwen25VL and cfg is not None and cfg.family != Qwen25VL.family:
            if cfg.family not in Qwen25VL._families:
                raise ValueError(f"unknown model family {cfg.family!r}; known: "
                                 f"{sorted({Qwen25VL.family, *Qwen25VL._families})}")
            cls = Qwen25VL._families[cfg.family]
        return super().__new__(cls)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.visual = self.vision_tower(cfg)
        self.model = TextDecoder(cfg.text)
        self.lm_head = None if cfg.text.tie_word_embeddings else nn.Linear(
            cfg.text.hidden_size, cfg.text.vocab_size, bias=False
        )
        self.register_buffer("inv_freq", rotary_inv_freq(cfg.text.head_dim, cfg.text.rope_theta), persistent=False)

    @staticmethod
    def vision_tower(cfg: ModelConfig) -> nn.Module:
        return VisionTower(cfg.vision)

    def compile(self, **kwargs) -> Qwen25VL:
        """torch.compile the elementwise glue of the vision blocks and decoder layers (GPU); kwargs go
        to torch.compile (`layers.compile_fn`). Whoever owns the model (trainer, server) calls it; the
        engine leaves the model as it is given and compiles only its own decode functions."""
        self.visual.compile(**kwargs)
        self.model.compile(**kwargs)
        return self

    # ---- pieces ----------------------------------------------------------------------------
    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over the rows of `head_weight` this model holds."""
        return F.linear(hidden, self.head_weight)

    def embed(self, ids: torch.Tensor, ops: ForwardOps | None = None) -> torch.Tensor:
        """Token embeddings of `ids` (by `ops.embed` when given)."""
        if ops is None or ops.embed is None:
            return self.model.embed_tokens(ids)
        return ops.embed(self.model.embed_tokens.weight, ids)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.cfg.text
        return mrope_cos_sin(positions, self.inv_freq, t.mrope_section, dtype, t.mrope_interleaved)

    def embed_prompts(self, prompts: Sequence[ModelInputs], ops: ForwardOps | None = None) -> EmbeddedPrompts:
        """Token embeddings with every image/video of the batch encoded in one vision-tower call."""
        cfg, dev = self.cfg, self.inv_freq.device
        ids = [list(p.input_ids) for p in prompts]
        if not ids or any(len(x) == 0 for x in ids):
            raise ValueError("every prompt needs at least one token")
        B, P = len(ids), max(len(x) for x in ids)
        pad = torch.zeros(B, P, dtype=torch.long)
        positions = torch.zeros(3, B, P, dtype=torch.long)
        deltas = []
        heads = []
        for b, (p, x) in enumerate(zip(prompts, ids)):
            # tokens from `prompt_len` on were generated; they are text even if a model emitted a
            # placeholder id (the response path embeds them as text too)
            head = p.prompt_len
            pad[b, : len(x)] = torch.tensor(x)
            pos, delta = self.prompt_positions(x[:head], p)
            tail = torch.arange(len(x) - head).expand(3, -1) + (head + delta)
            positions[:, b, : len(x)] = torch.cat([pos, tail], dim=1)
            heads.append(head)
            deltas.append(delta)  # the prompt's delta carries over to the generated tail
        pad = to_device(pad, dev)
        x = self.embed(pad, ops)
        visual = self._visual_features(prompts, ops)
        m2 = cfg.vision.spatial_merge_size**2
        flat, feats = [], []
        for b, (p, x_ids, h, f) in enumerate(zip(prompts, ids, heads, visual)):
            if f is None:
                continue
            # placeholder positions found on the host (masked_scatter would sync to count them, and its
            # backward again): image features fill the image placeholders, then video ones the video ones
            n_img = sum(t * hh * w // m2 for t, hh, w in p.image_grids)
            img = [b * P + j for j in range(h) if x_ids[j] == cfg.image_token_id]
            vid = [b * P + j for j in range(h) if x_ids[j] == cfg.video_token_id]
            if len(img) != n_img or len(img) + len(vid) != f.shape[0]:
                raise ValueError(f"prompt {b}: {len(img)} image / {len(vid)} video placeholder tokens for "
                                 f"{n_img} / {f.shape[0] - n_img} visual embeddings")
            flat += img + vid
            feats.append(f)
        deepstack = None
        if flat:
            rows = as_device_tensor(flat, dev, torch.long)
            f = torch.cat(feats).to(x.dtype)  # [n, C * (1 + deepstack_layers)]
            C, K = x.shape[-1], self.deepstack_layers
            if f.shape[1] != C * (1 + K):
                raise ValueError(f"visual features of width {f.shape[1]}, expected {C * (1 + K)}")
            x = x.flatten(0, 1).index_put((rows,), f[:, :C]).view(B, P, -1)
            if K:
                deepstack = DeepStack(rows, list(f[:, C:].view(-1, K, C).unbind(1)), flat)
        lens = as_device_tensor([len(t) for t in ids], dev)
        return EmbeddedPrompts(x, to_device(positions, dev), lens, as_device_tensor(deltas, dev, torch.long), visual,
                               deepstack)

    def prompt_positions(self, ids: list[int], p: ModelInputs) -> tuple[torch.Tensor, int]:
        """M-RoPE positions [3, L] of prompt tokens `ids` with `p`'s images and videos, and the delta of the
        tokens that follow (rope.mrope_positions); ValueError when the placeholders do not match them."""
        return mrope_positions(ids, self.cfg, p.image_grids, p.video_grids, p.second_per_grid_ts)

    def _visual_features(self, prompts: Sequence[ModelInputs], ops: ForwardOps | None = None) -> list:
        """Per prompt, its merged visual features (images, then videos) or None without any: the
        prompt's `vision_embeds` when given, otherwise from one vision-tower call for the whole batch."""
        batch = self.vision_batch(prompts)
        post = None if ops is None else ops.vision_post
        feats = self.visual(*batch[:2], post=post) if batch is not None else None
        return self.split_visual(prompts, feats, batch)

    def vision_batch(self, prompts: Sequence[ModelInputs]):
        """(pixels, grids, owners) of the prompts that need the vision tower (no `vision_embeds`), every
        image of the batch then every video, for one tower call; None when no prompt needs it."""
        m2 = self.cfg.vision.spatial_merge_size**2
        dev = self.inv_freq.device
        run = [i for i, p in enumerate(prompts) if p.vision_embeds is None and p.has_vision]
        pixels, grids, owner = [], [], []
        for kind in ("image", "video"):
            for i in run:
                p = prompts[i]
                pv, g = (p.pixel_values, p.image_grids) if kind == "image" else (p.pixel_values_videos, p.video_grids)
                if g:
                    if pv is None:
                        raise ValueError(f"a prompt has {kind} grids but no {kind} pixels")
                    pixels.append(pv)
                    grids.extend(g)
                    owner.append((i, sum(t * h * w // m2 for t, h, w in g)))
        if not pixels:
            return None
        return torch.cat([to_device(t, dev) for t in pixels]), grids, owner

    def split_visual(self, prompts: Sequence[ModelInputs], feats: torch.Tensor | None, batch) -> list:
        """The tower's output for `vision_batch(prompts)` -> per prompt features (or its vision_embeds)."""
        dev = self.inv_freq.device
        parts: dict[int, list[torch.Tensor]] = {}
        if feats is not None:
            owner = batch[2]
            for (i, _), f in zip(owner, feats.split([n for _, n in owner])):
                parts.setdefault(i, []).append(f)  # a prompt's images come before its videos
        out: list[torch.Tensor | None] = []
        for i, p in enumerate(prompts):
            if p.vision_embeds is not None:
                out.append(to_device(p.vision_embeds, dev))
            elif i in parts:
                fs = parts[i]
                out.append(fs[0] if len(fs) == 1 else torch.cat(fs))
            else:
                out.append(None)
        return out

    def forward_embeds(self, embeds: torch.Tensor, positions: torch.Tensor, attend: AttendFn,
                       ops: ForwardOps | None = None, deepstack: DeepStack | None = None) -> torch.Tensor:
        """Incremental path: embeds [B, L, C], positions [3, B, L], attend owns K/V -> normed hidden.
        deepstack: `EmbeddedPrompts.deepstack` of these embeds (rows of [B * L]), when they hold prompts."""
        cos, sin = self.rope(positions, embeds.dtype)
        return self.model(embeds, cos, sin, attend, ops, deepstack)

    # ---- prefix / response / full -----------------------------------------------------------
    def _run_prompts(self, prompts: Sequence[ModelInputs], keep_kv: bool,
                     ops: ForwardOps | None = None) -> tuple[torch.Tensor, EmbeddedPrompts, list, list]:
        e = self.embed_prompts(prompts, ops)
        keys, values = [], []

        def attend(layer, q, k, v):
            if keep_kv:
                keys.append(k)
                values.append(v)
            return sdpa(q, k, v, causal=True)  # right padding: valid queries never see pads

        return self.forward_embeds(e.embeds, e.positions, attend, ops, e.deepstack), e, keys, values

    def prefix(self, prompts: Sequence[ModelInputs]) -> PrefixState:
        hidden, e, keys, values = self._run_prompts(prompts, keep_kv=True)
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), e.lens - 1]
        return PrefixState(keys, values, e.lens, e.rope_delta, last)

    def response_hidden(
        self, prefix: PrefixState, response_ids: torch.Tensor, prefix_index: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Hidden states predicting each response token: [N, R, C] for response_ids [N, R].

        Row j predicts response_ids[:, j] (row 0 is the prefix's last hidden), exactly the rows
        `P-1 .. P+R-2` of a full forward over prompt + response. Right padding is fine: causal
        attention keeps valid tokens from seeing pads.
        """
        N, R = response_ids.shape
        dev = prefix.lens.device
        idx = torch.arange(N, device=dev) if prefix_index is None else prefix_index.to(dev)
        if idx.shape != (N,) or (N and int(idx.max()) >= prefix.batch_size):
            raise ValueError("prefix_index must give one prefix row per response")
        first = prefix.last_hidden[idx][:, None]  # [N, 1, C]
        if R <= 1:
            return first[:, :R]
        tokens = response_ids[:, :-1].to(dev)  # the last token is only a target
        Rin = R - 1
        lens, delta = prefix.lens[idx], prefix.rope_delta[idx]
        pos = (lens + delta)[:, None] + torch.arange(Rin, device=dev)  # [N, Rin]
        positions = pos[None].expand(3, N, Rin)
        layout = SharedPrefixLayout(idx, lens, prefix.batch_size, prefix.keys[0].shape[2], Rin)

        def attend(layer, q, k, v):
            return shared_prefix_attention(q, k, v, prefix.keys[layer], prefix.values[layer], layout)

        hidden = self.forward_embeds(self.model.embed_tokens(tokens), positions, attend)
        return torch.cat([first, hidden], dim=1)

    def group_hidden(self, prompts: Sequence[ModelInputs], response_ids: torch.Tensor,
                     response_lens: Sequence[int], group: Sequence[int]) -> torch.Tensor:
        """Hidden states predicting each response token, [N, R, C] (rows past a response's length are
        zero), with every prompt and response packed into one sequence (`PackedLayout`): one pass
        through the layers, no padding, one attention call per layer. The same values as
        `response_hidden(prefix(prompts), ...)` and as full forwards; the training/scoring fast path.
        """
        N, R = response_ids.shape
        dev = self.inv_freq.device
        lens, group = _check_responses(response_ids, response_lens, group, len(prompts))
        e = self.embed_prompts(prompts)
        P = [len(p.input_ids) for p in prompts]
        layout = PackedLayout(P, [n - 1 for n in lens], group, dev)
        # flat indices of the real (unpadded) tokens, built on the host: boolean-mask indexing on the
        # device would sync to learn the result's size
        Pmax = e.embeds.shape[1]
        p_idx = to_device(torch.cat([torch.arange(n) + b * Pmax for b, n in enumerate(P)]), dev)
        r_idx = to_device(torch.cat([torch.arange(n - 1) + i * R for i, n in enumerate(lens)]), dev)
        r_off = to_device(torch.cat([torch.arange(n - 1) for n in lens]), dev)  # token index within its response
        r_grp = as_device_tensor([g for g, n in zip(group, lens) for _ in range(n - 1)], dev, torch.long)
        ids = to_device(response_ids, dev).reshape(-1)
        x = torch.cat([e.embeds.flatten(0, 1)[p_idx], self.model.embed_tokens(ids[r_idx])])  # [T, C]
        resp_pos = (e.lens + e.rope_delta)[r_grp] + r_off  # response token j sits at P + delta + j
        positions = torch.cat([e.positions.flatten(1, 2)[:, p_idx], resp_pos[None].expand(3, -1)], dim=1)  # [3, T]

        def attend(layer, q, k, v):
            return packed_attention(q, k, v, layout)

        deepstack = None
        if e.deepstack is not None:  # its rows of the padded [B * Pmax] -> rows of the packed prompts
            starts = [sum(P[:b]) for b in range(len(P))]
            packed = [starts[r // Pmax] + r % Pmax for r in e.deepstack.rows]
            deepstack = DeepStack(as_device_tensor(packed, dev, torch.long), e.deepstack.feats, packed)
        hidden = self.forward_embeds(x[None], positions[:, None], attend, deepstack=deepstack)[0]  # [T, C]
        # row j of response i predicts its token j: j = 0 is its prompt's last token, j >= 1 its input j - 1
        rows = torch.zeros(N, R, dtype=torch.long)
        keep = torch.zeros(N, R, dtype=torch.bool)
        for i, (n, gi) in enumerate(zip(lens, group)):
            rows[i, 0] = layout.prompt_starts[gi] + P[gi] - 1
            rows[i, 1:n] = torch.arange(layout.response_starts[i], layout.response_starts[i] + n - 1)
            keep[i, :n] = True
        rows, keep = to_device(rows, dev), to_device(keep, dev)
        return hidden[rows] * keep[..., None]

    def sequence_hidden(self, prompts: Sequence[ModelInputs], response_ids: torch.Tensor,
                        response_lens: Sequence[int], group: Sequence[int]) -> torch.Tensor:
        """Hidden states predicting each response token, [N, R, C] (rows past a response's length are
        zero), with every sample a whole sequence of its own — its prompt (images encoded again for each
        sample) followed by its response — and the N sequences packed into one token row without padding,
        each a causal segment of one varlen attention call per layer: verl's `use_remove_padding`. No
        prefix is shared; the same values as `group_hidden` and as padded full forwards.
        """
        N, R = response_ids.shape
        dev = self.inv_freq.device
        lens, group = _check_responses(response_ids, response_lens, group, len(prompts))
        seqs = [prompts[g] for g in group]
        e = self.embed_prompts(seqs)  # [N, Pmax, C]: one vision-tower call over every sample's images
        P = [len(p.input_ids) for p in seqs]
        seg = [p + n - 1 for p, n in zip(P, lens)]  # a sample's tokens: its prompt, then its response's inputs
        layout = PackedLayout(seg, [], [], dev)
        starts = layout.prompt_starts
        Pmax = e.embeds.shape[1]
        # packed order, sample by sample, as rows of cat(padded prompt rows [N * Pmax], response inputs), built
        # on the host (a device-side boolean mask would sync to learn its size)
        resp_base = [N * Pmax]
        for n in lens[:-1]:
            resp_base.append(resp_base[-1] + n - 1)
        src = torch.cat([torch.cat([torch.arange(i * Pmax, i * Pmax + p), torch.arange(b, b + n - 1)])
                         for i, (p, b, n) in enumerate(zip(P, resp_base, lens))])
        src = to_device(src, dev)
        r_idx = to_device(torch.cat([torch.arange(n - 1) + i * R for i, n in enumerate(lens)]), dev)
        r_off = to_device(torch.cat([torch.arange(n - 1) for n in lens]), dev)  # token index within its response
        r_own = as_device_tensor([i for i, n in enumerate(lens) for _ in range(n - 1)], dev, torch.long)
        ids = to_device(response_ids, dev).reshape(-1)
        x = torch.cat([e.embeds.flatten(0, 1), self.model.embed_tokens(ids[r_idx])])[src]  # [T, C]
        resp_pos = (e.lens + e.rope_delta)[r_own] + r_off  # response token j sits at P + delta + j
        positions = torch.cat([e.positions.flatten(1, 2), resp_pos[None].expand(3, -1)], dim=1)[:, src]  # [3, T]

        def attend(layer, q, k, v):
            return packed_attention(q, k, v, layout)

        deepstack = None
        if e.deepstack is not None:  # its rows of the padded [N * Pmax] -> rows of the packed sequences
            packed = [starts[r // Pmax] + r % Pmax for r in e.deepstack.rows]
            deepstack = DeepStack(as_device_tensor(packed, dev, torch.long), e.deepstack.feats, packed)
        hidden = self.forward_embeds(x[None], positions[:, None], attend, deepstack=deepstack)[0]  # [T, C]
        # row j of sample i predicts its token j: its sequence's row P_i - 1 + j
        rows = torch.zeros(N, R, dtype=torch.long)
        keep = torch.zeros(N, R, dtype=torch.bool)
        for i, (n, s, p) in enumerate(zip(lens, starts, P)):
            rows[i, :n] = torch.arange(s + p - 1, s + p - 1 + n)
            keep[i, :n] = True
        rows, keep = to_device(rows, dev), to_device(keep, dev)
        return hidden[rows] * keep[..., None]

    def prefix_group_hidden(self, prefix: PrefixState, response_ids: torch.Tensor, response_lens: Sequence[int],
                            group: Sequence[int]) -> torch.Tensor:
        """Like `group_hidden`, but the prompts' prefix is given (computed earlier, e.g. beside decode):
        only the responses run, packed into one sequence with no padding, each attending to its prefix
        row. [N, R, C], rows past a response's length zero; the same values as `group_hidden`."""
        N, R = response_ids.shape
        dev = self.inv_freq.device
        lens, group = _check_responses(response_ids, response_lens, group, prefix.batch_size)
        plens = prefix.lens.tolist()
        layout = PrefixPackedLayout(group, [plens[g] for g in group], prefix.batch_size, prefix.keys[0].shape[2],
                                    [n - 1 for n in lens], dev)
        first = prefix.last_hidden[to_device(torch.tensor(group), dev)]  # [N, C]: row 0 predicts token 0
        out = torch.zeros(N, R, first.shape[-1], dtype=first.dtype, device=dev)
        out[:, 0] = first
        if sum(lens) == N:  # every response is one token: nothing to run
            return out
        r_idx = to_device(torch.cat([torch.arange(n - 1) + i * R for i, n in enumerate(lens)]), dev)
        r_off = to_device(torch.cat([torch.arange(n - 1) for n in lens]), dev)
        r_grp = as_device_tensor([g for g, n in zip(group, lens) for _ in range(n - 1)], dev, torch.long)
        x = self.model.embed_tokens(to_device(response_ids, dev).reshape(-1)[r_idx])  # [T, C]
        pos = (prefix.lens + prefix.rope_delta)[r_grp] + r_off  # response token j sits at P + delta + j

        def attend(layer, q, k, v):
            return prefix_packed_attention(q, k, v, prefix.keys[layer], prefix.values[layer], layout)

        hidden = self.forward_embeds(x[None], pos[None, None].expand(3, 1, -1), attend)[0]  # [T, C]
        rows = to_device(torch.cat([torch.arange(1, n) + i * R for i, n in enumerate(lens)]), dev)
        return out.flatten(0, 1).index_put((rows,), hidden).view(N, R, -1)

    def response_logits(self, prefix: PrefixState, response_ids: torch.Tensor, prefix_index=None) -> torch.Tensor:
        return self.logits(self.response_hidden(prefix, response_ids, prefix_index))

    def hidden(self, prompts: Sequence[ModelInputs], ops: ForwardOps | None = None) -> torch.Tensor:
        """Final-normed hidden states of whole sequences [B, Lmax, C] (rows past an end are junk)."""
        return self._run_prompts(prompts, keep_kv=False, ops=ops)[0]

    def forward(self, prompts: Sequence[ModelInputs]) -> torch.Tensor:
        """Full forward over whole sequences: logits [B, Lmax, V] (rows past a sequence's end are junk)."""
        return self.logits(self.hidden(prompts))


def _check_responses(response_ids: torch.Tensor, response_lens: Sequence[int], group: Sequence[int],
                     num_prompts: int) -> tuple[list[int], list[int]]:
    """Validated (lengths, group) of N responses [N, R] over `num_prompts` prompts."""
    N, R = response_ids.shape
    lens = [int(x) for x in response_lens]
    group = [int(g) for g in group]
    if len(lens) != N or len(group) != N or any(not 1 <= n <= R for n in lens):
        raise ValueError("response_lens must give a length in [1, R] for every response")
    if any(not 0 <= g < num_prompts for g in group):
        raise ValueError("group index out of range")
    return lens, group
