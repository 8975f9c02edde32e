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
`actor/entropy` metric without a bonus). `logprobs(temperature)` is the forward of no-grad scoring: a
trainer's `score` (rl/trainer.py) runs it over a whole batch, with the one out-of-memory ladder.
"""

from __future__ import annotations

import torch

from ..models import Qwen25VL
from ..models.transfer import to_device
from .algos import entropy_from_logits
from .batch import RolloutBatch
from .logprob import token_logprob, token_logprob_entropy

ENTROPY = ("none", "metric", "grad")


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


def logprobs(temperature: float = 1.0):
    """The forward `Trainer.score` runs to score logprobs (the reference's, the old policy's):
    (model, micro-batch, mode, packed, prefix_key) -> [n, R], at `temperature`."""
    def forward(model: Qwen25VL, mb: RolloutBatch, mode: str, packed: bool,
                prefix_key: str | None = None) -> torch.Tensor:
        return token_logprobs(model, mb, mode, packed, temperature, "none", prefix_key)[0]

    return forward
