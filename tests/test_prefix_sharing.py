"""Prefix/response decomposition: one PrefixState shared by n responses == n full forwards.

Holds Rollplex's promise that prefix sharing changes where work runs, never what is computed:
same logits, and with a loss summed over the n responses, the same gradient for every parameter.
"""

import pytest
import torch
from helpers import FORWARD_TERMS, IMG, VID, assert_fp32_close, make_prompt, random_text_ids, tiny_model

N_SAMPLES = 3


def _group(seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [
        make_prompt(g, images=[(1, 6, 10), (1, 4, 4)]),
        make_prompt(g, text_len=(7, 2)),
        make_prompt(g, videos=[(2, 4, 4)]),
    ]
    # n responses per prompt, different (right-padded) lengths
    lens = [[5, 3, 7], [1, 6, 4], [7, 7, 2]]
    R = 7
    resp = random_text_ids((len(prompts) * N_SAMPLES, R), g, vocab=290)
    resp[1, 2], resp[4, 0] = IMG, VID  # a model can emit placeholder ids: they are plain text in a response
    resp_lens = torch.tensor([x for row in lens for x in row])
    index = torch.arange(len(prompts)).repeat_interleave(N_SAMPLES)
    return prompts, resp, resp_lens, index


def _full_logits(model, prompts, resp, resp_lens, index):
    """Per sample: full forward over prompt + response, rows that predict the response tokens."""
    out = []
    for i in range(resp.shape[0]):
        p, n = prompts[index[i]], int(resp_lens[i])
        logits = model([p.with_response(resp[i, :n].tolist())])[0]  # generated placeholder ids are text
        P = len(p.input_ids)
        out.append(logits[P - 1 : P - 1 + n])
    return out


def _shared_logits(model, prompts, resp, index):
    prefix = model.prefix(prompts)
    return model.response_logits(prefix, resp, index)


def _packed_logits(model, prompts, resp, resp_lens, index):
    """Prompts and responses packed into one sequence (group_hidden); samples in shuffled order."""
    hidden = model.group_hidden(prompts, resp, resp_lens.tolist(), index.tolist())
    return model.logits(hidden)


def _sequence_logits(model, prompts, resp, resp_lens, index):
    """No sharing: each sample its own full sequence, all packed without padding (sequence_hidden, serial)."""
    return model.logits(model.sequence_hidden(prompts, resp, resp_lens.tolist(), index.tolist()))


PATHS = {"packed": _packed_logits, "sequences": _sequence_logits,
         "prefix_state": lambda model, prompts, resp, _lens, index: _shared_logits(model, prompts, resp, index)}


@pytest.mark.parametrize("path", ["prefix_state", "packed", "sequences"])
def test_shared_prefix_logits_equal_full_forwards(path):
    model = tiny_model().eval()
    prompts, resp, resp_lens, index = _group()
    perm = torch.tensor([4, 0, 8, 2, 6, 1, 3, 7, 5])  # responses of a group need not be adjacent
    resp, resp_lens, index = resp[perm], resp_lens[perm], index[perm]
    with torch.no_grad():
        full = _full_logits(model, prompts, resp, resp_lens, index)
        shared = PATHS[path](model, prompts, resp, resp_lens, index)
    for i, ref in enumerate(full):
        assert_fp32_close(shared[i, : ref.shape[0]], ref, f"logits of sample {i}", FORWARD_TERMS)


def _loss(logits_rows, resp, resp_lens):
    total = 0.0
    for i, rows in enumerate(logits_rows):
        n = int(resp_lens[i])
        lp = torch.log_softmax(rows[:n].float(), -1).gather(-1, resp[i, :n, None]).squeeze(-1)
        total = total + (lp * torch.linspace(0.5, 1.5, n)).sum()  # arbitrary per-token weights
    return total


@pytest.mark.parametrize("path", ["prefix_state", "packed", "sequences"])
def test_shared_prefix_gradients_equal_full_forwards(path):
    prompts, resp, resp_lens, index = _group(1)
    grads = []
    for shared in (False, True):
        model = tiny_model(seed=3)
        if shared:
            rows = PATHS[path](model, prompts, resp, resp_lens, index)
            rows = [rows[i] for i in range(rows.shape[0])]
        else:
            rows = _full_logits(model, prompts, resp, resp_lens, index)
        _loss(rows, resp, resp_lens).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    ref, got = grads
    assert ref.keys() == got.keys()
    for name in ref:
        assert_fp32_close(got[name], ref[name], f"grad {name}")
    assert any(n.startswith("visual.") and ref[n].abs().sum() > 0 for n in ref)  # vision got gradient


def test_packed_validation():
    model = tiny_model().eval()
    prompts, resp, _, _ = _group()
    with pytest.raises(ValueError, match="response_lens"):
        model.group_hidden(prompts, resp[:2], [0, 3], [0, 1])
    with pytest.raises(ValueError, match="group"):
        model.group_hidden(prompts, resp[:2], [2, 3], [0, 5])


def test_prefix_index_validation():
    model = tiny_model().eval()
    prompts, resp, _, _ = _group()
    prefix = model.prefix(prompts[:1])
    try:
        model.response_hidden(prefix, resp[:2], torch.tensor([0, 1]))
    except ValueError as e:
        assert "prefix_index" in str(e)
    else:
        raise AssertionError("expected ValueError")


def test_fp32_bound_passes_reordering_and_fails_bugs():
    """The suite's equality bound (helpers.fp32_rtol) holds for a gradient summed in another order and
    fails the differences real bugs make: a dropped sample, a normaliser off by 1e-3."""
    prompts, resp, resp_lens, index = _group(1)
    model = tiny_model(seed=3)
    params = [p for p in model.parameters()]
    rows = _full_logits(model, prompts, resp, resp_lens, index)
    losses = [_loss([r], resp[i : i + 1], resp_lens[i : i + 1]) for i, r in enumerate(rows)]

    def flat(loss):
        gs = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        return torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(gs, params)])

    per_sample = [flat(x) for x in losses]
    packed = _packed_logits(model, prompts, resp, resp_lens, index)
    whole = flat(_loss([packed[i] for i in range(packed.shape[0])], resp, resp_lens))  # one packed pass
    reordered = torch.stack(per_sample[::-1]).sum(0)  # per-sample full forwards, added last to first
    assert 0 < assert_fp32_close(reordered, whole, "reordered gradient")
    for bug, got in (("a dropped sample", whole - per_sample[4]), ("normaliser off by 1e-3", whole * (1 + 1e-3))):
        with pytest.raises(AssertionError, match="relative difference"):
            assert_fp32_close(got, whole, bug)
