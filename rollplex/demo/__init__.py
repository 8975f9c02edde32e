"""The embedded demo: a tiny Qwen2.5-VL that learns a visual task on a laptop CPU.

    train.py        `python -m rollplex.demo`: format warm-up, then GRPO until the reward reaches a target
    progress.py     the CPU cost warning and the in-step progress (rollout tokens, update micro-batches)

Its fixtures (the tiny checkpoint, its tokenizer, the shape-colour task) live in `rollplex.tiny`, below
the server and the benches that use them too. Nothing is imported here, so importing the package does
not load the demo program.
"""
