"""`actor/entropy` is reported whatever the entropy coefficient: with coefficient 0 from the chunked
logprob pass (detached), with a bonus from the full logits; both equal the token-mean entropy of
softmax(logits / T) computed from the full logits of the whole sequences."""

import pytest
import torch
from parallel_helpers import rollout_batch, tiny_cfg, tiny_model

from rollplex.rl.actor import Actor
from rollplex.rl.algos import agg_loss, entropy_from_logits
from rollplex.rl.config import RLConfig
from rollplex.rl.scoring import response_hidden


@torch.no_grad()
def _full_logits_entropy(model, batch, temperature: float, agg: str) -> float:
    hidden = response_hidden(model, batch, "serial", packed=True)  # every sample a full sequence
    ent = entropy_from_logits(model.logits(hidden).float() / temperature)
    return float(agg_loss(ent, batch.mask, agg))


@pytest.mark.parametrize("coeff", [0.0, 0.01])
@pytest.mark.parametrize("agg,temperature", [("token-mean", 1.0), ("seq-mean-token-mean", 0.7)])
def test_entropy_metric_equals_full_logits_entropy(coeff, agg, temperature):
    model = tiny_model(tiny_cfg())
    batch, adv, _ = rollout_batch()
    want = _full_logits_entropy(model, batch, temperature, agg)
    cfg = RLConfig(entropy_coeff=coeff, loss_agg_mode=agg, temperature=temperature, micro_batch_prompts=2, lr=1e-4)
    metrics, _ = Actor(model, cfg).update(batch, adv, None)
    assert want > 0.1
    assert metrics["actor/entropy"] == pytest.approx(want, rel=1e-5)


def test_metric_entropy_is_detached_and_chunked():
    from rollplex.rl.logprob import token_logprob, token_logprob_entropy

    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 9, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    y = torch.randint(0, 50, (3, 9), generator=g)
    lp, ent = token_logprob_entropy(h, w, y, 0.8, chunk=4)  # chunks that cut rows
    assert not ent.requires_grad and lp.requires_grad
    torch.testing.assert_close(lp, token_logprob(h, w, y, 0.8))
    torch.testing.assert_close(ent, entropy_from_logits(h.detach() @ w.detach().t() / 0.8), rtol=1e-5, atol=1e-5)
