"""The embedded tiny Qwen2.5-VL / Qwen3-VL and its task: the fixtures the server, the demo, the benches and the tests
run on without downloading anything.

    checkpoint.py   the tiny checkpoint (random weights, real tokenizer files): `ensure_tiny()` writes it on
                    first use under ~/.cache/rollplex; `python -m rollplex.tiny OUT_DIR` writes one anywhere
    tokenizer.py    its byte-level BPE tokenizer, chat template and preprocessor configs
    shape_color.py  its task: "What colour is the shape?" rows in verl's format (the reward is
                    `rollplex.rl.rewards.shape_color`)

Only models and the tokenizer library lie below it; the demo program (`python -m rollplex.demo`) and the
server's default model and format warm-up sit above it.
"""

from .checkpoint import (
                         FAMILIES,
                         TINY_PIXELS,
                         ensure_tiny,
                         tiny_config,
                         tiny_path,
                         tiny_qwen3_config,
                         tiny_written,
                         write_tiny,
)

__all__ = ["FAMILIES", "TINY_PIXELS", "ensure_tiny", "tiny_config", "tiny_path", "tiny_qwen3_config", "tiny_written",
           "write_tiny"]
