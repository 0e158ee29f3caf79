"""Parameter-efficient fine-tuning, applied from outside the model like the parallel plans:
low-rank adapters (`lora`) with Hugging Face PEFT's names and initialisation, PEFT's adapter
folders (`peft`) and the frozen base in 4-bit NormalFloat (`quantize`, QLoRA)."""

from bloomnative.adapters.lora import (
    TARGET_MODULES,
    LoRALinear,
    adapter_state_dict,
    apply_lora,
    init_lora,
    lora_initial_value,
    merge_lora,
)
from bloomnative.adapters.peft import (
    load_adapter_state,
    load_peft_adapter,
    read_peft_adapter,
    save_peft_adapter,
)
from bloomnative.adapters.quantize import quantize_base_nf4

__all__ = [
    "TARGET_MODULES",
    "LoRALinear",
    "adapter_state_dict",
    "apply_lora",
    "init_lora",
    "load_adapter_state",
    "load_peft_adapter",
    "lora_initial_value",
    "merge_lora",
    "quantize_base_nf4",
    "read_peft_adapter",
    "save_peft_adapter",
]
