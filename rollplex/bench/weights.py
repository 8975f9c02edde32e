"""`python -m rollplex.bench weights`: the weight-sharing planner's tables (CPU only; see rollplex.weights)."""

from ..weights.__main__ import main

__all__ = ["main"]
