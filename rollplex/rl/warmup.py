"""Answer-format warm-up: a few supervised steps that teach a policy the shape of an answer before RL.

A random-init (or small) model rarely emits a parseable answer, so every reward is 0 and GRPO has
no signal. For multiple-choice rows this maximises p(any option) for the first response token and
p(EOS) after it — no option is preferred, so the model learns to answer with an option and stop,
not which one: it stays at chance and must learn the rest from the reward.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch
from tqdm import tqdm

from ..data import row_to_inputs
from .batch import RolloutBatch


def format_warmup(model, processor, rows: list[dict], options: Sequence[str], steps: int, lr: float,
                  seed: int = 0, progress: bool = True) -> float:
    """`steps` AdamW steps on batches of 16 rows with responses [random option, EOS]; `options` are
    the answer strings (their first token counts). Returns the last step's loss."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    letters = [processor.tokenizer.encode(x, add_special_tokens=False)[0] for x in options]
    loss = torch.tensor(0.0)
    bar = tqdm(range(steps), desc="format warm-up", unit="step", disable=not progress)
    for _ in bar:
        batch_rows = rng.sample(rows, min(16, len(rows)))
        prompts = [row_to_inputs(processor, r) for r in batch_rows]
        responses = [[rng.choice(letters), processor.eos_token_id] for _ in prompts]
        batch = RolloutBatch.from_samples(prompts, list(range(len(prompts))), responses, pad_id=0)
        hidden = model.response_hidden(model.prefix(batch.prompts), batch.responses, batch.group)  # [n, 2, C]
        logp = torch.log_softmax(model.logits(hidden).float(), -1)
        any_letter = torch.logsumexp(logp[:, 0, letters], -1)  # log p(first token is some option)
        stop = logp[:, 1, processor.eos_token_id]  # log p(EOS | an option)
        loss = -(any_letter + stop).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    opt.zero_grad(set_to_none=True)  # no gradient buffers left behind for the trainer that comes next
    return loss.item()
