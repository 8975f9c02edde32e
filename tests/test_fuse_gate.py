"""The fused schedule's admission gate (rl/fuse_gate.py) on step times written out here, and the fused
step with a gate that holds every bucket: nothing is trained beside decode and the update is unchanged."""

from types import SimpleNamespace

import pytest

from rollplex.rl.config import RLConfig
from rollplex.rl.fuse_gate import FuseGate, _Bucket, bucket_of, parse_sms_by_batch


def _simulate(gate: FuseGate, steps: list[tuple[int, float, bool]], tokens: int = 300) -> None:
    """Launch decode steps (batch, ms until the next launch, beside a chunk?), then end the rollout."""
    active, now = False, 0.0
    for k, (batch, ms, busy) in enumerate(steps):
        if busy and not active:
            gate.start(tokens)
        elif active and not busy:
            gate.end()
        active = busy
        gate.on_decode_step(SimpleNamespace(step=k, batch_size=batch), now)
        now += ms / 1e3
    gate.end()
    gate.finish(now)


def _step_with_chunk(gate: FuseGate, batch: int, clean_ms: float, loaded_ms: float, tokens: int) -> None:
    gate.begin()
    _simulate(gate, [(batch, clean_ms, False)] * 6 + [(batch, loaded_ms, True)] * 4 + [(batch, clean_ms, False)] * 3,
              tokens)
    gate.settle()


def test_added_decode_time_is_charged_to_the_chunk_in_flight_at_launch():
    gate = FuseGate("pays")
    gate.alone(tokens=100, seconds=0.010)  # 0.1 ms per token alone
    # 4 steps launched beside the chunk, each 10 ms over the 5 ms baseline
    _step_with_chunk(gate, batch=64, clean_ms=5.0, loaded_ms=15.0, tokens=300)
    st = gate.buckets[64]
    assert st.added == pytest.approx(40.0) and st.saved == pytest.approx(30.0)
    assert gate.held() == [64]
    m = gate.metrics()
    assert m["rollplex/fused_decode_added_s"] == pytest.approx(0.040)
    assert m["rollplex/fused_saved_s"] == pytest.approx(0.030)
    assert m["rollplex/fused_held_buckets"] == 1.0


def test_pays_holds_only_the_buckets_where_fusing_cost_more_than_it_saved():
    gate = FuseGate("pays", reprobe_steps=3)
    gate.alone(100, 0.010)
    _step_with_chunk(gate, batch=64, clean_ms=5.0, loaded_ms=15.0, tokens=300)  # 40 ms added, 30 saved
    _step_with_chunk(gate, batch=4, clean_ms=2.0, loaded_ms=3.0, tokens=300)  # 4 added, 30 saved
    gate.begin()
    gate.batch = 64
    assert not gate.admit()
    gate.batch = 4
    assert gate.admit()
    gate.batch = 1  # never measured: admitted
    assert gate.admit()
    assert FuseGate("always", buckets={64: _Bucket(40.0, 30.0)}).admit()


def test_a_held_bucket_is_measured_again_after_reprobe_steps():
    gate = FuseGate("pays", reprobe_steps=2)
    gate.alone(100, 0.010)
    _step_with_chunk(gate, batch=64, clean_ms=5.0, loaded_ms=15.0, tokens=300)
    for _ in range(2):  # two steps held: nothing started in the bucket
        gate.begin()
        gate.batch = 64
        assert not gate.admit()
        gate.settle()
    gate.begin()
    gate.batch = 64
    assert gate.admit()  # one probe this step
    gate.start(3000)
    gate.end()
    assert not gate.admit()
    gate.settle()  # no decode time was added: the EMA moves toward paying
    assert gate.buckets[64].added == pytest.approx(20.0) and gate.buckets[64].saved == pytest.approx(165.0)
    assert gate.held() == []


def test_without_a_standalone_rate_nothing_is_judged():
    gate = FuseGate("pays")
    _step_with_chunk(gate, batch=64, clean_ms=5.0, loaded_ms=50.0, tokens=300)
    gate.batch = 64
    assert gate.buckets == {} and gate.admit()


