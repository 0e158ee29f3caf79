"""The FLOPs a training step is credited with (`BloomArgs.flops_per_token`, behind the logged
tflops and MFU): 6 per parameter for a full model, and for a LoRA run, whose frozen weights get no
weight gradient, 4 per frozen parameter and 6 per adapter parameter. Checked against PyTorch's
own FLOP counter (`torch.utils.flop_counter.FlopCounterMode`) on a real forward and backward of
the model, with and without adapters.

What the credit leaves out: autograd computes no input gradient below the first adapter (the
first block's layers under it, whose inputs come from the frozen embedding), at most two thirds
of one block's backward matmuls: 1.2% of this 24-block model's step with query_key_value
adapters, 2.2% with adapters in the MLP (the full model's credit is 0.8% above the count: N's
LayerNorm and bias parameters), under 0.5% of BLOOMZ-7b1's 30 blocks."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from bloomnative.adapters.lora import apply_lora, is_adapter_parameter
from bloomnative.model import Bloom, BloomArgs

SEQ = 64
# Wide enough that LayerNorm and bias parameters, counted in N but not matmuls, are under 1%;
# deep enough that the first block's skipped input gradients are 1-2% of the step.
ARGS = BloomArgs(n_layer=24, hidden_size=128, n_head=4, vocab_size=512)


def counted_flops_per_token(model: Bloom) -> float:
    """PyTorch's count of one forward and backward over SEQ tokens, per token."""
    tokens = torch.randint(0, ARGS.vocab_size, (1, SEQ))
    with FlopCounterMode(display=False) as counter:
        logits = model(tokens)
        logits.float().square().mean().backward()
    return counter.get_total_flops() / SEQ


def test_a_full_model_is_credited_6_flops_per_parameter():
    model = Bloom(ARGS)
    assert ARGS.flops_per_token(SEQ) == pytest.approx(counted_flops_per_token(model), rel=0.01)


@pytest.mark.parametrize("targets", [["query_key_value"], ["dense_h_to_4h", "dense_4h_to_h"]])
def test_a_frozen_base_with_adapters_is_credited_4_flops_per_base_parameter(targets):
    model = Bloom(ARGS)
    apply_lora(model, rank=8, alpha=16.0, targets=targets)
    adapters = sum(p.numel() for n, p in model.named_parameters() if is_adapter_parameter(n))
    assert adapters > 0
    credited = ARGS.flops_per_token(SEQ, adapters)
    assert credited == pytest.approx(counted_flops_per_token(model), rel=0.03)
    # the full model's 6N would overstate such a step by a third and more
    assert ARGS.flops_per_token(SEQ) > 1.3 * credited
