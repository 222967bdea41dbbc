"""The chunked output head (relayrl/trainer/head.py) against the model's own logits through the shared functions:
the same logprobs and entropies, and the same gradients for the hidden states and the head's weight, in float32
(to float rounding) and bf16 (against the same bf16 logits computed whole), over several chunks, with the entropy in
the loss and as a metric only."""

from __future__ import annotations

import pytest
import torch

from relayrl.algorithms.logprobs import entropy_from_logits, logprobs_from_logits
from relayrl.trainer import head
from relayrl.trainer.head import HeadLogprobs

ROWS, HIDDEN, VOCAB = 37, 16, 50


def whole(hidden, weight, labels, temperature, dtype):
    """The unchunked reference: the logits kept whole, autograd through the shared functions."""
    logits = hidden.to(dtype) @ weight.to(dtype).T
    return logprobs_from_logits(logits, labels, temperature), entropy_from_logits(logits, temperature)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_in_loss", [True, False])
def test_chunks_equal_the_whole_logits_in_values_and_gradients(
    monkeypatch, dtype, tolerance, temperature, entropy_in_loss
) -> None:
    monkeypatch.setattr(head, "CHUNK_ELEMENTS", 8 * VOCAB)  # 8 rows a chunk: 5 chunks, the last one short
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(ROWS, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) * 0.5
    labels = torch.randint(0, VOCAB, (ROWS,), generator=g)
    g_lp, g_ent = torch.randn(ROWS, generator=g), torch.randn(ROWS, generator=g)
    results = []
    for fn in (HeadLogprobs.apply, whole):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logprob, entropy = fn(h, w, labels, temperature, dtype)
        loss = (logprob * g_lp).sum() + ((entropy * g_ent).sum() if entropy_in_loss else 0.0)
        loss.backward()  # without the entropy term its gradient never reaches backward (a metric)
        results.append((logprob.detach(), entropy.detach(), h.grad, w.grad))
    assert all(r.dtype == torch.float32 for r in results[0][:2])
    scale = [max(1.0, float(r.abs().max())) for r in results[1]]
    for got, want, s in zip(results[0], results[1], scale, strict=True):
        torch.testing.assert_close(got, want, atol=tolerance * s, rtol=0)
