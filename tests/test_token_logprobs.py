"""Log-probs and entropy a slice of positions at a time (``training.token_logprobs``): the same
values and gradients as the whole-batch ``log_softmax``, on random logits and through the
tiny model's forward pass."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from serl_cli.algos.batch import make_micro_batches
from serl_cli.training.step import action_logprobs
from serl_cli.training.token_logprobs import TokenLogprobs, positions_per_chunk, slices, token_logprobs


def whole_batch(logits, targets, temperature):
    """The formula as it was written before the slicing: one fp32 log_softmax over [B, K, V]."""
    k = targets.shape[1]
    lp = torch.log_softmax(logits[:, :k].float() / temperature, dim=-1)
    return lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(lp.exp() * lp).sum(-1)


@pytest.mark.parametrize("step", [1, 3, 5, 11, 100])  # one position; parts of a row; one row; 2 rows; all
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_the_whole_batch_formula(step, temperature):
    torch.manual_seed(0)
    logits = (3 * torch.randn(3, 6, 50, dtype=torch.float64)).requires_grad_()  # S = K + 1, as the model gives
    targets = torch.randint(0, 50, (3, 5))
    w_logp, w_ent = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)

    logp, ent = TokenLogprobs.apply(logits, targets, temperature, True, step)
    (logp * w_logp + ent * w_ent).sum().backward()
    grad = logits.grad.clone()
    logits.grad = None
    ref_logp, ref_ent = whole_batch(logits.double(), targets, temperature)
    ref_logp, ref_ent = ref_logp.double(), ref_ent.double()
    (ref_logp * w_logp + ref_ent * w_ent).sum().backward()

    assert torch.allclose(logp.double(), ref_logp, atol=1e-6) and torch.allclose(ent.double(), ref_ent, atol=1e-6)
    assert torch.allclose(grad, logits.grad, atol=1e-6)
    assert torch.equal(grad[:, 5:], torch.zeros_like(grad[:, 5:]))  # the last position feeds nothing


def test_log_probs_alone_and_entropy_alone_have_their_gradients():
    torch.manual_seed(1)
    logits = torch.randn(2, 4, 30, requires_grad=True)
    targets = torch.randint(0, 30, (2, 3))
    token_logprobs(logits, targets, 0.5).sum().backward()  # no entropy asked
    g_logp = logits.grad.clone()
    logits.grad = None
    whole_batch(logits, targets, 0.5)[0].sum().backward()
    assert torch.allclose(g_logp, logits.grad, atol=1e-6)

    logits.grad = None
    _, ent = token_logprobs(logits, targets, 0.5, entropy=True)
    ent.sum().backward()  # the log-probs unused: their gradient is None
    g_ent = logits.grad.clone()
    logits.grad = None
    whole_batch(logits, targets, 0.5)[1].sum().backward()
    assert torch.allclose(g_ent, logits.grad, atol=1e-6)


def test_slices_are_sized_by_the_vocabulary():
    assert positions_per_chunk(151_936) == 55 and positions_per_chunk(8) == 1 << 20
    assert positions_per_chunk(10**9) == 1  # never zero
    # every position once: 3 rows of 5 in parts of rows, in whole rows, in pairs of rows
    for step in (2, 5, 11):
        seen = sorted((b, j) for rows, cols in slices(3, 5, step) for b in range(3)[rows] for j in range(5)[cols])
        assert seen == [(b, j) for b in range(3) for j in range(5)]
    assert [(r.start, r.stop) for r, _ in slices(3, 5, 11)] == [(0, 2), (2, 3)]


def test_action_logprobs_equal_the_whole_batch_formula_on_the_model(tiny_model_dir):
    from serl_cli.models.loading import load_model

    model, tok = load_model(str(tiny_model_dir))
    replies = [[7], [8, 9], [7, 10, 3], [4]]
    items = [SimpleNamespace(prompt_ids=[5 + i, 9, 11 + i, 40], action_ids=r) for i, r in enumerate(replies)]
    (mb,) = make_micro_batches(items, list(range(len(items))), 10_000, tok.pad_token_id)
    logp, ent = action_logprobs(model, mb, 0.8, entropy=True)
    (logp.sum() + 0.1 * ent.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    k = mb.reply_ids.shape[1]
    out = model(
        input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids, logits_to_keep=k + 1
    )
    ref_logp, ref_ent = whole_batch(out.logits, mb.reply_ids, 0.8)
    ref_logp, ref_ent = ref_logp * mb.reply_mask, ref_ent * mb.reply_mask
    (ref_logp.sum() + 0.1 * ref_ent.sum()).backward()
    assert torch.allclose(logp, ref_logp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    for n, p in model.named_parameters():
        assert torch.allclose(grads[n], p.grad, atol=1e-5, rtol=1e-4), n
