"""Parallelism-aware weight sharing between the training layout and the rollout layout."""
