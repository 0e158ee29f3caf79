"""training.tf32: whether fp32 matmuls and convolutions on CUDA run on TF32 tensor cores."""

from __future__ import annotations

import torch


def apply_tf32(enabled: bool, device: torch.device) -> None:
    """On a CUDA device, lets cuBLAS matmuls and cuDNN convolutions of fp32 tensors use TF32
    tensor cores (inputs rounded to 10 mantissa bits, fp32 accumulation), or forbids it, for the
    whole process; Inductor's compiled matmuls follow the same switch. Does nothing on CPU."""
    if device.type != "cuda":
        return
    # torch's older switches, not its per-backend `fp32_precision` ones: setting those alone
    # leaves torch.get_float32_matmul_precision() raising (torch 2.11 to 2.13), and Inductor
    # calls it when it compiles.
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
