"""Embedded tasks (synthetic datasets with their rewards)."""
