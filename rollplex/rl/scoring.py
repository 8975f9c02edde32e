"""Per-token logprobs of sampled responses under a model, in either mode.

    rollplex: each prompt (vision tower + prompt tokens) once, its n responses attending to it:
              all prompts and responses of the micro-batch packed into one sequence (packed=True,
              `group_hidden`, the default), or a prefix pass then the padded responses over its
              PrefixState
    serial:   every sample is a full sequence prompt + response (its images re-encoded per sample,
              as verl repeats multimodal inputs n times) -> hidden rows of the response

Both give, for each response token t, log softmax(logits / temperature)[t] — the distribution the
engine sampled from — and, on request, the entropy of that distribution. The micro-batch planners
decide what one forward holds: a few prompts with all their samples (rollplex) or a few sequences
(serial), by count or by a token budget.
"""

from __future__ import annotations

import torch

from ..models import Qwen25VL
from ..models.transfer import to_device
from .algos import entropy_from_logits
from .batch import RolloutBatch
from .logprob import token_logprob


def response_hidden(model: Qwen25VL, mb: RolloutBatch, mode: str, packed: bool = False) -> torch.Tensor:
    """Hidden states predicting each response token, [n, R, C]."""
    dev = model.inv_freq.device
    R = mb.responses.shape[1]
    lens = mb.response_lengths()  # the mask keeps a prefix of each response: tokens up to EOS
    if mode == "rollplex" and packed:  # prompts and responses packed into one pass; each prompt computed once
        return model.group_hidden(mb.prompts, mb.responses, lens, mb.group.tolist())
    if mode == "rollplex":  # a prefix pass, then the padded responses over its PrefixState
        return model.response_hidden(model.prefix(mb.prompts), to_device(mb.responses, dev), to_device(mb.group, dev))
    groups = mb.group.tolist()
    fulls = [mb.prompts[g].with_response(mb.responses[i, : lens[i]].tolist()) for i, g in enumerate(groups)]
    hidden = model.hidden(fulls)  # [n, Lmax, C]
    P = torch.tensor([len(mb.prompts[g].input_ids) for g in mb.group.tolist()], device=dev)
    rows = (P - 1)[:, None] + torch.arange(R, device=dev)[None, :]
    rows = rows.clamp(max=hidden.shape[1] - 1)  # padding rows (masked) may point past the end
    return hidden.gather(1, rows[..., None].expand(-1, -1, hidden.shape[-1]))


def token_logprobs(model: Qwen25VL, mb: RolloutBatch, mode: str, temperature: float = 1.0,
                   with_entropy: bool = False, packed: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs [n, R] fp32, entropy [n, R] or None) of mb's responses; differentiable."""
    hidden = response_hidden(model, mb, mode, packed)
    targets = to_device(mb.responses, hidden.device)
    if not with_entropy:  # chunked: never materialises the [n, R, V] logits
        return token_logprob(hidden, model.head_weight, targets, temperature), None
    logits = model.logits(hidden).float() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    return lp, entropy_from_logits(logits)


def plan_micro_batches(costs: list[int], per_mb: int, max_tokens: int | None = None) -> list[list[int]]:
    """Split items 0..len(costs)-1, in order, into runs: `per_mb` items each, or (max_tokens set) as
    many as fit max_tokens by their costs, at least one per run."""
    runs: list[list[int]] = []
    total = 0
    for i, c in enumerate(costs):
        if not runs or (len(runs[-1]) >= per_mb if max_tokens is None else total + c > max_tokens):
            runs.append([])
            total = 0
        runs[-1].append(i)
        total += c
    return runs


def micro_batches(batch: RolloutBatch, mode: str, prompts_per_mb: int, samples_per_mb: int,
                  max_tokens: int | None = None, packed: bool = True):
    """Yield (micro-batch, sample indices into `batch`): fixed counts, or a token budget per pass."""
    lens = batch.response_lengths() if max_tokens is not None else [0] * batch.num_samples
    P = [len(p.input_ids) for p in batch.prompts]
    if mode == "rollplex":
        costs = list(P)  # each prompt once, plus its responses (padded to R on the prefix-state path)
        for i, g in enumerate(batch.group.tolist()):
            costs[g] += lens[i] if packed else batch.responses.shape[1]
        for ids in plan_micro_batches(costs, prompts_per_mb, max_tokens):
            yield batch.select_prompts(ids)
    else:
        costs = [P[g] + n for g, n in zip(batch.group.tolist(), lens)]
        for ids in plan_micro_batches(costs, samples_per_mb, max_tokens):
            idx = torch.tensor(ids, dtype=torch.long)
            yield batch.select_samples(idx), idx


@torch.no_grad()
def score(model: Qwen25VL, batch: RolloutBatch, mode: str, temperature: float = 1.0, prompts_per_mb: int = 4,
          samples_per_mb: int = 8, packed: bool = False, max_tokens: int | None = None) -> torch.Tensor:
    """No-grad logprobs [N, R] (reference / old-policy scoring), zero on padding."""
    out = torch.zeros(batch.responses.shape, dtype=torch.float32, device=model.inv_freq.device)
    for mb, idx in micro_batches(batch, mode, prompts_per_mb, samples_per_mb, max_tokens, packed):
        lp, _ = token_logprobs(model, mb, mode, temperature, packed=packed)
        # stays on the device: no sync per micro-batch
        out[to_device(idx, out.device)] = lp * to_device(mb.mask, out.device)
    return out.cpu()
