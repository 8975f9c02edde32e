"""The memory manager on torch-memory-saver (CUDA; skipped without it): memory really returns on pause,
contents survive an offload, CUDA graphs that captured a region replay correctly after resume, and misuse
is an exception rather than a process exit."""

import subprocess
import sys
import textwrap

import pytest
import torch

from rollplex.memory import MemoryManager, MemoryRegionError, PhasePlan

pytestmark = pytest.mark.gpu
GiB = 2**30


@pytest.fixture(scope="module")
def mm():
    pytest.importorskip("torch_memory_saver")
    return MemoryManager(PhasePlan.releases_only(), device="cuda", backend="tms")


def _free():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_pause_returns_memory_and_offload_keeps_contents(mm):
    assert mm.backend.name == "torch-memory-saver"
    with mm.region("optimizer"):
        x = torch.randn(GiB // 4, device="cuda")  # 1 GiB
    x0 = x.clone()
    mm.preserve("optimizer", lambda: [x])
    ptr = x.data_ptr()
    free0 = _free()
    mm.pause("optimizer", offload=True)
    assert _free() - free0 > 0.9 * GiB
    mm.resume("optimizer")
    assert _free() - free0 < 0.1 * GiB
    assert x.data_ptr() == ptr and torch.equal(x, x0)
    # released (no copy): memory returns, and the region is usable again after resume
    free0 = _free()
    mm.pause("optimizer")
    assert _free() - free0 > 0.9 * GiB
    mm.resume("optimizer")
    x.fill_(3.0)
    assert float(x[-1]) == 3.0
    m = mm.ledger.take_metrics()
    assert m["memory/pause_s/optimizer"] > 0 and m["memory/offload_copy_gib"] >= 2 * 0.99
    assert m["memory/host_alloc_gib"] == pytest.approx(1.0) and m["memory/host_alloc_s"] > 0  # one pinned copy


def test_graph_replays_after_resume(mm):
    with mm.region("ref_weights"):
        w = torch.randn(1024, 1024, device="cuda")
    with mm.region("kv_cache"):
        x = torch.randn(64, 1024, device="cuda")
    mm.preserve("ref_weights", lambda: [w])
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = x @ w
        with torch.cuda.graph(g, stream=s):
            y = x @ w
    torch.cuda.current_stream().wait_stream(s)
    mm.pause("ref_weights", offload=True)
    mm.pause("kv_cache")
    mm.resume("kv_cache")
    mm.resume("ref_weights")
    x.copy_(torch.randn(64, 1024, device="cuda"))  # released contents are undefined: write them again
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x @ w)


def test_misuse_raises(mm):
    with mm.region("prefix_states"):
        t = torch.empty(GiB // 2, dtype=torch.uint8, device="cuda")
    mm.pause("prefix_states")
    with pytest.raises(MemoryRegionError):
        mm.pause("prefix_states")
    with pytest.raises(MemoryRegionError):
        with mm.region("prefix_states"):
            torch.empty(1, device="cuda")
    # take all but a sliver of the free memory, then ask for the region back
    hog = torch.empty(_free() - (64 << 20), dtype=torch.uint8, device="cuda")
    with pytest.raises(MemoryRegionError, match="cannot resume"):
        mm.resume("prefix_states")
    del hog
    torch.cuda.empty_cache()
    mm.resume("prefix_states")
    t.fill_(1)
    with pytest.raises(MemoryRegionError):
        mm.resume("prefix_states")


def test_process_with_regions_exits_cleanly(mm):
    """A process that used regions (one live, one paused, one freed) ends with status 0: the pools'
    blocks freed at interpreter exit must not be taken for misuse."""
    code = textwrap.dedent("""
        import torch
        from rollplex.memory import MemoryManager, PhasePlan
        mm = MemoryManager(PhasePlan.releases_only(), device="cuda", backend="tms")
        with mm.region("optimizer"):
            kept = torch.ones(1 << 20, device="cuda")
        with mm.region("kv_cache"):
            paused = torch.ones(1 << 20, device="cuda")
        with mm.region("prefix_states"):
            freed = torch.ones(1 << 20, device="cuda")
        del freed
        mm.pause("kv_cache")
        torch.cuda.synchronize()
        print("done", float(kept.sum()))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "done 1048576.0" in r.stdout, r.stderr[-2000:]
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
