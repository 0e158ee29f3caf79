"""A bf16 LoRA run stores its frozen base in bf16 (`adapters.lora.store_frozen_in`), with no fp32
master copy: under FSDP2's bf16 MixedPrecisionPolicy (one process, gloo) the loss and the
adapters' gradients are bit for bit those of the same model with the base kept in fp32, the
reference, since FSDP2 casts an fp32 weight to bf16 the same way."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from bloomnative.adapters import TARGET_MODULES, adapter_state_dict, apply_lora
from bloomnative.adapters.lora import store_frozen_in
from bloomnative.interop import load_hf_model
from bloomnative.parallel import apply_fsdp
from harness.hf_models import make_hf_bloom, save_hf_bloom, tokens

SHAPE = dict(hidden_size=32, n_head=4, n_layer=2, vocab_size=128)


def loss_and_grads(base: Path, mesh, frozen_dtype: torch.dtype | None):
    model = load_hf_model(base)
    apply_lora(model, 4, 8.0, 0.0, list(TARGET_MODULES))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in adapter_state_dict(model).values():  # B non-zero
            param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    if frozen_dtype is not None:
        store_frozen_in(model, frozen_dtype)
    apply_fsdp(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    batch = tokens(SHAPE["vocab_size"], 2, 17, seed=5)
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    stored = {p.dtype for p in model.parameters() if not p.requires_grad}
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, stored


def test_a_bf16_frozen_base_computes_what_an_fp32_one_does(one_process, tmp_path):
    base = save_hf_bloom(make_hf_bloom(**SHAPE, seed=9), tmp_path / "base")
    loss, grads, stored = loss_and_grads(base, one_process, torch.bfloat16)
    ref_loss, ref_grads, ref_stored = loss_and_grads(base, one_process, None)
    assert stored == {torch.bfloat16} and ref_stored == {torch.float32}
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        assert grad.dtype == torch.float32 and grad.abs().max() > 0, name
        assert torch.equal(grads[name], grad), name
