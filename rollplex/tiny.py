"""`python -m rollplex.tiny OUT_DIR [--seed N]`: write the embedded tiny checkpoint (rollplex/demo/tiny.py).

This module path is a documented command; the checkpoint code lives with the demo's other fixtures.
"""

from .demo.tiny import TINY_PIXELS, ensure_tiny, main, tiny_config, write_tiny

__all__ = ["TINY_PIXELS", "ensure_tiny", "main", "tiny_config", "write_tiny"]

if __name__ == "__main__":
    main()
