"""A CPU-only install without Triton imports bloomnative.kernels and runs every op's reference."""

import os
import textwrap

import pytest

from harness.launching import python_command, run

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["triton"] = None  # `import triton` now raises ImportError
    import torch
    from bloomnative.kernels import (
        _dispatch, bias_gelu, bias_gelu_reference, flash_alibi_attention,
        flash_alibi_attention_reference, layer_norm, layer_norm_reference,
        linear_cross_entropy, linear_cross_entropy_reference,
    )
    assert not _dispatch.HAS_TRITON and not _dispatch.INTERPRET
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 3, 9, 32, requires_grad=True) for _ in range(3))
    slopes = torch.rand(3)
    out = flash_alibi_attention(q, k, v, slopes)
    torch.testing.assert_close(out, flash_alibi_attention_reference(q, k, v, slopes))
    out.sum().backward()
    x, w, b = torch.randn(4, 16), torch.rand(16), torch.randn(16)
    torch.testing.assert_close(layer_norm(x, w, b), layer_norm_reference(x, w, b))
    torch.testing.assert_close(bias_gelu(x, b), bias_gelu_reference(x, b))
    h, head = torch.randn(6, 16, requires_grad=True), torch.randn(30, 16, requires_grad=True)
    t = torch.randint(0, 30, (6,))
    loss = linear_cross_entropy(h, head, t)
    torch.testing.assert_close(loss, linear_cross_entropy_reference(h, head, t))
    loss.backward()
    print("ok")
    """
)


@pytest.mark.multiprocess
def test_ops_fall_back_to_the_references_when_triton_is_not_installed():
    proc = run(python_command(["-c", SCRIPT]), env=os.environ, timeout=120)
    assert proc.stdout.strip().endswith("ok")
