"""Per-token logprobs of sampled responses under a model, in either mode.

    rollplex: each prompt (vision tower + prompt tokens) once, its n responses attending to it:
              all prompts and responses of the micro-batch packed into one sequence (packed=True,
              `group_hidden`, the default), or a prefix pass then the padded responses over its
              PrefixState
    serial:   every sample is a full sequence prompt + response (its images re-encoded per sample,
              as verl repeats multimodal inputs n times) -> hidden rows of the response; the
              sequences packed into one pass without padding (packed=True, `sequence_hidden`: verl's
              use_remove_padding, the default), or right-padded to the longest (packed=False)

Both give, for each response token t, log softmax(logits / temperature)[t] — the distribution the
engine sampled from — and, on request, the entropy of that distribution: `entropy="grad"` from the
full [n, R, V] logits, differentiable (an entropy bonus in the loss); `entropy="metric"` detached,
from the chunked logprob pass (rl/logprob.py), so the logits are never all materialised (the
`actor/entropy` metric without a bonus). `score` runs a whole batch in the micro-batches a
`MicroBatching` plans (microbatch.py), in this process or over a data-parallel group (placement.py).
`score_with_backoff` (reference and old-logprob scoring in the RL step) backs off on out-of-memory errors
like the update: it halves the micro-batches (kept for later calls) and retries, down to one prompt
(one sequence) per pass, then raises TrainOOM; scoring changes no state, so nothing is applied.
"""

from __future__ import annotations

import logging

import torch

from ..models import Qwen25VL
from ..models.transfer import to_device
from .algos import entropy_from_logits
from .batch import RolloutBatch
from .logprob import token_logprob, token_logprob_entropy
from .microbatch import Backoff, MicroBatching
from .placement import Placement, SingleProcess
from .trainer import retry_oom

ENTROPY = ("none", "metric", "grad")
log = logging.getLogger("rollplex.rl")


def response_hidden(model: Qwen25VL, mb: RolloutBatch, mode: str, packed: bool,
                    prefix_key: str | None = None) -> torch.Tensor:
    """Hidden states predicting each response token, [n, R, C]; with `prefix_key` (rollplex mode) the
    responses attend to the prefix states the rollout handed over (`mb.prefix[prefix_key]`)."""
    dev = model.inv_freq.device
    R = mb.responses.shape[1]
    lens = mb.response_lengths()  # the mask keeps a prefix of each response: tokens up to EOS
    # the rollout computed the prefix: responses only (a placement's dummy samples have no prefix state)
    if mode == "rollplex" and prefix_key is not None and prefix_key in mb.prefix:
        prefix = mb.prefix[prefix_key].gather()
        if packed:
            return model.prefix_group_hidden(prefix, mb.responses, lens, mb.group.tolist())
        return model.response_hidden(prefix, to_device(mb.responses, dev), to_device(mb.group, dev))
    if mode == "rollplex" and packed:  # prompts and responses packed into one pass; each prompt computed once
        return model.group_hidden(mb.prompts, mb.responses, lens, mb.group.tolist())
    if mode == "rollplex":  # a prefix pass, then the padded responses over its PrefixState
        return model.response_hidden(model.prefix(mb.prompts), to_device(mb.responses, dev), to_device(mb.group, dev))
    groups = mb.group.tolist()
    if packed:  # serial: whole sequences packed without padding, each its own causal segment
        return model.sequence_hidden(mb.prompts, mb.responses, lens, groups)
    fulls = [mb.prompts[g].with_response(mb.responses[i, : lens[i]].tolist()) for i, g in enumerate(groups)]
    hidden = model.hidden(fulls)  # [n, Lmax, C]
    P = torch.tensor([len(mb.prompts[g].input_ids) for g in mb.group.tolist()], device=dev)
    rows = (P - 1)[:, None] + torch.arange(R, device=dev)[None, :]
    rows = rows.clamp(max=hidden.shape[1] - 1)  # padding rows (masked) may point past the end
    return hidden.gather(1, rows[..., None].expand(-1, -1, hidden.shape[-1]))


def token_logprobs(model: Qwen25VL, mb: RolloutBatch, mode: str, packed: bool, temperature: float = 1.0,
                   entropy: str = "none",
                   prefix_key: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs [n, R] fp32, entropy [n, R] or None) of one micro-batch's responses; the logprobs are
    differentiable, the entropy is with `entropy="grad"` (see the module docstring)."""
    if entropy not in ENTROPY:
        raise ValueError(f"entropy must be one of {ENTROPY}, got {entropy!r}")
    hidden = response_hidden(model, mb, mode, packed, prefix_key)
    targets = to_device(mb.responses, hidden.device)
    if entropy == "none":  # chunked: never materialises the [n, R, V] logits
        return token_logprob(hidden, model.head_weight, targets, temperature), None
    if entropy == "metric":
        return token_logprob_entropy(hidden, model.head_weight, targets, temperature)
    logits = model.logits(hidden).float() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    return lp, entropy_from_logits(logits)


@torch.no_grad()
def score(model: Qwen25VL, batch: RolloutBatch, mode: str, plan: MicroBatching,
          temperature: float = 1.0, prefix_key: str | None = None,
          placement: Placement | None = None) -> torch.Tensor:
    """No-grad logprobs [N, R] (reference / old-policy scoring), zero on padding; `prefix_key`: use the
    rollout's prefix states for that consumer (`batch.prefix`) instead of running the prefix.
    placement: where the passes run (default: this process); every process gets the whole [N, R]."""
    pl = placement or SingleProcess()
    out = torch.zeros(batch.responses.shape, dtype=torch.float32, device=model.inv_freq.device)
    if prefix_key is not None and (mode != "rollplex" or prefix_key not in batch.prefix):
        prefix_key = None
    rows = batch.prefix[prefix_key] if prefix_key is not None else None
    if rows is not None and pl.world > 1:  # each process scores the prompts whose prefix states it holds
        local, local_idx = batch.select_prompts(rows.planned())
    else:
        local, local_idx = pl.share(batch, mode)
    for mb, idx in pl.passes(local, mode, plan, prefix=prefix_key is not None):
        lp, _ = pl.run(model, token_logprobs, model, mb, mode, plan.packed, temperature, "none", prefix_key)
        n = idx.shape[0]  # rows past n: a placement's masked-out dummies
        # stays on the device: no sync per micro-batch
        out[to_device(local_idx[idx], out.device)] = lp[:n] * to_device(mb.mask[:n], out.device)
    return pl.sum_(out).cpu()


def score_with_backoff(model: Qwen25VL, batch: RolloutBatch, mode: str, plan: MicroBatching,
                       temperature: float = 1.0, prefix_key: str | None = None, placement: Placement | None = None,
                       backoff: Backoff | None = None, what: str = "reference") -> torch.Tensor:
    """`score` that halves the micro-batches on an out-of-memory error and retries (the halved plan kept in
    `backoff` for later calls); TrainOOM (nothing applied) at one prompt / sequence per pass, or at once
    inside a data-parallel pass whose other ranks wait in its collectives."""
    pl = placement or SingleProcess()
    return retry_oom(lambda mb_plan: score(model, batch, mode, mb_plan, temperature, prefix_key, pl), plan, mode,
                     backoff or Backoff(), pl, model, f"the {what} scoring",
                     ("lower micro_batch_prompts / micro_batch_max_tokens or offload the reference model",
                      "lower n or max_new_tokens, or offload the reference model (--memory-overrides "
                      "ref_weights:*=offloaded)"))
