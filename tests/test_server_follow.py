"""A follower rank's command loop (server/group.py `follow`): a train step that fails alike on every rank
(rejected, out of memory at the smallest micro-batch, failed after part of it was applied, a non-finite
update) is logged and the follower takes rank 0's next command; any other error ends the follower."""

import logging
import signal

import pytest

from rollplex.rl.errors import NonFiniteUpdate, TrainOOM, TrainStepFailed
from rollplex.server.group import follow
from rollplex.server.store import StaleRollout


class Script:
    """Rank 0's commands as a follower receives them, in order."""

    rank, world = 1, 2

    def __init__(self, ops):
        self.ops, self.closed = list(ops), False

    def receive(self) -> tuple:
        return self.ops.pop(0)

    def closing(self) -> None:
        self.closed = True


class Follower:
    """A follower's state whose train steps raise `errors` in turn (None: the step runs)."""

    class Worker:
        def close(self) -> None:
            pass

    def __init__(self, errors):
        self.errors, self.trained, self.worker = list(errors), 0, self.Worker()

    def train(self, entry, rewards, overrides, reward_s, off_policy=False):
        self.trained += 1
        error = self.errors.pop(0)
        if error is not None:
            raise error


TRAIN = ("train", None, None, {}, 0.0, False)


@pytest.fixture(autouse=True)
def keep_sigint():
    handler = signal.getsignal(signal.SIGINT)  # follow() leaves Ctrl-C to rank 0
    yield
    signal.signal(signal.SIGINT, handler)


@pytest.mark.parametrize("error", [
    TrainOOM("out of memory at the smallest micro-batch on every rank", 0),
    TrainStepFailed("the critic's update failed after the actor's was applied", 1),
    NonFiniteUpdate("non-finite gradient norm", 0),
    ValueError("bad overrides"),
    StaleRollout(0, 1),
], ids=lambda e: type(e).__name__)
def test_follower_stays_in_step_after_a_failure_every_rank_shares(error, caplog):
    commands, state = Script([TRAIN, TRAIN, ("stop",)]), Follower([error, None])
    with caplog.at_level(logging.WARNING, logger="rollplex.server"):
        follow(state, commands)
    assert state.trained == 2 and commands.closed and not commands.ops  # the next step ran, then "stop"
    assert [r.levelno for r in caplog.records if "rank 1" in r.getMessage()] == [logging.WARNING]


def test_follower_ends_on_another_error():
    commands, state = Script([TRAIN, TRAIN, ("stop",)]), Follower([RuntimeError("a rank's own failure"), None])
    with pytest.raises(RuntimeError, match="own failure"):
        follow(state, commands)
    assert state.trained == 1 and not commands.closed
