"""The rollout batch the RL step works on: B prompts, N = sum of samples, responses padded to R.

`finished` orders the prompts by when their groups finished decoding (the native engine reports it,
rl/rollout.py): the actor cuts the first epoch's mini-batches from that order (rl/actor.py), so the
fused schedule can train the first mini-batch while the rest still decodes (rl/pipeline.py). None
(a backend that does not report it, rollouts given to `train`, batches concatenated): prompt order."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..models import ModelInputs


@dataclass
class RolloutBatch:
    prompts: list[ModelInputs]  # B prompts
    group: torch.Tensor  # [N] long: prompt index of each sample
    responses: torch.Tensor  # [N, R] long, right-padded
    mask: torch.Tensor  # [N, R] float: 1 for response tokens (EOS included), 0 for padding
    rollout_logprobs: torch.Tensor | None = None  # [N, R] engine logprobs of the sampled tokens
    rewards: torch.Tensor | None = None  # [N]
    extras: dict = field(default_factory=dict)  # per-sample lists (texts, finish reasons, ...)
    # prefix states made during the rollout, by consumer ("ref", "old"): cosched.PrefixRows, one row per prompt
    prefix: dict = field(default_factory=dict)
    # [B] each prompt's place in the order the groups finished (sortable keys; None: unknown)
    finished: list[int] | None = None
    # [N, R] the rollout correction's IS weights of the whole batch (rl/rollout_correction.py), set by the step
    # for the update when they need the whole batch (batch normalisation); None: formed per micro-batch
    is_weights: torch.Tensor | None = None
    # ReMax (adv_estimator="remax"): each prompt's greedy response, rolled out in the same call (a batch of B
    # samples, sample i of prompt i), and the reward of that response per sample [N] once scored (rl/remax.py)
    greedy: RolloutBatch | None = None
    baselines: torch.Tensor | None = None

    @property
    def num_samples(self) -> int:
        return self.responses.shape[0]

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)

    @classmethod
    def from_samples(cls, prompts: list[ModelInputs], group: list[int], responses: list[list[int]], pad_id: int,
                     logprobs: list[list[float]] | None = None, rewards: list[float] | None = None,
                     **extras) -> RolloutBatch:
        if len(group) != len(responses) or (logprobs is not None and len(logprobs) != len(responses)):
            raise ValueError("group, responses and logprobs must have one entry per sample")
        if any(not 0 <= g < len(prompts) for g in group):
            raise ValueError("group index out of range")
        if any(len(r) == 0 for r in responses):
            raise ValueError("empty response")
        R = max(len(r) for r in responses)
        resp = torch.full((len(responses), R), pad_id, dtype=torch.long)
        mask = torch.zeros(len(responses), R)
        lp = torch.zeros(len(responses), R) if logprobs is not None else None
        for i, r in enumerate(responses):
            resp[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
            if lp is not None:
                lp[i, : len(r)] = torch.tensor(logprobs[i])
        rw = None if rewards is None else torch.tensor(rewards, dtype=torch.float32)
        return cls(prompts, torch.tensor(group, dtype=torch.long), resp, mask, lp, rw, extras)

    @classmethod
    def from_outputs(cls, prompts: list[ModelInputs], outputs: list, pad_id: int, data_sources: list | None = None,
                     ground_truths: list | None = None, extra_infos: list | None = None) -> RolloutBatch:
        """From the engine's RequestOutputs (one per prompt); per-prompt lists are repeated per sample."""
        group = [i for i, o in enumerate(outputs) for _ in o.samples]
        per_sample = lambda xs: [xs[g] for g in group] if xs is not None else [None] * len(group)  # noqa: E731
        samples = [s for o in outputs for s in o.samples]
        done = [getattr(o, "meta", {}).get("finish_index") for o in outputs]
        batch = cls.from_samples(
            prompts, group, [s.token_ids for s in samples], pad_id, logprobs=[s.logprobs for s in samples],
            texts=[s.text or "" for s in samples], finish_reasons=[s.finish_reason for s in samples],
            data_sources=per_sample(data_sources), ground_truths=per_sample(ground_truths),
            extra_infos=per_sample(extra_infos))
        batch.finished = done if all(d is not None for d in done) else None
        if outputs and all(getattr(o, "greedy", None) for o in outputs):  # ReMax's greedy response per prompt
            g = [o.greedy[0] for o in outputs]
            every = lambda xs: list(xs) if xs is not None else [None] * len(outputs)  # noqa: E731
            batch.greedy = cls.from_samples(
                prompts, list(range(len(outputs))), [s.token_ids for s in g], pad_id,
                logprobs=[s.logprobs for s in g], texts=[s.text or "" for s in g],
                finish_reasons=[s.finish_reason for s in g], data_sources=every(data_sources),
                ground_truths=every(ground_truths), extra_infos=every(extra_infos))
        return batch

    @classmethod
    def concat(cls, batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
        """The batches' prompts and samples in order, as one batch (responses re-padded with `pad_id`).
        Prefix states are per rollout and are not carried: scoring then runs the prefixes itself."""
        if not batches:
            raise ValueError("nothing to concatenate")
        if len({b.rollout_logprobs is None for b in batches}) > 1 or len({b.rewards is None for b in batches}) > 1:
            raise ValueError("every batch must have rollout logprobs and rewards, or none")
        if len({tuple(sorted(b.extras)) for b in batches}) > 1:
            raise ValueError("the batches' per-sample extras differ")
        R = max(b.responses.shape[1] for b in batches)
        pad = lambda t, v: torch.nn.functional.pad(t, (0, R - t.shape[1]), value=v)  # noqa: E731
        offsets = [sum(b.num_prompts for b in batches[:i]) for i in range(len(batches))]
        lp = None if batches[0].rollout_logprobs is None else torch.cat([pad(b.rollout_logprobs, 0.0) for b in batches])
        out = cls([p for b in batches for p in b.prompts],
                   torch.cat([b.group + o for b, o in zip(batches, offsets)]),
                   torch.cat([pad(b.responses, pad_id) for b in batches]),
                   torch.cat([pad(b.mask, 0.0) for b in batches]),
                   lp, None if batches[0].rewards is None else torch.cat([b.rewards for b in batches]),
                   {k: [x for b in batches for x in b.extras[k]] for k in batches[0].extras})
        if all(b.greedy is not None for b in batches):
            out.greedy = cls.concat([b.greedy for b in batches], pad_id)
        if all(b.baselines is not None for b in batches):
            out.baselines = torch.cat([b.baselines for b in batches])
        return out

    def response_lengths(self) -> list[int]:
        """Tokens each response contributes (through its last masked-in token; at least 1)."""
        R = self.responses.shape[1]
        return ((self.mask > 0) * torch.arange(1, R + 1)).amax(-1).clamp_min(1).tolist()

    def finish_order(self) -> list[int]:
        """The prompts in the order their groups finished (prompt order where that is unknown)."""
        if self.finished is None:
            return list(range(self.num_prompts))
        return sorted(range(self.num_prompts), key=lambda i: (self.finished[i], i))

    def select_prompts(self, prompt_ids: list[int]) -> tuple[RolloutBatch, torch.Tensor]:
        """All samples of the given prompts (group re-indexed); also returns the sample indices."""
        remap = {p: i for i, p in enumerate(prompt_ids)}
        idx = torch.tensor([i for i, g in enumerate(self.group.tolist()) if g in remap], dtype=torch.long)
        out = self._take(idx, [self.prompts[p] for p in prompt_ids],
                         torch.tensor([remap[g] for g in self.group[idx].tolist()], dtype=torch.long))
        out.prefix = {k: rows.select(prompt_ids) for k, rows in self.prefix.items()}
        out.finished = None if self.finished is None else [self.finished[p] for p in prompt_ids]
        out.greedy = None if self.greedy is None else self.greedy.select_prompts(prompt_ids)[0]
        return out, idx

    def select_samples(self, idx: torch.Tensor) -> RolloutBatch:
        return self._take(idx, self.prompts, self.group[idx])

    def _take(self, idx: torch.Tensor, prompts: list, group: torch.Tensor) -> RolloutBatch:
        pick = lambda t: None if t is None else t[idx]  # noqa: E731
        extras = {k: [v[i] for i in idx.tolist()] for k, v in self.extras.items()}
        return replace(self, prompts=prompts, group=group, responses=self.responses[idx], mask=self.mask[idx],
                       rollout_logprobs=pick(self.rollout_logprobs), rewards=pick(self.rewards), extras=extras,
                       is_weights=pick(self.is_weights), baselines=pick(self.baselines))


def mask_after_eos(responses: torch.Tensor, eos_id: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mask that keeps tokens up to and including the first EOS of each row (and within `mask`)."""
    is_eos = (responses == eos_id).long()
    after = (is_eos.cumsum(-1) - is_eos) > 0  # strictly after the first EOS
    keep = (~after).float()
    return keep if mask is None else keep * mask
