"""Kernels of the engine's decode step, their launch-config tuners, and the torch paths they are checked
against.

    paged_attention.py         paged-KV decode attention: dispatch, torch reference, launch-config tuner
    paged_attention_triton.py  its Triton flash-decoding kernel (fused new-token write, rotary, split merge)
    swiglu_gemm.py             gate_up GEMM with SwiGLU in its epilogue (Triton) and its tuner
    split_k.py                 K-sliced projections with fp32 partials summed by their reader, and their tuner
    decode_gemms.py            which kernels run the decode step's projections (`SkinnyGemms`), timed per
                               batch size
    tuning.py                  timing candidates as the graphed decode step runs them
    tuning_cache.py            tuning results on disk, keyed by GPU, software, shapes and candidates

Everything here imports without triton (kernels are built on first use) and knows nothing of the
engine: the engine imports from here, never the reverse.
"""
