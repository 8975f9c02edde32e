"""The embedded demo and its fixtures: a tiny Qwen2.5-VL that learns a visual task on a laptop CPU.

    train.py        `python -m rollplex.demo`: format warm-up, then GRPO until the reward reaches a target
    progress.py     the CPU cost warning and the in-step progress (rollout tokens, update micro-batches)
    tiny.py         the tiny checkpoint (random weights, real tokenizer files): `python -m rollplex.tiny`
    tokenizer.py    its byte-level BPE tokenizer, chat template and preprocessor configs
    shape_color.py  the task: "What colour is the shape?" rows in verl's format

The fixtures are what the server starts from without `--model`, and what the tests run on. Nothing
is imported here, so using a fixture does not load the demo program.
"""
