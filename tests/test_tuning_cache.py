"""The decode-kernel tuning cache (kernels/tuning_cache.py): where it lives, what its key covers, that
results come back as stored, that bad files are ignored and tuned again, and that an off cache never
writes. The cache tests import no torch; the stored forms of the tuned results, the runner's use of
the cache and the server flag do. On a GPU: a second engine start reuses every result.
"""

from __future__ import annotations

import json
import logging

import pytest

from rollplex.kernels.tuning_cache import (
    TuningCache,
    attention_from_json,
    attention_to_json,
    key_digest,
    resolve_dir,
)

KEY = {"what": "attention", "format": 1, "gpu": "NVIDIA H200", "capability": [9, 0], "torch": "2.13.0",
       "cuda": "12.9", "triton": "3.5.0", "kernels": "0123abcd", "batch": 64, "dtype": "torch.bfloat16",
       "context": 768, "candidates": [[None, {}], [1, {"tile_n": 32}], [2, {"tma": True, "num_stages": 3}]]}
# one changed value per key part
CHANGES = {"gpu": "NVIDIA H100 80GB HBM3", "capability": [8, 0], "torch": "2.12.1", "cuda": "13.0",
           "triton": "3.4.0", "kernels": "fedcba98", "batch": 32, "dtype": "torch.float16", "context": 512,
           "format": 2, "candidates": [[None, {}], [1, {"tile_n": 64}], [2, {"tma": True, "num_stages": 3}]]}


