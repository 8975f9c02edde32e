"""The compiled layer glue (torch.compile of the norm/rotary/SwiGLU functions, the GPU default) computes
what eager computes: the packed training pass's hidden states and gradients, for both shape modes
(automatic dynamic, the default, and `dynamic=True`, `bench ... --compile-dynamic true`), across a
change of shapes. On CPU inductor emits C++; dynamo and AOTAutograd, where such breakages live, are
the same as on the GPU."""

import pytest
import torch
from helpers import FORWARD_TERMS, assert_fp32_close, make_prompt, random_text_ids, tiny_model

# inductor builds C++ kernels for every graph and shape here: minutes on two cores with a cold compile cache
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


@pytest.fixture(scope="module", autouse=True)
def _cpu_inductor():
    """Inductor on CPU needs a C++ toolchain and Python headers; skip (not fail) on machines without."""
    try:
        torch.compile(lambda x: x * 2 + 1)(torch.randn(4))
    except Exception as e:  # noqa: BLE001 - any toolchain failure
        pytest.skip(f"torch.compile cannot build CPU kernels here: {type(e).__name__}")


def _pass(model, prompts, resp, lens):
    for p in model.parameters():
        p.grad = None
    h = model.group_hidden(prompts, resp, lens, [0, 1, 0, 1, 1])
    (h * torch.linspace(-1, 1, h.shape[-1])).sum().backward()
    return h.detach(), model.model.layers[0].self_attn.qkv_proj.weight.grad.clone()


@pytest.mark.parametrize("dynamic", [True, None])
def test_compiled_glue_matches_eager_across_shapes(dynamic):
    g = torch.Generator().manual_seed(3)
    prompts = [make_prompt(g, images=[(1, 6, 10)]), make_prompt(g, text_len=(9, 3))]
    resp = random_text_ids((5, 11), g, vocab=290)
    eager, compiled = tiny_model(seed=4), tiny_model(seed=4).compile(dynamic=dynamic)
    for lens in ([11, 1, 4, 11, 7], [5, 3, 4, 11, 2]):  # the second shape recompiles (None) or reuses (True)
        (h0, g0), (h1, g1) = _pass(eager, prompts, resp, lens), _pass(compiled, prompts, resp, lens)
        # Inductor fuses and reorders the reductions: equal up to fp32 summation order (helpers.fp32_rtol)
        assert_fp32_close(h1, h0, "hidden states", FORWARD_TERMS)
        assert_fp32_close(g1, g0, "qkv weight grad")


def test_compiled_sampler_matches_eager_across_batches_and_modes():
    """The engine compiles the sampler on GPU (automatic-dynamic): same tokens and logprobs as eager for
    several batch sizes (the second one recompiles with a symbolic batch) and each greedy/truncation mode."""
    from rollplex.engine.sampler import Sampler, SamplingTensors

    eager, compiled = Sampler(), Sampler(compile=True)
    g = torch.Generator().manual_seed(0)
    V = 300
    for B in (3, 5, 8):
        logits = torch.randn(B, V, generator=g) * 3
        for rows in ([(0.0, -1, 1.0, 0.0, i, 2) for i in range(B)],  # all greedy
                     [(1.0, -1, 1.0, 0.0, i, 2) for i in range(B)],  # plain sampling
                     [(0.8, 20, 0.9, 0.05, i, i) for i in range(B)]):  # truncated
            st = SamplingTensors.build(rows, V, "cpu")
            (t0, l0), (t1, l1) = eager(logits, st), compiled(logits, st)
            assert torch.equal(t0, t1)
            torch.testing.assert_close(l0, l1, atol=1e-5, rtol=1e-5)
