"""Paged KV blocks: a free list and reference counts (no torch).

Block 0 is reserved as a scratch block: padded rows of a CUDA-graph batch write their K/V there and
block tables are padded with it. A fork shares every *full* block of the parent (refcount + 1) and
gives the child its own copy of the partially filled last block; the copy is returned as a
(src, dst) pair for the runner to execute after the parent's prefill has written it.

Speculative decoding writes the K/V of draft tokens past a sequence's length: `reserve` gives it the
blocks for them (all or nothing) and `trim` hands back the blocks past the tokens it kept; rejected
tokens left inside a kept block lie past the sequence's length, where attention never reads and the
next token overwrites them.
"""

from __future__ import annotations

from .sequence import Sequence

SCRATCH_BLOCK = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (one is scratch)")
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = [0] * num_blocks
        self.free_blocks = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self) -> int:
        b = self.free_blocks.pop()
        assert self.ref[b] == 0
        self.ref[b] = 1
        return b

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Give `seq` blocks for its first `num_tokens` tokens."""
        assert not seq.block_table
        need = self.blocks_for(num_tokens)
        if need > self.num_free:
            raise RuntimeError("allocate() without enough free blocks; check can_allocate first")
        seq.block_table = [self._take() for _ in range(need)]

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> tuple[int, int] | None:
        """Share parent's blocks covering `num_tokens`; copy-on-fork of a partial last block."""
        assert not child.block_table
        table = parent.block_table[: self.blocks_for(num_tokens)]
        partial = num_tokens % self.block_size != 0
        shared = table[:-1] if partial else table
        for b in shared:
            self.ref[b] += 1
        child.block_table = list(shared)
        if partial:
            dst = self._take()
            child.block_table.append(dst)
            return table[-1], dst
        return None

    def fork_cost(self, num_tokens: int) -> int:
        """Blocks a fork of a `num_tokens` prompt allocates."""
        return 1 if num_tokens % self.block_size else 0

    def needs_block(self, seq: Sequence) -> bool:
        """Whether writing the KV of seq's last token needs a new block."""
        return len(seq.block_table) * self.block_size < len(seq)

    def append_slot(self, seq: Sequence) -> None:
        if self.needs_block(seq):
            seq.block_table.append(self._take())
        assert len(seq.block_table) * self.block_size >= len(seq)

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for seq's first `num_tokens` tokens; False (nothing taken) if too few are free."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need > self.num_free:
            return False
        for _ in range(need):
            seq.block_table.append(self._take())
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free seq's blocks past those its first `num_tokens` tokens need (blocks it owns alone: a
        sequence only ever appends to blocks of its own)."""
        keep = self.blocks_for(num_tokens)
        for b in seq.block_table[keep:]:
            assert self.ref[b] == 1, "a trimmed block is shared"
            self.ref[b] = 0
            self.free_blocks.append(b)
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        for b in seq.block_table:
            self.ref[b] -= 1
            assert self.ref[b] >= 0
            if self.ref[b] == 0:
                self.free_blocks.append(b)
        seq.block_table = []

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
