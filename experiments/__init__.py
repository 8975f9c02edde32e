"""Measurements kept beside the product, not part of it: the engine's model and rollout against transformers
(`engine/`) and kernel experiments whose results are recorded in docs/BENCHMARKS.md, most of them under "Tried
and dropped" (`kernels/`), and host-memory measurements (`memory/`). Each module runs as `python -m
experiments.<dir>.<name>` and imports rollplex; nothing in rollplex imports them. The correctness checks they
start with are tests (tests/gpu/test_engine_gpu.py, tests/test_model_parity.py)."""
