"""The engine on CUDA (skipped without it): graphed decode with the Triton paged attention gives the
reference decoder's greedy tokens and full-forward logprobs, across several batch buckets."""

import pytest
import torch
from helpers import make_prompt

from rollplex.engine import Engine, EngineConfig, SamplingParams
from rollplex.generate import generate
from rollplex.models import ModelConfig, Qwen25VL, TextConfig, VisionConfig, init_weights

pytestmark = pytest.mark.gpu


def _model():
    cfg = ModelConfig(
        text=TextConfig(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, mrope_section=(8, 12, 12),
                        tie_word_embeddings=False),
        vision=VisionConfig(depth=2, hidden_size=64, intermediate_size=96, num_heads=2, window_size=56,
                            out_hidden_size=256, fullatt_block_indexes=(1,)),
        image_token_id=300, video_token_id=301, vision_start_token_id=302, vision_end_token_id=303, eos_token_id=2)
    with torch.device("cuda"):
        return init_weights(Qwen25VL(cfg), seed=0, std=0.05).eval()


@pytest.mark.parametrize("kernel", ["gather", "tma"])
def test_graphed_engine_matches_reference_decoder(kernel):
    """Each attention kernel in turn (the tuner only gets that variant's candidates)."""
    from rollplex.kernels.paged_attention import DECODE_CANDIDATES, attn_variant

    cands = tuple(c for c in DECODE_CANDIDATES if attn_variant(c[1]) == kernel)
    model = _model()
    eng = Engine(model, None, EngineConfig(max_num_seqs=32, max_model_len=512, kv_cache_tokens=64 * 512,
                                           cuda_graph_max_bs=32, attn_candidates=cands))
    assert eng.runner.graphs and eng.cfg.block_size == 64
    assert all(attn_variant(c[1]) == kernel for c in eng.runner.attn_cfg.values() if c[1] is not None)
    g = torch.Generator().manual_seed(0)
    prompts = [make_prompt(g, images=[(1, 4 + 2 * i, 6)], text_len=(3 + i, 5)) for i in range(5)]
    for p in prompts:
        p.pixel_values = p.pixel_values.cuda()
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.samples[0].token_ids == generate(model, p, 40).token_ids
    sampled = eng.generate(prompts, SamplingParams(temperature=0.9, max_new_tokens=30, ignore_eos=True, n=3, seed=4))
    for p, o in zip(prompts, sampled):
        for s in o.samples:
            full = type(p)(p.input_ids + s.token_ids, p.pixel_values, p.image_grid_thw)
            with torch.no_grad():
                logits = model([full])[0].float()
            P = len(p.input_ids)
            ref = torch.log_softmax(logits[P - 1 : P - 1 + len(s.token_ids)] / 0.9, -1)
            ref = ref.gather(-1, torch.tensor(s.token_ids, device="cuda")[:, None]).squeeze(-1)
            assert (ref.cpu() - torch.tensor(s.logprobs)).abs().max().item() < 1e-4
