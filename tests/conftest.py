"""Session fixtures: one embedded tiny checkpoint (written by rollplex.tiny) and its processor; `sglang_source`
(sglang_sources.py), each checked SGLang release's source; `tail`,
which holds a rollout until the fused schedule has trained its first groups. Tests that spawn gloo ranks
run once more when a rank dies of SIGABRT (below)."""

import inspect
import os
import time

import pytest
import torch
from sglang_sources import sglang_source  # noqa: F401  (a checked SGLang release's source)

from rollplex.processor import VLProcessor
from rollplex.rl.pipeline import GroupPipeline
from rollplex.tiny import write_tiny

# test processes side by side (pytest -n N) share the cores: each takes its share of torch's threads
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny"), seed=1)


@pytest.fixture(scope="session")
def proc(tiny_dir):
    return VLProcessor.from_pretrained(tiny_dir)


@pytest.fixture
def heavy_encode(monkeypatch):
    """The real encode, 0.25 s longer for prompts containing HEAVY (text, or chat messages as /rollout sends
    them: a costly image stands in); the start times of those encodes."""
    encode, started = VLProcessor.encode, []

    def slow(self, text=None, **kw):
        if "HEAVY" in str(text) + str(kw.get("messages")):
            started.append(time.perf_counter())
            time.sleep(0.25)
        return encode(self, text=text, **kw)

    monkeypatch.setattr(VLProcessor, "encode", slow)
    return started


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


# A gloo rank on an oversubscribed 2-core machine now and then dies of SIGABRT in gloo's C++ ("terminate
# called without an active exception"), never in a check of ours: such a test runs once more, and only
# for that death (pytest-rerunfailures; a failed assertion in a rank is a ProcessRaisedException).
GLOO_ABORT = r"terminated with signal SIGABRT"


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("rerunfailures"):
        return
    spawns: dict[str, bool] = {}
    for item in items:
        mod = getattr(item, "module", None)
        if mod is None:
            continue
        if mod.__name__ not in spawns:
            spawns[mod.__name__] = "spawn(" in inspect.getsource(mod)
        if spawns[mod.__name__]:
            item.add_marker(pytest.mark.flaky(reruns=1, only_rerun=[GLOO_ABORT]))

