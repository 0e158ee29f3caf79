"""FP8 training of the block linears through torchao's float8 training (`[quantize] linear`),
applied from outside the model like the other plans, to each model part before tensor
parallelism, compilation and FSDP2 wrap it (torchtitan's order: its float8 converter swaps the
linears right after the model is built, before parallelising).

Each of the four linears of a block (QKV, attention output, both MLP matmuls) becomes torchao's
`Float8Linear`: its input, weight and output gradient are cast to float8 e4m3 with dynamic
scales (the recipe's: one per tensor, "tensorwise", or one per row, "rowwise") for the three
matmuls of forward and backward; the weight itself stays a plain parameter in the run's dtype,
so checkpoints, optimizers and FSDP2 see the same tensors as without FP8. The embedding, the
tied head and the loss are not converted: BLOOM's head is the 250,880-row embedding itself,
its logits feed a softmax over the whole vocabulary, and an FP8 cast there would round the
embedding's gradient too.

torchao is an optional dependency (the `float8` extra), imported only when linears are
converted; `float8_missing` says, without importing it, whether it is installed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from bloomnative.config import ConfigError, QuantizeConfig
from bloomnative.model import Bloom

FLOAT8_INSTALL = "pip install 'bloomnative[float8]' (torchao)"
FLOAT8_MIN_CAPABILITY = (8, 9)
"""The first CUDA compute capability with FP8 tensor cores (Ada, sm_89; Hopper is sm_90)."""
FLOAT8_DIM_MULTIPLE = 16
"""`torch._scaled_mm` needs both dimensions of each FP8 weight to be multiples of this."""
BLOCK_LINEARS = ("query_key_value", "self_attention.dense", "dense_h_to_4h", "dense_4h_to_h")
"""The block linears FP8 converts, by the end of their names."""


def float8_missing() -> bool:
    """Whether torchao, which holds the FP8 training linears, is not installed."""
    return importlib.util.find_spec("torchao") is None


def float8_device_problem(
    linear: str, emulate: bool, device_type: str, capability: tuple[int, int] | None
) -> str | None:
    """Why `quantize.linear = linear` cannot run on a device of `device_type` (a CUDA device of
    compute `capability`), or None when it can: FP8 matmuls need an sm_89+ CUDA GPU unless
    torchao emulates them (`emulate`)."""
    if linear == "none" or emulate:
        return None
    if device_type != "cuda":
        return (
            f'quantize.linear = "{linear}" on {device_type}: FP8 matmuls need a CUDA GPU of '
            "sm_89 or newer; set quantize.emulate = true (FP8 numerics, not speed) or "
            'quantize.linear = "none"'
        )
    if capability is not None and capability < FLOAT8_MIN_CAPABILITY:
        major, minor = capability
        return (
            f'quantize.linear = "{linear}" on a GPU of compute capability sm_{major}{minor}: FP8 '
            "matmuls need sm_89 or newer (Ada, Hopper); set quantize.emulate = true or "
            'quantize.linear = "none"'
        )
    return None


def check_float8(
    quantize: QuantizeConfig,
    compiled: bool,
    device: torch.device,
    warn: Callable[[str], None],
    fsdp: bool,
) -> None:
    """Raises ConfigError (one line) when `quantize` asks for FP8 linears that cannot run here:
    torchao missing, a device without FP8 matmuls and no emulation (`float8_device_problem`),
    or FP8 all-gathers where FSDP2 does not wrap the model (`fsdp` false); `warn`s in one line
    when they would run uncompiled (`compiled` false), where the scaling and casts are kernels
    of their own and may cost more than the FP8 matmuls save."""
    linear = quantize.linear
    if quantize.fsdp_float8_all_gather and not fsdp:
        raise ConfigError(
            "quantize.fsdp_float8_all_gather = true, but FSDP2 does not wrap this run's model "
            '(one data-parallel rank in fp32): nothing is gathered; set training.dtype = "bf16", '
            "use data parallelism, or set quantize.fsdp_float8_all_gather = false"
        )
    if linear == "none":
        return
    if float8_missing():
        raise ConfigError(
            f'quantize.linear = "{linear}" needs torchao, which is not installed: {FLOAT8_INSTALL}'
        )
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    problem = float8_device_problem(linear, quantize.emulate, device.type, capability)
    if problem is not None:
        raise ConfigError(problem)
    if not compiled:
        warn(
            f'quantize.linear = "{linear}" with compile.enable = false: FP8 is only fast '
            "compiled (uncompiled, its scaling and casts are separate kernels); set "
            "compile.enable = true"
        )


def fp8_kernel_takes(linear: nn.Linear) -> bool:
    """Whether the FP8 matmul kernels take a linear of this shape."""
    return all(dim % FLOAT8_DIM_MULTIPLE == 0 for dim in (linear.in_features, linear.out_features))


def _is_block_linear(name: str, module: nn.Module) -> bool:
    return (
        isinstance(module, nn.Linear)
        and name.startswith("layers.")
        and name.endswith(BLOCK_LINEARS)
    )


def apply_float8(
    part: Bloom,
    recipe: str,
    emulate: bool,
    log: Callable[[str], None] | None = None,
    fsdp_all_gather: bool = False,
) -> list[str]:
    """Converts the block linears of `part` (a model or pipeline stage, on any device, meta
    included) to FP8 training with torchao's recipe `recipe` ("rowwise" or "tensorwise"), in
    torchao's emulation with `emulate`. Linears whose dimensions the FP8 kernels cannot take
    stay as they are; their names are returned and, when there are any, listed in one `log`
    line. Apply it before adapters (`adapters.apply_lora`, which keeps the FP8 matmul of the
    layers it adapts): it would replace an adapted layer by one without its adapter, so a block
    linear with modules of its own is refused (ValueError).

    `fsdp_all_gather` (tensorwise only): each converted weight becomes torchao's
    `WeightWithDynamicFloat8CastTensor`, which FSDP2 (applied after) casts to FP8 before its
    all-gather; call `precompute_float8_scales` before each step's first forward, and a
    checkpoint stores the plain tensor inside (`model.state.stored_tensor`)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    for name, module in part.named_modules():
        if _is_block_linear(name, module) and any(module.children()):
            raise ValueError(
                f"apply_float8: {name} holds modules of its own (an adapter?); apply FP8 "
                "before the adapters"
            )
    skipped = [
        name
        for name, module in part.named_modules()
        if _is_block_linear(name, module) and not fp8_kernel_takes(module)
    ]
    if skipped and log is not None:
        log(
            f"FP8: {len(skipped)} block linear(s) stay in the run's dtype, their dimensions not "
            f"multiples of {FLOAT8_DIM_MULTIPLE}: {', '.join(skipped)}"
        )
    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(recipe),
        emulate=emulate,
        enable_fsdp_float8_all_gather=fsdp_all_gather,
    )
    convert_to_float8_training(
        part,
        config=config,
        module_filter_fn=lambda m, name: _is_block_linear(name, m) and fp8_kernel_takes(m),
    )
    for name, module in part.named_modules():
        # The fused bias + GeLU kernel reads the up-projection's weight with F.linear, around
        # the module: unfused, the FP8 module computes the matmul (compiled, Inductor fuses the
        # bias and GeLU again).
        if name.endswith(".mlp") and name + ".dense_h_to_4h" not in skipped:
            module.fused_bias_gelu = False
    return skipped


def precompute_float8_scales(parts: Sequence[nn.Module]) -> None:
    """The FP8 scale of every weight that FSDP2 gathers in FP8 (`apply_float8` with
    `fsdp_all_gather`), from the weights as they are now, in one all-reduce per part (without
    it, each weight's all-gather would all-reduce its own amax). Call it after the weights
    change and before they are gathered: at the start of each step and evaluation, which also
    covers a checkpoint loaded or rolled back to."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for part in parts:
        precompute_float8_dynamic_scale_for_fsdp(part)
