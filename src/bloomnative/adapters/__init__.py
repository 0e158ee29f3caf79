"""Parameter-efficient fine-tuning, applied from outside the model like the parallel plans:
low-rank adapters (`lora`) with Hugging Face PEFT's names and initialisation."""

from bloomnative.adapters.lora import (
    TARGET_MODULES,
    LoRALinear,
    adapter_state_dict,
    apply_lora,
    init_lora,
    lora_initial_value,
    merge_lora,
)

__all__ = [
    "TARGET_MODULES",
    "LoRALinear",
    "adapter_state_dict",
    "apply_lora",
    "init_lora",
    "lora_initial_value",
    "merge_lora",
]
