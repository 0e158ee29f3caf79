"""bias_gelu (Triton, via the interpreter) against a float64 reference."""

import importlib

import pytest
import torch
import torch.nn.functional as F

from bloomnative.kernels import bias_gelu, bias_gelu_reference
from harness.kernel_checks import TOLERANCE, assert_close_to_reference, float64_leaves

bg_module = importlib.import_module("bloomnative.kernels.bias_gelu")

# Ragged in both tile dimensions (37 rows, 100/257 columns vs 16 x 32 interpreter tiles), more
# row blocks than backward row groups (130 rows), and a leading batch dimension.
SHAPES = [(1, 32), (37, 100), (2, 3, 257), (130, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_and_gradients_match_float64_reference(triton_kernels, shape, dtype):
    x = (2 * torch.randn(shape)).to(dtype).requires_grad_()  # covers the tails of tanh
    bias = torch.randn(shape[-1], dtype=dtype, requires_grad=True)
    out = bias_gelu(x, bias)
    grad_out = torch.randn_like(out)
    dx, dbias = torch.autograd.grad(out, (x, bias), grad_out)

    x64, b64 = float64_leaves(x, bias)
    ref = bias_gelu_reference(x64, b64)
    ref_dx, ref_dbias = torch.autograd.grad(ref, (x64, b64), grad_out.double())

    tol = TOLERANCE[dtype]
    assert out.dtype == dtype
    assert_close_to_reference(out, ref, tol, "out")
    assert_close_to_reference(dx, ref_dx, tol, "dx")
    assert_close_to_reference(dbias, ref_dbias, tol, "dbias")


def test_reference_is_torch_tanh_gelu_of_the_biased_input():
    # Megatron's 0.79788456 is sqrt(2/pi) to 8 digits: the same function as torch's tanh GeLU.
    x, bias = torch.randn(64, 48, dtype=torch.float64), torch.randn(48, dtype=torch.float64)
    expected = F.gelu(x + bias, approximate="tanh")
    torch.testing.assert_close(bias_gelu_reference(x, bias), expected, rtol=1e-8, atol=1e-8)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy's exp(>88) = inf: fine
def test_large_inputs_saturate_without_nan(triton_kernels):
    x = torch.tensor([[-1e4, -30.0, 0.0, 30.0, 1e4] + [0.0] * 11], requires_grad=True)
    bias = torch.zeros(16, requires_grad=True)
    out = bias_gelu(x, bias)
    (dx,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(out[0, :5], torch.tensor([0.0, 0.0, 0.0, 30.0, 1e4]))
    torch.testing.assert_close(dx[0, :5], torch.tensor([0.0, 0.0, 0.5, 1.0, 1.0]))


def test_fake_autograd_and_schema_registrations_pass_opcheck(triton_kernels):
    x = torch.randn(5, 40, requires_grad=True)
    bias = torch.randn(40, requires_grad=True)
    torch.library.opcheck(bg_module._bias_gelu_fwd, (x, bias))


def test_cpu_without_interpreter_dispatches_to_the_reference(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the Triton op must not run on CPU without the interpreter")

    monkeypatch.setattr(bg_module, "use_triton", lambda tensor: False)
    monkeypatch.setattr(bg_module, "_bias_gelu_fwd", fail)
    x, bias = torch.randn(3, 40), torch.randn(40)
    torch.testing.assert_close(bias_gelu(x, bias), bias_gelu_reference(x, bias))


def test_bias_of_the_wrong_size_is_reported():
    with pytest.raises(ValueError, match=r"bias must have shape \[8\]"):
        bias_gelu(torch.randn(2, 8), torch.randn(7))
