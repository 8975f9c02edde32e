"""Retained rollouts: what a following /train_step needs, kept under a rollout id.

An entry holds the RolloutBatch (encoded prompts with their pixel tensors, responses, rollout
logprobs, per-sample data sources / ground truths / texts), the sampling temperature the trainer
must score at, the weights version it was sampled from, its max_new_tokens (overlong reward
shaping measures responses against it), and the rollout's timing. Entries expire
`ttl_s` after creation and at most `cap` are kept (the oldest is evicted first). `/train_step`
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

    @property
    def nbytes(self) -> int:
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
    def __init__(self, ttl_s: float = 600.0, cap: int = 16, clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0 or cap < 1:
            raise ValueError("rollout TTL must be > 0 and the cap >= 1")
        self.ttl_s, self.cap, self.clock = ttl_s, cap, clock
        self._items: OrderedDict[str, RetainedRollout] = OrderedDict()
        self._lock = threading.Lock()
        self.num_expired = 0
        self.num_evicted = 0

    def put(self, entry: RetainedRollout) -> list[str]:
        """Retain `entry`; returns the ids evicted to respect the cap."""
        with self._lock:
            self._purge()
            entry.created = self.clock()
            entry.expires = entry.created + self.ttl_s
            self._items[entry.rollout_id] = entry
            evicted = []
            while len(self._items) > self.cap:
                rid, _ = self._items.popitem(last=False)
                evicted.append(rid)
            self.num_evicted += len(evicted)
            return evicted

    def get(self, rollout_id: str) -> RetainedRollout | None:
        with self._lock:
            self._purge()
            return self._items.get(rollout_id)

    def pop(self, rollout_id: str) -> RetainedRollout | None:
        with self._lock:
            return self._items.pop(rollout_id, None)

    def clear(self) -> int:
        with self._lock:
            n = len(self._items)
            self._items.clear()
            return n

    def purge(self) -> int:
        with self._lock:
            return self._purge()

    def _purge(self) -> int:
        now = self.clock()
        dead = [k for k, v in self._items.items() if v.expires <= now]
        for k in dead:
            del self._items[k]
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
            return sum(e.nbytes for e in self._items.values())
