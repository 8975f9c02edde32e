"""Session fixtures: one embedded tiny checkpoint (written by rollplex.tiny) and its processor; `tail`,
which holds a rollout until the fused schedule has trained its first groups."""

import time

import pytest

from rollplex.processor import VLProcessor
from rollplex.rl.pipeline import GroupPipeline
from rollplex.tiny import write_tiny


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny"), seed=1)


@pytest.fixture(scope="session")
def proc(tiny_dir):
    return VLProcessor.from_pretrained(tiny_dir)


@pytest.fixture
def tail(monkeypatch):
    """The decode loop waits, once two groups are done, until the worker has trained them: the
    rollout's tail made long enough that fused work runs beside it whatever the machine's speed."""
    add = GroupPipeline.add

    def slow_add(self, i, output):
        add(self, i, output)
        if len(self.order) == 2:  # both first groups trained (in chunks of one or two) before decode goes on
            t0 = time.monotonic()
            while (sum(len(r.prompts) for r in self.results) < 2 and self.error is None
                   and time.monotonic() - t0 < 60):
                time.sleep(0.005)

    monkeypatch.setattr(GroupPipeline, "add", slow_add)
