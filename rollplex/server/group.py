"""The server over a torchrun process group: rank 0 serves HTTP, the other ranks follow its commands.

    python -m torch.distributed.run --standalone --nproc-per-node N -m rollplex.server [flags]

Every rank builds the same `ServerState` (same model, same configs); its `RLStep` runs data-parallel
over the default group (`group="auto"`: FSDP2-sharded trainer and reference, the full policy on every
rank). Rank 0 runs the HTTP front end; the other ranks run `follow`, which waits for rank 0's
commands on a gloo group of its own (`Commands`; `broadcast_object_list` of a tuple) and runs them:

    ("rollout", inputs, params)                                  `ServerState.sample`: every rank samples its
                                                                 share of the encoded prompts (dealt round-robin)
                                                                 and the outputs are gathered to every rank
    ("save", path, data_state) / ("load", path)                  `ServerState.save` / `load`: rank 0 writes the
                                                                 HF directories, every rank its trainer shards
                                                                 (rl/run_state.py); a load restores every rank
    ("train", entry, rewards, overrides, reward_s, off_policy)   `ServerState.train` on the same retained
                                                                 rollout: every rank enters the step's
                                                                 collectives together and ends with the
                                                                 same weights and weights_version
    ("checksum",)                                                `ServerState.checksums` (GET /checksum): every
                                                                 rank adds its shards' sums
    ("stop",)                                                    a barrier on every rank (none tears the
                                                                 groups down while another still reads),
                                                                 then the follower returns and exits 0

Rank 0 sends "train" from inside its own `ServerState.train`, after every check that can reject the
request (stale rollout, overrides, reference model), so a rejected request never reaches the
followers and they cannot diverge. Errors inside the step are the same on every rank (the same code on
the same batch; a non-finite loss or gradient norm is seen alike, from summed metrics and the global
norm), and the update's out-of-memory back-off is agreed collectively (`CollectiveOOM`, also for an
out-of-memory error inside an optimizer step: every rank then reports what was applied and bumps its
weights_version alike); an
out-of-memory error inside a data-parallel pass leaves the other ranks waiting in its collectives, so the
rank that hits one (rank 0 included) exits non-zero and torchrun ends the group.

A `/rollout` is data-parallel: rank 0 encodes the prompts, checks them against the engine's limits,
waits until its engine has no request in flight, sends "rollout", and every rank's engine samples its
share (sampling is seeded per prompt and sample, so the samples are those one process would draw; a
seedless request gets its seeds on rank 0 first). One group rollout runs at a time, and it is not
batched with other requests; a share that fails on one rank ends the group, as an in-pass OOM does.
Followers drive their engine from the command loop alone (their HTTP-side engine thread is closed).
`/generate` runs on rank 0's engine alone, continuously batched: its policy holds the full weights,
synced after every update.

A frozen vision tower trains nothing in the tower on every rank; rank 0 keeps no prefill encodings for
it (the other ranks never saw those prompts), so every rank runs the frozen tower when scoring and
training. With `--tensor-parallel N` (N dividing the group's size) the ranks form rollout engines of N
(`parallel.new_rollout_group`: the grouping whose shards the trainer shares most, consecutive blocks on
a tie): each rank's engine holds its tensor-parallel shard of the policy and decodes its engine's
prompts of a `/rollout` with the others (the weight sync rebuilds the shards after each update), and no
rank holds the policy whole;
`/generate` is then a 400, since its continuous batching steps rank 0's engine alone.

/save and /load run on every rank (rl/run_state.py: rank 0 writes the HF directories, every rank its
trainer shards); they need the checkpoint root on a filesystem every rank sees (one node, or a shared
one), and a checkpoint loads into a group of the size that wrote it. Refused under a group: the SGLang
rollout backend, a tensor-parallel degree that does not divide the group, the prefix-state path (startup errors,
`check_config`; cosched is refused by ServerConfig in any case).

The command channel waits without a deadline (a server may sit idle for days); a rank 0 that dies
closes its sockets, which ends the followers' wait with an error, and torchrun then ends the group.
"""

from __future__ import annotations

import logging
import signal
import threading
from datetime import timedelta

import torch.distributed as dist

from ..rl.errors import NonFiniteUpdate, TrainOOM, TrainStepFailed
from ..rl.placement import CollectiveOOM
from ..system import check_group
from .store import StaleRollout

