"""Reference generation: one prompt, greedy or sampled, through the model's incremental path.

No batching, no scheduler, no CUDA graphs — the plainest correct decoder, used by the demo command
and as the oracle the engine is tested against. The prompt's K/V come from `model.prefix`; each new
token attends to them plus the tokens generated so far (a growing per-layer cache held here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .models import Qwen25VL
from .models.attention import sdpa


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]  # log p(token) under the (unmodified) model distribution
    finish_reason: str  # "stop" or "length"


@torch.no_grad()
def generate(
    model: Qwen25VL,
    prompt,
    max_new_tokens: int = 16,
    temperature: float = 0.0,
    stop_token_ids: tuple[int, ...] = (),
    generator: torch.Generator | None = None,
) -> Generation:
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    prefix = model.prefix([prompt])
    keys = [k for k in prefix.keys]
    values = [v for v in prefix.values]
    hidden = prefix.last_hidden[:, None]  # [1, 1, C]
    pos = int(prefix.lens[0] + prefix.rope_delta[0])
    out, lps, reason = [], [], "length"
    for _ in range(max_new_tokens):
        logp = torch.log_softmax(model.logits(hidden[:, -1]).float(), -1)[0]
        if temperature > 0:
            probs = torch.softmax(logp / temperature, -1)
            tok = int(torch.multinomial(probs.cpu(), 1, generator=generator))
        else:
            tok = int(logp.argmax())
        out.append(tok)
        lps.append(float(logp[tok]))
        if tok in stop_token_ids:
            reason = "stop"
            break
        if len(out) == max_new_tokens:
            break
        ids = torch.tensor([[tok]], device=prefix.lens.device)
        positions = torch.full((3, 1, 1), pos, device=ids.device)
        pos += 1

        def attend(layer, q, k, v):
            keys[layer] = torch.cat([keys[layer], k], dim=2)
            values[layer] = torch.cat([values[layer], v], dim=2)
            return sdpa(q, keys[layer], values[layer])

        hidden = model.forward_embeds(model.model.embed_tokens(ids), positions, attend)
    return Generation(out, lps, reason)
