"""Runs the shared model for the engine: paged KV cache, prefill, graphed decode, block copies.

The runner holds a reference to the *live* model: no weight copy is made, so an in-place update by
the trainer (optimizer.step, load_state_dict) is what the next prefill and the next graph replay
read — CUDA graphs capture parameter addresses, not values.

KV cache: two tensors [layers, blocks, block_size, Hkv, D]. Sized from a token budget on CPU, and on
GPU from `gpu_memory_utilization` after a warm-up prefill at the largest batch (the peak memory of
weights + activations is subtracted). Block 0 is scratch: padded rows of a graphed batch write
there.

Prefill runs the model's forward over a right-padded batch (images and videos included:
`embed_prompts` runs the vision tower once for the whole batch) and writes K/V through slot mappings.
Decode feeds one token per sequence through the engine's own layer function (`DecodeForward`, over
the model's parameters); on GPU it replays a CUDA graph captured for the smallest batch-size bucket
that fits. Before a bucket is captured, its attention launch config and the kernels of its
projections (split-K o/down, fused gate_up + SwiGLU: kernels/decode_gemms.py) are picked by timing,
or read from the tuning cache when this GPU and software timed the same shapes and candidates
before (kernels/tuning_cache.py, EngineConfig.tuning_cache_dir).

A tensor-parallel model comes with its plan (`tp`, rollplex.parallel.TPPlan): prefill runs the model
with the plan's ops (vocab-parallel lookup, reducing post-attention functions) and gathers the logits,
decode all-reduces its row-parallel outputs through `tp.reduce`; the model object is the same either way.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Protocol

import torch

from ..kernels import tuning_cache
from ..kernels.decode_gemms import SkinnyGemms, tune_decode_gemms
from ..kernels.paged_attention import DECODE_CANDIDATES, paged_decode_attention, paged_verify_attention, tune_decode
from ..kernels.split_k import SPLIT_K_CANDIDATES
from ..kernels.swiglu_gemm import SWIGLU_CANDIDATES
from ..models import ForwardOps, ModelInputs, Qwen25VL
from ..models.attention import sdpa
from ..models.layers import apply_rotary
from ..models.transfer import as_device_tensor, to_device
from .config import EngineConfig
from .decode_forward import DecodeForward

CPU_DEFAULT_KV_TOKENS = 65536
log = logging.getLogger("rollplex.engine")


class TensorParallelPlan(Protocol):
    """What the engine reads of a tensor-parallel plan (rollplex.parallel.TPPlan, which
    `apply_tensor_parallel` returns; the engine is given one and never builds one)."""

    group: object  # the torch.distributed process group of the model's ranks
    size: int
    rank: int
    vision: bool  # the vision tower's blocks are split too
    ops: ForwardOps  # the forward's steps that combine the shards (vocab-parallel lookup, reducing post-attention)

    def reduce(self, t: torch.Tensor) -> torch.Tensor: ...  # sum of the ranks' partial outputs, in place

    def gather_last(self, t: torch.Tensor) -> torch.Tensor: ...  # the ranks' slices of the last dim, in order

    def logits(self, model: Qwen25VL, hidden: torch.Tensor) -> torch.Tensor: ...  # full-vocabulary logits


def check_tensor_parallel(model: Qwen25VL, tp: TensorParallelPlan | None) -> None:
    """ValueError unless `model`'s parameters are the shards `tp` describes (None: the whole model)."""
    size, vision = (1, False) if tp is None else (tp.size, tp.vision)
    t, v = model.cfg.text, model.cfg.vision
    rows = model.head_weight.shape[0]
    if rows * size != t.vocab_size:
        raise ValueError(f"the model's LM head holds {rows} of {t.vocab_size} vocabulary rows, but the engine was "
                         f"given {'no tensor-parallel plan' if tp is None else f'a plan over {size} ranks'} "
                         "(Engine(..., tp=apply_tensor_parallel(model, group)))")
    heads = model.visual.blocks[0].attn.num_heads
    if heads * (size if vision else 1) != v.num_heads:
        raise ValueError(f"the model's vision blocks hold {heads} of {v.num_heads} heads, but the plan has the "
                         f"tower {'split' if vision else 'whole'} (apply_tensor_parallel(vision=...))")


@contextlib.contextmanager
def _timed(events: tuple | None):
    """Record events[0] before the body's device work and events[1] after it (None: nothing)."""
    if events is not None:
        events[0].record()
    yield
    if events is not None:
        events[1].record()


