"""Every op traces into one torch.compile graph (fullgraph=True: a graph break is an error)."""

import pytest
import torch

from bloomnative.kernels import (
    _dispatch,
    bias_gelu,
    flash_alibi_attention,
    layer_norm,
    linear_cross_entropy,
)
from harness.kernel_checks import NEEDS_TRITON, assert_close_to_reference, bloom_alibi_slopes

# Inductor's own internals still call torch.jit.script_method.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")

BATCH, SEQ, HEADS, HEAD_DIM, VOCAB = 2, 24, 2, 32, 50
HIDDEN = HEADS * HEAD_DIM


def _tiny_bloom_step(x, residual, ln_w, ln_b, qkv_w, fc_b, head_w, slopes, targets):
    """A pre-LN block plus the loss: each op of bloomnative.kernels once."""
    normed, residual = layer_norm(x, ln_w, ln_b, residual=residual)
    qkv = (normed @ qkv_w.t()).view(BATCH, SEQ, HEADS, 3, HEAD_DIM)
    q, k, v = (qkv[..., i, :].transpose(1, 2) for i in range(3))
    attn = flash_alibi_attention(q, k, v, slopes).transpose(1, 2).reshape(BATCH, SEQ, HIDDEN)
    hidden = residual + bias_gelu(attn, fc_b)
    return linear_cross_entropy(hidden.reshape(-1, HIDDEN), head_w, targets.reshape(-1))


def _inputs():
    def param(*shape, scale=1.0):
        return (scale * torch.randn(*shape)).requires_grad_()

    return (
        param(BATCH, SEQ, HIDDEN),
        param(BATCH, SEQ, HIDDEN),
        param(HIDDEN, scale=0.1),
        param(HIDDEN, scale=0.1),
        param(3 * HIDDEN, HIDDEN, scale=HIDDEN**-0.5),
        param(HIDDEN, scale=0.1),
        param(VOCAB, HIDDEN, scale=HIDDEN**-0.5),
        bloom_alibi_slopes(HEADS),
        torch.randint(0, VOCAB, (BATCH, SEQ)),
    )


def _loss_and_grads(fn, inputs):
    loss = fn(*inputs)
    leaves = [t for t in inputs if t.requires_grad]
    return loss, torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize(
    "path, backend",
    [
        pytest.param("triton", "inductor", id="triton-inductor", marks=NEEDS_TRITON),
        pytest.param("reference", "aot_eager", id="torch-reference-aot_eager"),
    ],
)
def test_one_training_step_compiles_without_graph_breaks(monkeypatch, path, backend):
    if path == "reference":
        monkeypatch.setattr(_dispatch, "FORCE_REFERENCE", True)
    torch._dynamo.reset()
    inputs = _inputs()
    eager_loss, eager_grads = _loss_and_grads(_tiny_bloom_step, inputs)
    compiled = torch.compile(_tiny_bloom_step, fullgraph=True, backend=backend)
    loss, grads = _loss_and_grads(compiled, inputs)
    assert_close_to_reference(loss, eager_loss, 1e-5, "loss")
    for i, (got, want) in enumerate(zip(grads, eager_grads, strict=True)):
        assert_close_to_reference(got, want, 1e-5, f"grad {i}")


@NEEDS_TRITON
def test_attention_dropout_compiles_without_graph_breaks_with_and_without_a_seed():
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 2, 24, 32, requires_grad=True) for _ in range(3))
    slopes = bloom_alibi_slopes(2)
    seed = torch.tensor(11, dtype=torch.int64)

    def step(q, k, v, seed):
        return flash_alibi_attention(q, k, v, slopes, dropout_p=0.2, rng_seed=seed)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager_out = step(q, k, v, seed)
    out = compiled(q, k, v, seed)
    assert_close_to_reference(out, eager_out, 1e-6, "out")
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    eager_grads = torch.autograd.grad(eager_out, (q, k, v), torch.ones_like(out))
    for got, want in zip(grads, eager_grads, strict=True):
        assert_close_to_reference(got, want, 1e-6, "grad")
    drawn = torch.compile(lambda q, k, v: step(q, k, v, None), fullgraph=True, backend="aot_eager")
    assert drawn(q, k, v).shape == q.shape  # the seed drawn inside the graph