def test_a_bucket_without_clean_steps_borrows_the_nearest_baseline():
    gate = FuseGate("pays")
    gate.begin()
    # batch 8 never ran clean: the 64 bucket's 5 ms stands in for its baseline
    _simulate(gate, [(64, 5.0, False)] * 4 + [(8, 9.0, True)] * 4)
    # the chunk starts during the fourth period (charged: 5 - 5 = 0); the last period closes when the rollout ends
    assert gate.added_ms == pytest.approx(4 * 4.0) and gate.clean_ms == pytest.approx(3 * 5.0)
    assert gate.metrics()["rollplex/fused_decode_slowdown"] == pytest.approx(16 / 15)
    assert bucket_of(8) == 8 and bucket_of(300) == 256 and bucket_of(3) == 4


def test_partition_by_decode_batch():
    gate = FuseGate(sms_by_batch=parse_sms_by_batch(("16:100", "64:66")), default_sms=0)
    assert [gate.sms(b) for b in (256, 64, 63, 16, 15, 1)] == [66, 66, 100, 100, 0, 0]
    for bad in (("64",), ("a:1",), ("0:66",), ("64:-1",), ("64:66", "64:100")):
        with pytest.raises(ValueError, match="fuse_sms_by_batch"):
            parse_sms_by_batch(bad)
    with pytest.raises(ValueError, match="fuse_sms_by_batch"):
        RLConfig(fuse_sms_by_batch=("64",))
    with pytest.raises(ValueError, match="fuse_admission"):
        RLConfig(fuse_admission="sometimes")


def test_a_chunk_started_after_the_last_launch_is_charged_the_rollouts_end():
    """The chunk starts during the last decode period (the first groups finished one step before the
    rest): the device, busy with it, delays the last step, and the end of the rollout shows it."""
    gate = FuseGate("pays")
    gate.begin()
    for k in range(4):
        gate.on_decode_step(SimpleNamespace(step=k, batch_size=128), k * 0.005)
    gate.start(300)  # during the period launched at 15 ms
    gate.finish(0.015 + 0.400)
    assert gate.added_ms == pytest.approx(395.0) and gate.clean_ms == pytest.approx(15.0)


def test_the_forward_and_the_launch_are_measured_beside_the_period():
    """Steps beside a chunk: the period grows 10 ms over its clean 5 ms, the forward's GPU time 2 ms over
    its clean 3 ms, the host's launch 3 ms over its clean 1 ms. Forward times arrive two launches late
    (overlap scheduling) and are charged by the step they belong to, the last two never (the rollout
    ended); a launch's time arrives with the next launch."""
    gate = FuseGate("always")
    busy = [False] * 4 + [True] * 4 + [False] * 3
    period = [15.0 if b else 5.0 for b in busy]
    forward = [5.0 if b else 3.0 for b in busy]
    launch = [4.0 if b else 1.0 for b in busy]
    now, active = 0.0, False
    for k, b in enumerate(busy):
        if b and not active:
            gate.start(300)
        elif active and not b:
            gate.end()
        active = b
        info = SimpleNamespace(step=k, batch_size=8, last_forward=(k - 2, forward[k - 2]) if k >= 2 else None,
                               last_launch_ms=launch[k - 1] if k >= 1 else None)
        gate.on_decode_step(info, now)
        now += period[k] / 1e3
    gate.finish(now)
    m = gate.metrics()
    assert m["rollplex/fused_decode_added_s"] == pytest.approx(0.040)
    assert m["rollplex/fused_decode_forward_added_s"] == pytest.approx(0.008)
    assert m["rollplex/fused_decode_launch_added_s"] == pytest.approx(0.012)
    # a forward time for a step the gate never closed, or reported twice, is not counted
    gate.on_decode_step(SimpleNamespace(step=99, batch_size=8, last_forward=(7, 50.0)), now)
    gate.on_decode_step(SimpleNamespace(step=100, batch_size=8, last_forward=(42, 50.0)), now)
    assert gate.metrics()["rollplex/fused_decode_forward_added_s"] == pytest.approx(0.008)


def test_steps_whose_forward_never_comes_are_not_kept():
    """On the CPU no forward time is reported: the steps waiting for one stay a handful, however long the rollout."""
    gate = FuseGate("always")
    for k in range(1000):
        gate.on_decode_step(SimpleNamespace(step=k, batch_size=8), k * 0.005)
    assert len(gate._closed) <= 8