def graph_buckets(max_bs: int) -> list[int]:
    small = [b for b in (1, 2, 4, 8) if b < max_bs]
    return small + list(range(16, max_bs, 16)) + [max_bs]


class ModelRunner:
    def __init__(self, model: Qwen25VL, cfg: EngineConfig, memory=None, tp: TensorParallelPlan | None = None):
        """memory: a MemoryManager whose `kv_cache` region holds the KV cache (released outside rollout;
        the graphs keep its addresses, so a resume needs no re-capture). tp: the plan `model` was split
        by (rollplex.parallel.apply_tensor_parallel), None for a whole model."""
        check_tensor_parallel(model, tp)
        self.model, self.cfg = model, cfg
        self.device = model.inv_freq.device
        self.dtype = model.model.embed_tokens.weight.dtype
        t = model.cfg.text
        self.tp = tp
        self.ops = None if tp is None else tp.ops  # the forward's steps that combine the shards
        # decode returns this rank's vocabulary rows of the logits, sampled without a gather (vocab_parallel_sampler.py)
        self.vocab_parallel = self.tp is not None and cfg.vocab_parallel_sampling
        # this rank's KV heads: a share of them when the model is tensor-parallel
        self.num_layers, self.num_kv_heads, self.head_dim = t.num_hidden_layers, self._attn().num_kv_heads, t.head_dim
        self.block_size = cfg.block_size
        self.max_blocks_per_seq = -(-cfg.max_model_len // cfg.block_size)
        t0 = time.perf_counter()
        self.num_blocks = self._num_blocks()
        # seconds per startup phase, for the owner's log: KV sizing (on GPU a warm-up prefill, which compiles a
        # compiled forward), decode kernel tuning, decode compile + graph capture
        self.startup_s = {"kv_sizing": time.perf_counter() - t0, "tuning": 0.0, "capture": 0.0}
        if self.tp is not None:  # one block budget for the group: the ranks' schedulers must stay in step
            n = torch.tensor([self.num_blocks], device=self.device)
            torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MIN, group=self.tp.group)
            self.num_blocks = int(n)
        shape = (self.num_layers, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        with memory.region("kv_cache") if memory is not None else contextlib.nullcontext():
            self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if memory is not None:
            # attention reads whole blocks and masks by length: unwritten slots must hold finite values (a
            # masked 0 * NaN is still NaN), so memory that comes back from a release starts zeroed again
            memory.on_resume("kv_cache", self.zero_kv_cache)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.attn_cfg: dict[int, tuple] = {}  # graphed batch size -> (num_splits, tile) of its attention
        self.gemms: dict[int, SkinnyGemms] = {}  # graphed batch size -> how its projections run
        self.gemms_us: dict[int, dict] = {}  # graphed batch size -> the GEMM tuner's timings
        # one count per (sequence, KV head) for the attention kernel's in-kernel split merge; every
        # launch leaves it zeroed, so all layers and batch sizes share it (they run one after another)
        self.attn_semaphore = torch.zeros(max(cfg.max_num_seqs, cfg.cuda_graph_max_bs, cfg.speculative_rows)
                                          * self.num_kv_heads,
                                          dtype=torch.int32, device=self.device)
        # host copy of the decode block table, updated incrementally (see _host_block_table)
        rows = min(cfg.cuda_graph_max_bs, cfg.max_num_seqs)
        self._bt_host = torch.zeros(rows, self.max_blocks_per_seq, dtype=torch.int32)
        self._bt_held: list[tuple] = [(None, 0)] * rows  # (key of the sequence in the row, its table length)
        # the decode step's own layer functions over the model's parameters (compiled on GPU): the
        # model itself is never patched or compiled here
        compile_decode = self.device.type == "cuda" if cfg.compile_decode is None else cfg.compile_decode
        self.decoder = DecodeForward(model, compile=compile_decode, reduce=None if self.tp is None else self.tp.reduce)
        self.use_graphs = self.device.type == "cuda" and cfg.cuda_graph
        self._pool = None  # the decode graphs' memory pool, shared by the verify graphs
        self.verify_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # sequences -> graph
        if self.use_graphs:
            self._capture()
            if cfg.speculative_tokens:
                self._capture_verify()

    def _attn(self):
        return self.model.model.layers[0].self_attn

    # ---- sizing -------------------------------------------------------------------------------
    def zero_kv_cache(self) -> None:
        self.k_cache.zero_()
        self.v_cache.zero_()

    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.kv_bytes_per_block()

    def kv_bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def _num_blocks(self) -> int:
        if self.cfg.kv_cache_tokens is not None:
            return self.cfg.kv_cache_tokens // self.block_size
        if self.device.type != "cuda":
            return CPU_DEFAULT_KV_TOKENS // self.block_size
        # warm-up at the largest prefill we will run, then give KV what is left of the budget
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = min(self.cfg.max_num_batched_tokens, self.cfg.max_model_len - 1)

        with torch.no_grad():
            self.model.embed(torch.zeros(1, dtype=torch.long, device=self.device), self.ops)
            self.logits(self.model.hidden([ModelInputs(input_ids=[1] * n)], self.ops)[:, -1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = total * self.cfg.gpu_memory_utilization - peak
        # leave room for the graphed decode's logits/workspace at the largest batch
        budget -= 4 * self.cfg.cuda_graph_max_bs * self.model.cfg.text.vocab_size * 2
        blocks = int(budget // self.kv_bytes_per_block())
        if blocks < 2:
            raise RuntimeError(f"no GPU memory left for the KV cache (peak {peak / 2**30:.1f} GiB of "
                               f"{total / 2**30:.1f} GiB; raise gpu_memory_utilization)")
        torch.cuda.empty_cache()
        return blocks

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (gathered from the ranks under tensor parallelism)."""
        return self.model.logits(hidden) if self.tp is None else self.tp.logits(self.model, hidden)

    # ---- prefill --------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, inputs: list, slots: list[list[int]], logprob_rows: list[tuple[int, int] | None]):
        """inputs: ModelInputs-like (all tokens to compute); slots: cache slot of every token.

        Returns (logits of each item's last token [B, V] fp32, per item logits rows [a, b) or None,
        per item its merged visual features or None).
        """
        m = self.model
        e = m.embed_prompts(inputs, self.ops)
        B, P = e.embeds.shape[:2]
        valid = torch.arange(P, device=self.device)[None, :] < e.lens[:, None]
        flat_slots = torch.tensor([s for row in slots for s in row], dtype=torch.long, device=self.device)
        kv_shape = (-1, self.num_kv_heads, self.head_dim)

        def attend(layer, q, k, v):
            self.k_cache[layer].view(kv_shape).index_copy_(0, flat_slots, k.transpose(1, 2)[valid])
            self.v_cache[layer].view(kv_shape).index_copy_(0, flat_slots, v.transpose(1, 2)[valid])
            return sdpa(q, k, v, causal=True)

        hidden = m.forward_embeds(e.embeds, e.positions, attend, self.ops, e.deepstack)
        last = hidden[torch.arange(B, device=self.device), e.lens - 1]
        extra = [None if r is None else self.logits(hidden[i, r[0] : r[1]]).float() for i, r in enumerate(logprob_rows)]
        return self.logits(last).float(), extra, e.visual

    @torch.no_grad()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = as_device_tensor([c[0] for c in copies], self.device)
        dst = as_device_tensor([c[1] for c in copies], self.device)
        self.k_cache[:, dst] = self.k_cache[:, src]
        self.v_cache[:, dst] = self.v_cache[:, src]

    # ---- decode ---------------------------------------------------------------------------------
    def _decode_forward(self, meta: torch.Tensor, block_table: torch.Tensor, attn_cfg=(None, None),
                        gemms: SkinnyGemms | None = None) -> torch.Tensor:
        """meta [4, B] long rows: token id, position, KV length, cache slot (the slot of position
        KV length - 1 in block_table, where the kernel writes); block_table [B, W]. gemms: how the
        projections run (kernels.decode_gemms.SkinnyGemms)."""
        m = self.model
        ids, pos, seq_lens, _slots = meta.unbind(0)
        positions = pos[None, :, None].expand(3, -1, 1)

        def attend(layer, q, k, v, cos, sin):
            # the kernel rotates q and the new k as it loads them, then stores the new token's k/v at
            # position seq_len - 1 (slot from the table) itself
            return paged_decode_attention(q[:, :, 0], self.k_cache[layer], self.v_cache[layer], block_table, seq_lens,
                                          k_new=k[:, :, 0], v_new=v[:, :, 0], num_splits=attn_cfg[0],
                                          tile=attn_cfg[1], cos=cos[:, 0], sin=sin[:, 0],
                                          semaphore=self.attn_semaphore)[:, :, None]

        hidden = self.decoder(m.embed(ids, self.ops)[:, None], positions, attend, gemms)
        # in the weights' dtype: the sampler upcasts inside its fused kernels (same values), so the graph
        # does not write a [B, V] fp32 copy (156 MB at B = 256); vocab-parallel: this rank's rows
        return (m.logits if self.vocab_parallel else self.logits)(hidden[:, 0])

    @torch.no_grad()
    def decode(self, ids: list[int], positions: list[int], tables: list[list[int]], seq_lens: list[int],
               slots: list[int], prev_tokens: torch.Tensor | None = None, src: list[int] | None = None,
               table_keys: list | None = None, timing: tuple | None = None) -> torch.Tensor:
        """One token per sequence -> logits [B, V] (weights' dtype; this rank's [B, V/tp] when
        `vocab_parallel`). With prev_tokens (a step still in flight, on
        the device) and src, row i's input token is prev_tokens[src[i]] where src[i] >= 0.
        table_keys (a stable id per sequence) lets the block table be updated row by row instead
        of rebuilt from lists every step. timing: two CUDA events recorded around the forward alone."""
        B = len(ids)
        bucket = next((b for b in sorted(self.graphs) if b >= B), B)
        pad = bucket - B  # padded rows: token 0 at position 0, attending to (and writing) scratch slot 0
        meta = torch.tensor([ids + [0] * pad, positions + [0] * pad, seq_lens + [1] * pad, slots + [0] * pad])
        width = max(len(t) for t in tables)
        if table_keys is not None and bucket <= self._bt_host.shape[0]:
            bt = self._host_block_table(tables, table_keys, bucket)[:, :width]
        else:
            bt = torch.tensor([t + [0] * (width - len(t)) for t in tables] + [[0] * width] * pad, dtype=torch.int32)
        # host -> device through fresh pinned buffers (`to_device`): with overlap scheduling the previous
        # step is still running, and a copy from pageable memory may wait for it
        if bucket not in self.graphs:
            meta = to_device(meta, self.device)
            self._patch_ids(meta[0, :B], prev_tokens, src)
            sk = self.cfg.decode_split_k
            bt = to_device(bt, self.device)
            with _timed(timing):
                return self._decode_forward(meta, bt, gemms=sk and SkinnyGemms(*sk))
        graph, out = self.graphs[bucket]
        self.static_meta[:, :bucket].copy_(to_device(meta, self.device))
        self._patch_ids(self.static_meta[0, :B], prev_tokens, src)
        # only the columns this batch uses: entries past a sequence's last block are never read
        self.static_bt[:bucket, :width].copy_(to_device(bt, self.device))
        with _timed(timing):
            graph.replay()
        return out[:B]

    # ---- speculative verification -----------------------------------------------------------------
    def _verify_forward(self, meta: torch.Tensor, block_table: torch.Tensor, per: int,
                        gemms: SkinnyGemms | None = None) -> torch.Tensor:
        """Several new tokens per sequence, each its own row: meta [4, B * per] (token id, position, KV
        length = position in the sequence + 1, cache slot of that position), sequence i's rows at
        i * per .. i * per + per - 1; block_table [B, W]. Every row's K/V is written to the cache first,
        then each row attends to its sequence's first `KV length` tokens: causal within a sequence's new
        tokens. The attention reads a sequence's K/V once for all its rows (`paged_verify_attention`).
        -> logits [B * per, V]."""
        m = self.model
        ids, pos, seq_lens, slots = meta.unbind(0)
        positions = pos[None, :, None].expand(3, -1, 1)
        kv_shape = (-1, self.num_kv_heads, self.head_dim)
        B = block_table.shape[0]
        lens = seq_lens.view(B, per)

        def attend(layer, q, k, v, cos, sin):
            # rotated in fp32 and rounded once, as the decode kernel rotates what it loads
            c, s = cos[:, None].float(), sin[:, None].float()
            q = apply_rotary(q.float(), c, s).to(q.dtype)
            k = apply_rotary(k.float(), c, s).to(k.dtype)
            self.k_cache[layer].view(kv_shape).index_copy_(0, slots, k[:, :, 0])
            self.v_cache[layer].view(kv_shape).index_copy_(0, slots, v[:, :, 0])
            R, H, _, D = q.shape
            out = paged_verify_attention(q[:, :, 0].reshape(B, per, H, D), self.k_cache[layer], self.v_cache[layer],
                                         block_table, lens, semaphore=self.attn_semaphore)
            return out.reshape(R, H, D)[:, :, None]

        hidden = self.decoder(m.embed(ids, self.ops)[:, None], positions, attend, gemms)
        return self.logits(hidden[:, 0])

    def _verify_gemms(self, rows: int) -> SkinnyGemms | None:
        """The projection plan of the smallest tuned decode bucket >= rows (the same GEMM shapes); the
        configured default where none was tuned."""
        b = next((b for b in sorted(self.graphs) if b >= rows), None)
        if b is None:
            sk = self.cfg.decode_split_k
            return sk and SkinnyGemms(*sk)
        return self.gemms[b]

    @staticmethod
    def _verify_layout(ids, positions, tables, seq_lens, slots, counts, seqs: int, per: int):
        """(meta [4, seqs * per], block table [seqs, W], the rows holding the real tokens): sequence i's
        counts[i] rows first in its `per`; the other rows (and sequences past len(counts)) are padding:
        token 0 at position 0, KV length 1, writing scratch slot 0. Built as lists, one tensor each (a
        tensor per sequence cost ~1.5 ms of host time per verify step at 64 sequences)."""
        cols = ([], [], [], [])
        index, r = [], 0
        for i, c in enumerate(counts):
            pad = per - c
            for col, src, fill in zip(cols, (ids, positions, seq_lens, slots), (0, 0, 1, 0)):
                col.extend(src[r:r + c])
                col.extend([fill] * pad)
            index.extend(range(i * per, i * per + c))
            r += c
        rest = (seqs - len(counts)) * per
        for col, fill in zip(cols, (0, 0, 1, 0)):
            col.extend([fill] * rest)
        width = max(len(t) for t in tables)
        bt = [t + [0] * (width - len(t)) for t in tables] + [[0] * width] * (seqs - len(tables))
        return torch.tensor(cols, dtype=torch.long), torch.tensor(bt, dtype=torch.int32), index

    @torch.no_grad()
    def verify(self, ids: list[int], positions: list[int], tables: list[list[int]], seq_lens: list[int],
               slots: list[int], counts: list[int], timing: tuple | None = None) -> torch.Tensor:
        """Score a few tokens per sequence in one pass: counts[i] rows for sequence i (its last token and
        its draft), flattened in order in the other lists (tables: one per sequence). Writes the K/V of
        every row. timing: two CUDA events recorded around the pass's GPU work. -> logits [sum(counts),
        V] (weights' dtype), row for row."""
        B = len(counts)
        per = self.cfg.speculative_tokens + 1
        bucket = next((b for b in sorted(self.verify_graphs) if b >= B), None)
        if bucket is None or max(counts) > per:
            per = max(counts)
            meta, bt, index = self._verify_layout(ids, positions, tables, seq_lens, slots, counts, B, per)
            meta, bt = to_device(meta, self.device), to_device(bt, self.device)
            with _timed(timing):
                out = self._verify_forward(meta, bt, per, self._verify_gemms(B * per))
            return out[as_device_tensor(index, self.device, torch.long)]
        # graphed: the bucket's sequences x per rows, padded
        meta, bt, index = self._verify_layout(ids, positions, tables, seq_lens, slots, counts, bucket, per)
        graph, out = self.verify_graphs[bucket]
        self.static_vmeta[:, : bucket * per].copy_(to_device(meta, self.device))
        # columns past the batch's widest table are never read: each row reads the blocks of its KV length only
        self.static_vbt[:bucket, : bt.shape[1]].copy_(to_device(bt, self.device))
        with _timed(timing):
            graph.replay()
        return out[as_device_tensor(index, self.device, torch.long)]

    def _capture_verify(self) -> None:
        """One verify graph per bucket of sequences (speculative_max_batch at most), each sequence with
        speculative_tokens + 1 rows."""
        dev, per = self.device, self.cfg.speculative_tokens + 1
        buckets = graph_buckets(self.cfg.speculative_max_batch)
        self.static_vmeta = torch.zeros(4, buckets[-1] * per, dtype=torch.long, device=dev)
        self.static_vmeta[2] = 1
        self.static_vbt = torch.zeros(buckets[-1], self.max_blocks_per_seq, dtype=torch.int32, device=dev)
        t0 = time.perf_counter()
        for b in reversed(buckets):
            args = (self.static_vmeta[:, : b * per], self.static_vbt[:b], per, self._verify_gemms(b * per))
            with torch.no_grad():
                side = torch.cuda.Stream(dev)
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):
                    self._verify_forward(*args)  # warm-up; padding rows write scratch slot 0 only
                torch.cuda.current_stream(dev).wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self._pool):
                    out = self._verify_forward(*args)
            self._pool = g.pool()
            self.verify_graphs[b] = (g, out)
        torch.cuda.synchronize(dev)
        self.startup_s["capture"] += time.perf_counter() - t0
        log.info("verify graphs: %d buckets of up to %d sequences x %d tokens, %.1fs", len(buckets), buckets[-1],
                 per, time.perf_counter() - t0)

    def _host_block_table(self, tables: list[list[int]], keys: list, rows: int) -> torch.Tensor:
        """The [rows, max_blocks] host block table, kept between steps: a row is rewritten only when
        another sequence takes it, and a sequence that gained a block gets one entry written. Rows past
        the batch are zeros (padded rows read scratch block 0)."""
        host, held = self._bt_host, self._bt_held
        for i, (t, key) in enumerate(zip(tables, keys)):
            k, n = held[i]
            if k == key and n == len(t):
                continue
            if k == key and n == len(t) - 1:
                host[i, n] = t[n]
            else:
                host[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
                if n > len(t):  # the previous occupant's longer table
                    host[i, len(t) : n] = 0
            held[i] = (key, len(t))
        for i in range(len(tables), rows):
            if held[i][0] is not None:
                host[i].zero_()
                held[i] = (None, 0)
        return host[:rows]

    def _patch_ids(self, ids: torch.Tensor, prev_tokens: torch.Tensor | None, src: list[int] | None) -> None:
        """Input tokens sampled by the previous (not yet resolved) step, taken on the device."""
        if prev_tokens is None or src is None:
            return
        s = as_device_tensor(src, self.device, torch.long)
        ids.copy_(torch.where(s >= 0, prev_tokens[s.clamp(min=0)], ids))

    TUNE_CONTEXT = 768  # tokens per sequence the attention kernel is tuned at
    TUNE_LAYERS = 8  # layers whose caches the tuning calls cycle through (more KV than L2 holds)

    def _tune_attention(self, b: int) -> tuple:
        """Pick the paged-attention launch config for batch size b by timing candidates on the (still
        empty) cache: b sequences of TUNE_CONTEXT tokens in their own blocks."""
        ctx = min(self.TUNE_CONTEXT, self.cfg.max_model_len - 1)
        per = -(-ctx // self.block_size)
        if 1 + b * per > self.num_blocks:
            return (None, None)
        dev, dt = self.device, self.dtype
        table = torch.zeros(b, self.max_blocks_per_seq, dtype=torch.int32, device=dev)
        table[:, :per] = 1 + torch.arange(b * per, device=dev, dtype=torch.int32).view(b, per)
        q = torch.randn(b, self._attn().num_heads, self.head_dim, device=dev, dtype=dt)
        kn = torch.randn(b, self.num_kv_heads, self.head_dim, device=dev, dtype=dt)
        lens = torch.full((b,), ctx, device=dev)
        cos = torch.ones(b, self.head_dim, device=dev, dtype=dt)
        sin = torch.zeros(b, self.head_dim, device=dev, dtype=dt)
        # timed calls cycle through several layers' caches: in the step, each layer's KV comes from HBM
        layers = min(self.num_layers, self.TUNE_LAYERS)
        best = tune_decode(q, [self.k_cache[i] for i in range(layers)], [self.v_cache[i] for i in range(layers)],
                           table, lens, kn, kn.clone(), candidates=self.cfg.attn_candidates or DECODE_CANDIDATES,
                           cos=cos, sin=sin,
                           semaphore=self.attn_semaphore)
        self.k_cache[:layers, 1:1 + b * per].zero_()
        self.v_cache[:layers, 1:1 + b * per].zero_()
        return best

    def _tuning_keys(self, b: int, env: dict) -> tuple[dict, dict]:
        """The tuning-cache keys of bucket b's attention config and projection kernels: everything
        the timed result depends on besides the GPU and software (`env`)."""
        t = self.model.cfg.text
        ctx = min(self.TUNE_CONTEXT, self.cfg.max_model_len - 1)
        common = {**env, "batch": b, "dtype": str(self.dtype), "layers": min(self.num_layers, self.TUNE_LAYERS)}
        attn = {"what": "attention", **common, "context": ctx, "block_size": self.block_size,
                "table_width": self.max_blocks_per_seq, "heads": [t.num_attention_heads, self.num_kv_heads,
                                                                  self.head_dim],
                "tunable": 1 + b * -(-ctx // self.block_size) <= self.num_blocks,  # else the default config
                "candidates": [list(c) for c in (self.cfg.attn_candidates or DECODE_CANDIDATES)]}
        gemms = {"what": "gemms", **common, "hidden": t.hidden_size, "intermediate": t.intermediate_size,
                 "split_k": self.cfg.decode_split_k, "fused_swiglu": self.cfg.decode_fused_swiglu,
                 "split_k_candidates": list(self.cfg.split_k_candidates or SPLIT_K_CANDIDATES),
                 "swiglu_candidates": [list(c) for c in (self.cfg.swiglu_candidates or SWIGLU_CANDIDATES)]}
        return attn, gemms

    @staticmethod
    def _cached(cache: tuning_cache.TuningCache, key: dict, tune, to_json, from_json) -> tuple[object, bool]:
        """(result, whether it came from the cache): the stored result for `key`, else tune(), stored."""
        stored = cache.get(key)
        if stored is not None:
            try:
                return from_json(stored), True
            except (ValueError, TypeError, KeyError) as e:
                log.warning("tuning cache: ignoring the stored %s result (%s); tuning again", key["what"], e)
        value = tune()
        if cache.enabled:
            try:
                cache.put(key, to_json(value))
            except ValueError as e:  # a result this cache cannot store: tuned again next time
                log.warning("tuning cache: not storing the %s result (%s)", key["what"], e)
        return value, False

    def _capture(self) -> None:
        max_bs = min(self.cfg.cuda_graph_max_bs, self.cfg.max_num_seqs)
        dev = self.device
        self.static_meta = torch.zeros(4, max_bs, dtype=torch.long, device=dev)
        self.static_meta[2] = 1
        self.static_bt = torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32, device=dev)
        pool = None
        buckets = graph_buckets(max_bs)
        tune_s = capture_s = 0.0
        cache = tuning_cache.TuningCache(tuning_cache.resolve_dir(self.cfg.tuning_cache_dir))
        env = tuning_cache.environment(dev) if cache.enabled else {}
        hits = 0
        for b in reversed(buckets):
            t0 = time.perf_counter()
            attn_key, gemms_key = self._tuning_keys(b, env)
            self.attn_cfg[b], hit = self._cached(cache, attn_key, lambda b=b: self._tune_attention(b),
                                                 tuning_cache.attention_to_json, tuning_cache.attention_from_json)
            hits += hit
            (self.gemms[b], self.gemms_us[b]), hit = self._cached(
                cache, gemms_key, lambda b=b: tune_decode_gemms(
                    self.model, b, self.cfg.decode_split_k, self.cfg.decode_fused_swiglu, self.decoder.final_norm,
                    self.decoder.swiglu, self.TUNE_LAYERS, split_k_candidates=self.cfg.split_k_candidates,
                    swiglu_candidates=self.cfg.swiglu_candidates),
                lambda v: tuning_cache.gemms_to_json(*v), tuning_cache.gemms_from_json)
            hits += hit
            args = (self.static_meta[:, :b], self.static_bt[:b], self.attn_cfg[b], self.gemms[b])
            t1 = time.perf_counter()
            tune_s += t1 - t0
            with torch.no_grad():
                side = torch.cuda.Stream(dev)
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):
                    self._decode_forward(*args)  # warm-up (allocator, triton autotune/compile)
                torch.cuda.current_stream(dev).wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    out = self._decode_forward(*args)
            pool = self._pool = g.pool()
            self.graphs[b] = (g, out)
            capture_s += time.perf_counter() - t1
        torch.cuda.synchronize(dev)
        self.startup_s.update(tuning=tune_s, capture=capture_s)
        results = 2 * len(buckets)
        if not cache.enabled:
            source = "timed; tuning cache off"
        elif hits == results:
            source = f"all {results} results from the tuning cache in {cache.directory}"
        else:
            source = f"timed, {hits} of {results} results from the tuning cache; saved to {cache.directory}"
        log.info("decode graphs: %d batch-size buckets, kernel tuning %.1fs (%s), compile + capture %.1fs",
                 len(buckets), tune_s, source, capture_s)
