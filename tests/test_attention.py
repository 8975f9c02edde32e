"""Attention layouts: the packed (varlen) layout of shared-prefix attention gathers exactly the keys
the padded-mask layout attends to (checked on CPU by running each packed segment with SDPA)."""

import torch
import torch.nn.functional as F

from rollplex.models.attention import Segments, SharedPrefixLayout, segment_attention, shared_prefix_attention


def test_packed_shared_prefix_layout_matches_masked_sdpa():
    g = torch.Generator().manual_seed(0)
    B, N, H, Hkv, D, Pmax, Rin = 3, 7, 4, 2, 8, 9, 5
    pk, pv = torch.randn(B, Hkv, Pmax, D, generator=g), torch.randn(B, Hkv, Pmax, D, generator=g)
    q = torch.randn(N, H, Rin, D, generator=g)
    k, v = torch.randn(N, Hkv, Rin, D, generator=g), torch.randn(N, Hkv, Rin, D, generator=g)
    index = torch.tensor([0, 0, 1, 2, 2, 2, 1])
    plens = torch.tensor([9, 4, 6])
    layout = SharedPrefixLayout(index, plens[index], B, Pmax, Rin)
    ref = shared_prefix_attention(q, k, v, pk, pv, layout, backend="sdpa")
    gather, cu_q, cu_k, max_k = layout.packed()
    keys = torch.cat([pk.transpose(1, 2).reshape(-1, Hkv, D), k.transpose(1, 2).reshape(-1, Hkv, D)])[gather]
    vals = torch.cat([pv.transpose(1, 2).reshape(-1, Hkv, D), v.transpose(1, 2).reshape(-1, Hkv, D)])[gather]
    for i in range(N):
        ks, vs = keys[cu_k[i] : cu_k[i + 1]], vals[cu_k[i] : cu_k[i + 1]]  # [Lk, Hkv, D]
        Lk = ks.shape[0]
        assert Lk == int(plens[index[i]]) + Rin and max_k >= Lk
        mask = torch.ones(Rin, Lk, dtype=torch.bool).tril(diagonal=Lk - Rin)  # bottom-right causal
        out = F.scaled_dot_product_attention(q[i], ks.transpose(0, 1).repeat_interleave(2, 0),
                                             vs.transpose(0, 1).repeat_interleave(2, 0), attn_mask=mask)
        assert torch.allclose(out, ref[i], atol=1e-5)


def test_segment_attention_is_blockwise():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(10, 2, 4, generator=g) for _ in range(3))
    seg = Segments([0, 3, 4, 10], torch.device("cpu"))
    out = segment_attention(q, k, v, seg, backend="sdpa")
    for a, b in ((0, 3), (3, 4), (4, 10)):
        ref = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1))
        assert torch.allclose(out[a:b], ref.transpose(0, 1), atol=1e-6)
