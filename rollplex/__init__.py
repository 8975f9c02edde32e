"""Rollplex: rollout, reference scoring and actor training of Qwen2.5-VL sharing the same GPUs at once."""

__version__ = "0.1.0"