def _files(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_resolve_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ROLLPLEX_CACHE_DIR", raising=False)
    assert resolve_dir("auto") == tmp_path / "home" / ".cache" / "rollplex" / "tuning"
    monkeypatch.setenv("ROLLPLEX_CACHE_DIR", str(tmp_path / "shared"))
    assert resolve_dir("auto") == tmp_path / "shared" / "tuning"
    assert resolve_dir(None) is None and resolve_dir("") is None
    assert resolve_dir(str(tmp_path / "mine")) == tmp_path / "mine"
    assert resolve_dir("~/t") == tmp_path / "home" / "t"


def test_every_key_part_changes_the_entry(tmp_path):
    cache = TuningCache(tmp_path)
    assert cache.put(KEY, [2, {"tile_n": 32}])
    paths = {cache.path(KEY)}
    for part, value in CHANGES.items():
        other = {**KEY, part: value}
        assert key_digest(other) != key_digest(KEY), part
        assert cache.get(other) is None, part  # never answered by another key's result
        paths.add(cache.path(other))
    assert len(paths) == 1 + len(CHANGES)
    assert cache.get(dict(reversed(KEY.items()))) == [2, {"tile_n": 32}]  # the order of the parts does not matter


def test_round_trip(tmp_path):
    cache = TuningCache(tmp_path / "a" / "b")  # created on the first write
    for i, cfg in enumerate(((2, {"tile_n": 32, "tma": True, "num_stages": 3}), (None, {}), (None, None))):
        key = {**KEY, "batch": i}
        assert cache.put(key, attention_to_json(cfg))
        assert attention_from_json(cache.get(key)) == cfg
        assert attention_from_json(TuningCache(tmp_path / "a" / "b").get(key)) == cfg  # a fresh start reads it
    assert all(name.startswith("attention-") and name.endswith(".json") for name in _files(tmp_path / "a" / "b"))
    with pytest.raises(ValueError):
        attention_from_json(["two", {}])


def test_corrupt_or_foreign_files_are_ignored_and_rewritten(tmp_path, caplog):
    cache = TuningCache(tmp_path)
    path = cache.path(KEY)
    bad = [b"{not json", b"", json.dumps({"key": {**KEY, "batch": 1}, "value": [1, {}]}).encode(),
           json.dumps([1, 2]).encode(), json.dumps({"key": KEY}).encode()]
    for content in bad:
        path.write_bytes(content)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rollplex.engine"):
            assert cache.get(KEY) is None
        assert "tuning again" in caplog.text, content
    assert cache.put(KEY, [4, {}]) and cache.get(KEY) == [4, {}]
    path.unlink()
    path.mkdir()  # unreadable as a file
    with caplog.at_level(logging.WARNING, logger="rollplex.engine"):
        assert cache.get(KEY) is None
        assert not cache.put(KEY, [4, {}])  # cannot replace a directory: a warning, not an error
    assert "could not write" in caplog.text
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind


def test_unwritable_directory_warns(tmp_path, caplog):
    (tmp_path / "file").write_text("x")
    cache = TuningCache(tmp_path / "file" / "tuning")
    with caplog.at_level(logging.WARNING, logger="rollplex.engine"):
        assert not cache.put(KEY, [1, {}])
    assert cache.get(KEY) is None and "could not write" in caplog.text


def test_an_off_cache_never_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ROLLPLEX_CACHE_DIR", str(tmp_path / "env"))
    for setting in (None, ""):
        cache = TuningCache(resolve_dir(setting))
        assert not cache.enabled
        assert cache.put(KEY, [1, {}]) is False and cache.get(KEY) is None
    assert _files(tmp_path) == []


def test_concurrent_writers_leave_one_whole_file(tmp_path):
    import threading

    cache = TuningCache(tmp_path)
    value = {"o_splits": 2, "times": {str(i): float(i) for i in range(2000)}}  # large enough to interleave
    threads = [threading.Thread(target=lambda: [cache.put(KEY, value) for _ in range(20)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.get(KEY) == value and len(list(tmp_path.iterdir())) == 1


# ---- with torch --------------------------------------------------------------------------------------
def test_gemms_round_trip():
    import functools

    from rollplex.kernels.decode_gemms import SkinnyGemms
    from rollplex.kernels.swiglu_gemm import swiglu_linear
    from rollplex.kernels.tuning_cache import gemms_from_json, gemms_to_json

    times = {"o": {1: 10.5, 2: 8.25}, "down": {1: 20.0, 4: 12.0}, "swiglu": {"None": 30.0, "(64, 64, 64, 4, 4)": 25.0}}
    for fused in (None, functools.partial(swiglu_linear, config=(64, 64, 64, 4, 4))):
        gemms = SkinnyGemms(2, 4, fused)
        stored = json.loads(json.dumps(gemms_to_json(gemms, times)))  # through the file's JSON
        back, back_times = gemms_from_json(stored)
        assert (back.o_splits, back.down_splits) == (2, 4) and back_times == times
        if fused is None:
            assert back.gate_up_swiglu is None
        else:
            assert back.gate_up_swiglu.func is swiglu_linear and back.gate_up_swiglu.keywords == fused.keywords
    with pytest.raises(ValueError):
        gemms_to_json(SkinnyGemms(1, 1, lambda h, w: h), {})  # only the known kernel can be stored
    with pytest.raises(ValueError):
        gemms_from_json({"o_splits": 1, "down_splits": 1, "swiglu_config": [3, 64, 64, 4, 4], "times": {}})


def test_runner_uses_the_cache(tmp_path, caplog):
    from rollplex.engine.model_runner import ModelRunner

    cache = TuningCache(tmp_path)
    calls = []

    def tune():
        calls.append(1)
        return (2, {"tile_n": 32})

    args = (attention_to_json, attention_from_json)
    assert ModelRunner._cached(cache, KEY, tune, *args) == ((2, {"tile_n": 32}), False)
    assert ModelRunner._cached(cache, KEY, tune, *args) == ((2, {"tile_n": 32}), True) and len(calls) == 1
    cache.put(KEY, ["two", {}])  # readable JSON, but not a launch config
    with caplog.at_level(logging.WARNING, logger="rollplex.engine"):
        assert ModelRunner._cached(cache, KEY, tune, *args) == ((2, {"tile_n": 32}), False)
    assert len(calls) == 2 and "tuning again" in caplog.text and cache.get(KEY) == [2, {"tile_n": 32}]
    off = TuningCache(None)
    assert ModelRunner._cached(off, KEY, tune, *args) == ((2, {"tile_n": 32}), False) and len(calls) == 3


def test_engine_config_and_server_flag():
    from rollplex.engine import EngineConfig
    from rollplex.server.__main__ import config_from_args, parser

    assert EngineConfig().tuning_cache_dir == "auto"
    with pytest.raises(ValueError):
        EngineConfig(tuning_cache_dir=5)
    ap = parser()
    assert "--tuning-cache-dir" in ap.format_help()
    assert config_from_args(ap.parse_args(["--device", "cpu", "--tuning-cache-dir", ""])).engine.tuning_cache_dir == ""
    assert config_from_args(ap.parse_args(["--device", "cpu"])).engine.tuning_cache_dir == "auto"


def test_second_start_reuses_every_tuned_result(tmp_path, caplog, monkeypatch):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("graph capture needs CUDA")
    from rollplex.engine import Engine, EngineConfig, SamplingParams
    from rollplex.engine import model_runner as runner_mod
    from rollplex.tiny import write_tiny

    tiny = write_tiny(tmp_path / "tiny", seed=0)
    cfg = EngineConfig(cuda_graph_max_bs=8, max_num_seqs=8, kv_cache_tokens=16384, tuning_cache_dir=str(tmp_path / "c"))
    with caplog.at_level(logging.INFO, logger="rollplex.engine"):
        first = Engine.from_pretrained(tiny, "cuda", torch.bfloat16, config=cfg)
    assert "saved to" in caplog.text and _files(tmp_path / "c")
    picks = (dict(first.runner.attn_cfg), dict(first.runner.gemms))
    del first

    def no_timing(*a, **k):
        raise AssertionError("tuned again although the cache holds the result")

    monkeypatch.setattr(runner_mod, "tune_decode_gemms", no_timing)
    monkeypatch.setattr(runner_mod, "tune_decode", no_timing)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rollplex.engine"):
        second = Engine.from_pretrained(tiny, "cuda", torch.bfloat16, config=cfg)
    assert "results from the tuning cache in" in caplog.text and "timed" not in caplog.text
    assert second.runner.attn_cfg == picks[0]
    assert {b: (g.o_splits, g.down_splits, g.gate_up_swiglu is None) for b, g in second.runner.gemms.items()} == \
        {b: (g.o_splits, g.down_splits, g.gate_up_swiglu is None) for b, g in picks[1].items()}
    out = second.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, temperature=0))
    assert len(out[0].samples[0].token_ids) == 4  # the graphs captured with the cached picks decode
