"""A rollout's requests as one batch request per prompt, each answer yielded as soon as it arrives.

    iter_groups(engine, kw, starts)   kw: Engine.generate's keyword arguments for every sample of every
                                      prompt (lists, prompt-major); starts: the cumulative sample counts,
                                      prompt i's rows are starts[i]:starts[i + 1]. Yields (i, answers) in
                                      finishing order (ties: prompt order).

Every batch request goes to SGLang at once through `Engine.async_generate` on the Engine's own event loop
(`Engine.loop`, where `Engine.generate` runs its requests), so SGLang's scheduler batches every sample as
in one `generate` call; a batch request answers when its last sample finishes. Between two answers the
generator is suspended and the loop stops; SGLang's scheduler process keeps decoding and its results wait
in the tokenizer manager's socket. Closing the generator early cancels the requests still running.

Used by the rollout backend with an in-process engine, and by the engine process (engine_process.py),
which streams the answers to the trainer's process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence


def split(kw: dict, starts: Sequence[int], i: int) -> dict:
    """Prompt i's share of `kw`: rows starts[i]:starts[i + 1] of every list argument."""
    return {k: (v[starts[i]:starts[i + 1]] if isinstance(v, list) else v) for k, v in kw.items()}


def iter_groups(engine, kw: dict, starts: Sequence[int]) -> Iterator[tuple[int, list]]:
    loop = engine.loop

    async def group(i: int):
        return i, await engine.async_generate(**split(kw, starts, i))

    pending = {loop.create_task(group(i)) for i in range(len(starts) - 1)}
    try:
        while pending:
            done, pending = loop.run_until_complete(asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED))
            for task in sorted(done, key=lambda t: t.result()[0]):
                yield task.result()
    finally:
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
