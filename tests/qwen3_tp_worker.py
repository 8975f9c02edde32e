"""One rank of the Qwen3-VL tensor-parallel decode test: the text decoder split over gloo ranks (the
q/k head norms whole on every rank), with `vision` the tower's blocks too (heads and MLP; LayerNorms,
position table and DeepStack mergers whole), prefill logits and the engine's generations against one
process."""

from __future__ import annotations

import torch.distributed as dist
from helpers import FORWARD_TERMS, assert_fp32_close
from parallel_helpers import init_group
from parallel_tp_worker import run
from qwen3_helpers import tiny_qwen3

from rollplex.parallel import apply_tensor_parallel


def worker(rank: int, world: int, init: str, prompts, want: dict, vision: bool = False) -> None:
    init_group(rank, world, init)
    try:
        model = tiny_qwen3(seed=7).eval()
        t, v = model.cfg.text, model.cfg.vision
        tp = apply_tensor_parallel(model, vision=vision)
        blk = model.visual.blocks[0]
        split = world if vision else 1
        assert blk.attn.num_heads == v.num_heads // split
        assert blk.mlp.linear_fc1.weight.shape == (v.intermediate_size // split, v.hidden_size)
        assert blk.mlp.linear_fc2.bias.shape == (v.hidden_size,)
        a = model.model.layers[0].self_attn
        assert (a.num_heads, a.num_kv_heads) == (t.num_attention_heads // world, t.num_key_value_heads // world)
        assert a.q_norm.weight.shape == (t.head_dim,) and a.qk_norm_weight().shape == (
            (a.num_heads + a.num_kv_heads), t.head_dim)
        got = run(model, prompts, tp)
        for b, n in enumerate(want["lens"]):
            assert_fp32_close(got["logits"][b, :n], want["logits"][b, :n], f"logits of prompt {b}", FORWARD_TERMS)
        for i, reqs in want["outs"].items():
            for (tok, lp, _), (gtok, glp, _) in zip(reqs, got["outs"][i]):
                assert gtok == tok, (i, gtok, tok)
                assert_fp32_close(sum(glp, []), sum(lp, []), f"logprobs of setting {i}", FORWARD_TERMS)
        dist.barrier()
    finally:
        dist.destroy_process_group()
