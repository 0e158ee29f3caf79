"""The model with every Triton kernel switched on (flash ALiBi attention, fused LayerNorm,
bias-GeLU, fused lm head + cross-entropy) trains like the torch reference path: same loss curve.
Runs the kernels through Triton's interpreter on CPU."""

import dataclasses

import pytest
import torch

from bloomnative.kernels import _dispatch, flash_alibi_attention
from bloomnative.model import Bloom, BloomArgs
from bloomnative.train.loss import cross_entropy_sum, fused_head_cross_entropy_sum

pytestmark = pytest.mark.skipif(
    not _dispatch.INTERPRET, reason="needs TRITON_INTERPRET=1 set before Triton is imported"
)


def loss_curve(args: BloomArgs, fused_loss: bool, steps: int = 4) -> list[float]:
    torch.manual_seed(0)
    model = Bloom(args)
    model.init_weights(seed=0)
    model.head_in_loss = fused_loss
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    data = torch.randint(0, args.vocab_size, (steps, 2, 24))
    losses = []
    for batch in data:
        inputs, labels = batch[:, :-1], batch[:, 1:]
        out = model(inputs)
        if fused_loss:
            loss = fused_head_cross_entropy_sum(out, model.lm_head.weight, labels)
        else:
            loss = cross_entropy_sum(out, labels)
        loss = loss / labels.numel()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_all_kernels_on_give_the_reference_loss_curve():
    shape = dict(n_layer=2, hidden_size=64, n_head=2, vocab_size=96)  # head_dim 32
    reference = loss_curve(BloomArgs(**shape, attention="sdpa"), fused_loss=False)
    kernels = loss_curve(
        BloomArgs(**shape, attention="triton", fused_kernels=True), fused_loss=True
    )
    assert reference[-1] < reference[0]
    torch.testing.assert_close(torch.tensor(kernels), torch.tensor(reference), rtol=1e-4, atol=0)


def test_triton_backend_passes_attention_dropout_to_the_kernel():
    """The model's attention with the triton backend in training mode is the kernel called with
    dropout_p (its mask seeded from the default generator, which parallel/dropout_rng.py sets per
    rank); in evaluation it is the kernel without dropout."""
    args = BloomArgs(n_layer=1, hidden_size=64, n_head=2, vocab_size=96, attention="triton")
    attention = Bloom(dataclasses.replace(args, attention_dropout=0.3)).layers["0"].self_attention
    x = torch.randn(2, 24, 64)
    b, s, _ = x.shape
    q, k, v = (
        t.transpose(1, 2) for t in attention.query_key_value(x).view(b, s, -1, 3, 32).unbind(3)
    )

    def expected(**dropout) -> torch.Tensor:
        out = flash_alibi_attention(q, k, v, attention.alibi_slopes, causal=True, **dropout)
        return attention.dense(out.transpose(1, 2).reshape(b, s, -1))

    torch.manual_seed(5)
    reference = expected(dropout_p=0.3)
    torch.manual_seed(5)
    torch.testing.assert_close(attention.train()(x), reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(attention.eval()(x), expected(), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(reference, expected(), atol=1e-3)
