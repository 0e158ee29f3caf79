"""The frozen base of a LoRA model in 4-bit NormalFloat with double quantisation (QLoRA,
Dettmers et al. 2023), applied from outside the model like the adapters and the parallel plans.

The storage is torchao's `NF4Tensor` (a maintained library, the one torchtune's QLoRA uses, and a
tensor subclass that FSDP2 knows how to shard and gather): each block of 64 weights keeps 4-bit
indices into the 16 NF4 levels and an absmax scale; the scales are themselves quantised to int8
in blocks of 256, less their mean (double quantisation). `F.linear` on such a weight dequantises
it to the input's dtype (bf16 in a bf16 run) and computes in that dtype, so the model's own
`forward` is unchanged. The weights are quantised from their bf16 values, as QLoRA loads its base.

torchao is an optional dependency (the `qlora` extra): it is imported only when a base is
quantised, and `nf4_missing` says, without importing it, whether it is installed.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn as nn

NF4_BLOCK_SIZE = 64
"""Weights per NF4 block (one absmax scale each): QLoRA's and torchao's default."""
NF4_SCALER_BLOCK_SIZE = 256
"""Scales per block of the double quantisation (one bf16 factor each): QLoRA's and torchao's."""
NF4_INSTALL = "pip install 'bloomnative[qlora]' (torchao)"


def nf4_missing() -> bool:
    """Whether torchao, which holds the NF4 storage, is not installed."""
    return importlib.util.find_spec("torchao") is None


def nf4_bytes(numel: int) -> int:
    """Bytes torchao's `NF4Tensor` holds for a weight of `numel` elements: two 4-bit indices per
    uint8, one int8 scale per `NF4_BLOCK_SIZE` weights, one bf16 factor per
    `NF4_SCALER_BLOCK_SIZE` scales, the scales' bf16 mean and the 16 bf16 NF4 levels."""
    scales = numel // NF4_BLOCK_SIZE
    return numel // 2 + scales + 2 * (scales // NF4_SCALER_BLOCK_SIZE) + 2 + 2 * 16


def nf4_quantizable(numel: int) -> bool:
    """Whether a weight of `numel` elements fills whole blocks of scales, as torchao needs."""
    return numel % (NF4_BLOCK_SIZE * NF4_SCALER_BLOCK_SIZE) == 0


def nf4_shard_problem(model: nn.Module, shards: int) -> str | None:
    """Why the linear weights of `model`'s blocks cannot be stored in NF4 and split into
    `shards` dim-0 shards (FSDP2's over dp_shard ranks): torchao splits an NF4 tensor's inner
    tensors evenly, so each shard must hold whole rows and whole blocks of scales. None when
    they can. `model` may be on the meta device."""
    for name, module in model.named_modules():
        if name.startswith("layers.") and isinstance(module, nn.Linear):
            rows, columns = module.weight.shape
            if rows % shards or not nf4_quantizable(rows * columns // shards):
                return (
                    f"{name}.weight ({rows} x {columns}) does not split into {shards} shard(s) "
                    f"of whole rows and whole NF4 scale blocks ({NF4_BLOCK_SIZE} x "
                    f"{NF4_SCALER_BLOCK_SIZE} weights)"
                )
    return None


def frozen_block_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, layer) of every `nn.Linear` of the model's blocks whose weight is frozen: the
    base's layers once `apply_lora` has frozen them (the adapters' own layers train)."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if name.startswith("layers.")
        and isinstance(module, nn.Linear)
        and not module.weight.requires_grad
    ]


@torch.no_grad()
def quantize_base_nf4(model: nn.Module) -> list[str]:
    """Stores the weight of every frozen linear layer of `model`'s blocks (`frozen_block_linears`:
    the adapted layers' bases and, as QLoRA does, the other frozen ones) as an NF4 tensor made
    from its bf16 value; biases, LayerNorms and embeddings stay as they are. Apply it after
    `apply_lora` and after the base's weights are loaded (quantisation reads them). Returns the
    quantised layers' names. Raises ValueError naming a weight whose size torchao's blocks do
    not divide."""
    from torchao.quantization import to_nf4

    layers = frozen_block_linears(model)
    for name, layer in layers:
        if not nf4_quantizable(layer.weight.numel()):
            raise ValueError(
                f"{name}.weight has {layer.weight.numel()} elements, not a multiple of "
                f"{NF4_BLOCK_SIZE} x {NF4_SCALER_BLOCK_SIZE} (torchao's NF4 blocks)"
            )
    for _, layer in layers:
        weight = to_nf4(layer.weight.detach().to(torch.bfloat16))
        layer.weight = nn.Parameter(weight, requires_grad=False)
    return [name for name, _ in layers]
