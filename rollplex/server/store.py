"""Retained rollouts: what a following /train_step needs, kept under a rollout id.

An entry holds the RolloutBatch (encoded prompts with their pixel tensors, responses, rollout
logprobs, per-sample data sources / ground truths / texts), the sampling temperature the trainer
must score at, the weights version it was sampled from, its max_new_tokens (overlong reward
shaping measures responses against it), and the rollout's timing. Entries expire
`ttl_s` after creation. Each belongs to the client that sampled it (its address): a client keeps at
most `cap` entries and `client_bytes` bytes, its own oldest evicted to fit a new one, and all clients
together at most `total_bytes`; a rollout that cannot fit without evicting another client's is
refused (StoreFull), never another client's evicted. `/train_step`
removes its entry only when the step succeeded, so a rejected request (e.g. the wrong number of
rewards, or a stale rollout without off_policy) leaves it trainable.
Thread-safe (a lock): handlers use it on the event loop, ledgers read it from the engine thread.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


class StoreFull(Exception):
    """A rollout that does not fit the retained-bytes caps (507): nothing was evicted."""


class StaleRollout(Exception):
    """A rollout sampled from weights that have changed since (a train step or a load)."""

    def __init__(self, sampled: int, current: int):
        self.sampled, self.current = sampled, current
        super().__init__(f"the rollout was sampled at weights_version {sampled} but the weights are now at "
                         f"version {current}: training it as on-policy would compute the PPO ratio against the "
                         "new weights. Sample a new rollout, or pass \"off_policy\": true to train it with its "
                         "sampling logprobs as the old logprobs (the rollout is still retained)")


@dataclass
class RetainedRollout:
    batch: object  # RolloutBatch
    temperature: float
    gen_s: float
    weights_version: int = 0  # the server's weights version the samples were drawn from
    max_new_tokens: int | None = None  # the rollout's (overlong reward shaping); None: the server's default
    created: float = 0.0
    expires: float = 0.0
    rollout_id: str = field(default_factory=lambda: f"ro-{uuid.uuid4().hex[:16]}")
    client: str = ""  # who sampled it (the peer address): its caps and evictions are that client's

    @property
    def nbytes(self) -> int:
        if self.batch is None:  # an entry without samples holds no tensors
            return 0
        return tensor_bytes([vars(p) if hasattr(p, "__dict__") else p for p in self.batch.prompts]) + tensor_bytes(
            [self.batch.group, self.batch.responses, self.batch.mask, self.batch.rollout_logprobs])


def tensor_bytes(obj, seen: set | None = None) -> int:
    """Bytes of the distinct tensor storages reachable through dicts / lists / tuples."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        key = (obj.device, obj.untyped_storage().data_ptr())
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    return 0


class RolloutStore:
    def __init__(self, ttl_s: float = 600.0, cap: int = 16, client_bytes: int = 8 << 30, total_bytes: int = 32 << 30,
                 clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0 or cap < 1 or client_bytes < 1 or total_bytes < 1:
            raise ValueError("rollout TTL must be > 0, and the caps (count, bytes) >= 1")
        self.ttl_s, self.cap, self.clock = ttl_s, cap, clock
        self.client_bytes, self.total_bytes = client_bytes, total_bytes
        self._items: OrderedDict[str, RetainedRollout] = OrderedDict()
        self._bytes: dict[str, int] = {}  # rollout id -> bytes, measured once when it was retained
        self._lock = threading.Lock()
        self.num_expired = 0
        self.num_evicted = 0

    def put(self, entry: RetainedRollout) -> list[str]:
        """Retain `entry`; returns the ids of its client's own rollouts evicted to fit it. StoreFull, with
        nothing evicted, when it cannot fit without evicting another client's."""
        size = entry.nbytes
        with self._lock:
            self._purge()
            own = [k for k, v in self._items.items() if v.client == entry.client]  # oldest first
            own_bytes = sum(self._bytes[k] for k in own)
            total = sum(self._bytes.values())
            k = 0  # evict the client's k oldest: the fewest that make room under every cap
            while k <= len(own) and not (len(own) - k < self.cap and own_bytes + size <= self.client_bytes
                                         and total + size <= self.total_bytes):
                if k < len(own):
                    own_bytes -= self._bytes[own[k]]
                    total -= self._bytes[own[k]]
                k += 1
            if k > len(own):
                why = (f"the limit of {self.client_bytes} bytes per client (--max-client-rollout-bytes)"
                       if size > self.client_bytes else
                       f"the {self.total_bytes} bytes every client's retained rollouts may hold (--max-retained-bytes; "
                       f"{total} of them are other clients')")
                raise StoreFull(f"this rollout ({size} bytes) cannot be retained for training: it is over {why}. "
                                "Train or let expire retained rollouts, or roll out fewer prompts at a time")
            evicted = own[:k]
            for rid in evicted:
                del self._items[rid], self._bytes[rid]
            entry.created = self.clock()
            entry.expires = entry.created + self.ttl_s
            self._items[entry.rollout_id] = entry
            self._bytes[entry.rollout_id] = size
            self.num_evicted += len(evicted)
            return evicted

    def get(self, rollout_id: str) -> RetainedRollout | None:
        with self._lock:
            self._purge()
            return self._items.get(rollout_id)

    def pop(self, rollout_id: str) -> RetainedRollout | None:
        with self._lock:
            self._bytes.pop(rollout_id, None)
            return self._items.pop(rollout_id, None)

    def clear(self) -> int:
        with self._lock:
            n = len(self._items)
            self._items.clear()
            self._bytes.clear()
            return n

    def purge(self) -> int:
        with self._lock:
            return self._purge()

    def _purge(self) -> int:
        now = self.clock()
        dead = [k for k, v in self._items.items() if v.expires <= now]
        for k in dead:
            del self._items[k], self._bytes[k]
        self.num_expired += len(dead)
        return len(dead)

    def ids(self) -> list[str]:
        """The retained rollouts' ids, oldest first."""
        with self._lock:
            self._purge()
            return list(self._items)

    def __len__(self) -> int:
        with self._lock:
            self._purge()
            return len(self._items)

    def nbytes(self) -> int:
        with self._lock:
            return sum(self._bytes.values())
