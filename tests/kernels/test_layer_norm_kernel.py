"""layer_norm (Triton, via the interpreter) against a float64 reference."""

import importlib

import pytest
import torch

from bloomnative.kernels import layer_norm, layer_norm_reference
from harness.kernel_checks import TOLERANCE, assert_close_to_reference, float64_leaves

ln_module = importlib.import_module("bloomnative.kernels.layer_norm")

# Rows fewer than the persistent backward programs (1 row), ragged hidden sizes (100 and 257 pad
# to 128/512 lanes, several rows per tile), 1024 (BLOOM-560m), and a row wider than the one-pass
# backward takes (8200 features: the two-kernel backward, ragged in its 2048-column chunks).
SHAPES = [(1, 1, 64), (2, 37, 100), (5, 257), (3, 1024), (3, 8200)]


def _inputs(shape, dtype, with_residual):
    hidden = shape[-1]
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype).requires_grad_()
    bias = (0.1 * torch.randn(hidden)).to(dtype).requires_grad_()
    residual = torch.randn(shape, dtype=dtype, requires_grad=True) if with_residual else None
    return x, weight, bias, residual


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_and_gradients_match_float64_reference(triton_kernels, shape, dtype, with_residual):
    x, weight, bias, residual = _inputs(shape, dtype, with_residual)
    outputs = layer_norm(x, weight, bias, 1e-5, residual)
    outputs = outputs if with_residual else (outputs,)
    grads_out = [torch.randn_like(o) for o in outputs]
    leaves = [t for t in (x, weight, bias, residual) if t is not None]
    grads = torch.autograd.grad(outputs, leaves, grads_out)

    x64, w64, b64, r64 = float64_leaves(x, weight, bias, residual)
    ref = layer_norm_reference(x64, w64, b64, 1e-5, r64)
    ref = ref if with_residual else (ref,)
    ref_leaves = [t for t in (x64, w64, b64, r64) if t is not None]
    ref_grads = torch.autograd.grad(ref, ref_leaves, [g.double() for g in grads_out])

    tol = TOLERANCE[dtype]
    names = ("normed", "h")[: len(outputs)]
    for name, got, want in zip(names, outputs, ref, strict=True):
        assert got.dtype == dtype
        assert_close_to_reference(got, want, tol, name)
    names = ("dx", "dweight", "dbias", "dresidual")[: len(grads)]
    for name, got, want in zip(names, grads, ref_grads, strict=True):
        assert_close_to_reference(got, want, tol, name)


def test_eps_is_applied_inside_the_square_root(triton_kernels):
    x = 1e-3 * torch.randn(4, 64)
    weight, bias = torch.ones(64), torch.zeros(64)
    out = layer_norm(x, weight, bias, eps=1e-2)
    ref = layer_norm_reference(x.double(), weight.double(), bias.double(), eps=1e-2)
    assert_close_to_reference(out, ref, 1e-5)


def test_fp32_parameters_with_bf16_activations(triton_kernels):
    # Activations in bf16 with fp32 LayerNorm parameters (no FSDP param cast): grads of the
    # parameters come back in the parameters' dtype.
    x, _, _, _ = _inputs((6, 128), torch.bfloat16, False)
    weight = torch.randn(128, requires_grad=True)
    bias = torch.randn(128, requires_grad=True)
    out = layer_norm(x, weight, bias)
    dweight, dbias = torch.autograd.grad(out.float().sum(), (weight, bias))
    assert out.dtype == torch.bfloat16 and dweight.dtype == torch.float32
    x64, w64, b64 = float64_leaves(x, weight, bias)
    ref_dw, ref_db = torch.autograd.grad(layer_norm_reference(x64, w64, b64).sum(), (w64, b64))
    assert_close_to_reference(dweight, ref_dw, 1e-2, "dweight")
    assert_close_to_reference(dbias, ref_db, 1e-2, "dbias")


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_fake_autograd_and_schema_registrations_pass_opcheck(triton_kernels, with_residual):
    x, weight, bias, residual = _inputs((3, 40), torch.float32, with_residual)
    torch.library.opcheck(ln_module._layer_norm_fwd, (x, weight, bias, residual, 1e-5))


def test_cpu_without_interpreter_dispatches_to_the_reference(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the Triton op must not run on CPU without the interpreter")

    monkeypatch.setattr(ln_module, "use_triton", lambda tensor: False)
    monkeypatch.setattr(ln_module, "_layer_norm_fwd", fail)
    x, weight, bias, residual = _inputs((3, 40), torch.float32, True)
    out, h = layer_norm(x, weight, bias, residual=residual)
    torch.testing.assert_close(h, x + residual)
    torch.testing.assert_close(out, layer_norm_reference(x, weight, bias, residual=residual)[0])


def test_mismatched_parameters_are_reported():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"weight and bias must have shape \[8\]"):
        layer_norm(x, torch.ones(4), torch.zeros(4))
    with pytest.raises(ValueError, match="residual must match x"):
        layer_norm(x, torch.ones(8), torch.zeros(8), residual=torch.randn(2, 8).double())