log = logging.getLogger("rollplex.server")

# how long a follower waits for rank 0's next command: effectively forever (see the module docstring)
COMMAND_TIMEOUT = timedelta(days=3650)


def check_config(cfg, world: int) -> None:
    """ValueError for a ServerConfig the server cannot run over a process group of `world` ranks (before any
    rank starts building, so every rank fails the same way): rollplex.system.check_group."""
    check_group(cfg, world)


def collective_oom(e: TrainOOM) -> bool:
    """Whether every rank raised this TrainOOM together (the back-off ran out on all ranks), so the group
    is still in step; otherwise one rank ran out of memory inside a pass while the others wait."""
    return isinstance(e.__cause__, CollectiveOOM)


class Commands:
    """Rank 0's commands to the other ranks, over a gloo group created here (collectively: every rank
    constructs it at the same point)."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self._lock = threading.Lock()  # the engine thread sends "train", the main thread "stop"
        self._stopped = False

    def send(self, op: str, *args) -> None:
        """Rank 0: broadcast (op, *args) to every follower."""
        assert self.rank == 0 and op != "stop", "rank 0 sends commands; stop() ends them"
        with self._lock:
            if self._stopped:
                raise RuntimeError("the process group has been stopped")
            dist.broadcast_object_list([(op, *args)], src=0, group=self.group)

    def stop(self) -> None:
        """Rank 0: tell the followers to return (once; later calls do nothing) and wait until all have it."""
        assert self.rank == 0, "rank 0 stops the followers"
        with self._lock:
            if not self._stopped:
                dist.broadcast_object_list([("stop",)], src=0, group=self.group)
                self._stopped = True
                self.closing()

    def closing(self) -> None:
        """Every rank, after "stop": a barrier, so that no rank tears the groups down (`close`) while
        another still reads from them."""
        dist.barrier(group=self.group)

    @staticmethod
    def close() -> None:
        dist.destroy_process_group()

    def receive(self) -> tuple:
        """A follower: the next command (blocks until rank 0 sends one)."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def follow(state, commands: Commands) -> None:
    """A follower's loop: run rank 0's commands on this rank's ServerState until "stop"."""
    # Ctrl-C reaches every process of the terminal's group: rank 0 handles it and sends "stop"
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log.info("rank %d/%d following rank 0's commands", commands.rank, commands.world)
    # this thread drives the rank's engine (its share of each rollout): the HTTP-side engine loop, which would
    # step the same engine whenever it holds requests, never runs on a follower
    state.worker.close()
    while True:
        op, *args = commands.receive()
        if op == "stop":
            log.info("rank %d: stopped by rank 0", commands.rank)
            commands.closing()
            return
        if op == "rollout":  # this rank's share of the prompts; the outputs are gathered to every rank
            inputs, params = args
            state.sample(inputs, params, keep_vision=False)
            log.info("rank %d: sampled %d of the rollout's %d prompts", commands.rank,
                     len(state.rl.parallel.group_prompts(len(inputs))), len(inputs))
            continue
        if op == "checksum":  # the fingerprint from every rank's shards (optimizer state, TP policy shards)
            state.checksums()
            continue
        if op in ("save", "load"):  # failures are agreed by every rank (rl/run_state.py): logged, not fatal
            try:
                state.save(*args) if op == "save" else state.load(*args)
            except (ValueError, OSError) as e:
                log.warning("rank %d: %s failed as on rank 0: %s", commands.rank, op, e)
            continue
        if op != "train":
            raise RuntimeError(f"unknown command {op!r} from rank 0")
        entry, rewards, overrides, reward_s, off_policy = args
        try:
            state.train(entry, rewards, overrides, reward_s, off_policy=off_policy)
        except (ValueError, StaleRollout, NonFiniteUpdate) as e:  # raised on every rank alike: still in step
            log.warning("rank %d: train step rejected as on rank 0: %s", commands.rank, e)
        except TrainOOM as e:  # agreed by every rank (one rank's OOM inside a pass ends its process: state.py)
            log.warning("rank %d: train step out of memory on every rank: %s", commands.rank, e)
        except TrainStepFailed as e:  # agreed by every rank too (the trainers' optimizer step, rl/trainer.py)
            log.warning("rank %d: train step failed on every rank after part of it was applied: %s", commands.rank, e)
