"""The steps of the model's inference forward that a caller may run its own way, passed per call.

The model's math lives in plain functions of tensors (text.py, vision.py). Four of its steps can be
replaced by the caller for one call, without touching the model object:

    embed(weight, ids) -> [..., C]      the token lookup in `weight`, the embedding table the model holds
    text_weights(qkv_w, qkv_b, gate_up_w) -> the same three
                                        a decoder layer's fused projections as it holds them -> as its
                                        math reads them (a caller that stores their rows in another
                                        order gives them back in the layer's)
    text_post(...)                      the decoder layer's post-attention function (o projection, residual,
                                        norm, MLP): `text._post_attention`'s signature and result
    vision_post(...)                    the vision blocks' post-attention function (`vision._post_attention`'s
                                        signature); given, the tower's fused whole-block path is off
    reduce(t) -> t                      the sum over the ranks of a row-parallel projection's partial output:
                                        with it a family whose blocks differ from Qwen2.5-VL's builds its own
                                        post-attention in place of `vision_post` (Qwen3-VL's tower)

None (or a None field) is the model's own step. Whoever shards the model's parameters supplies the
versions that combine the shards (rollplex.parallel.tp builds them for tensor parallelism and hands them
to the engine in its plan; rollplex.parallel.shared_weights the weight reads of a trainer whose shards
are a tensor-parallel engine's); the model reads only the tensors it holds and the functions it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardOps:
    embed: Callable | None = None
    text_post: Callable | None = None
    vision_post: Callable | None = None
    text_weights: Callable | None = None
    reduce: Callable | None = None
