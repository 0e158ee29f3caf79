"""Parameter-efficient fine-tuning, applied from outside the model like the parallel plans:
low-rank adapters (`lora`) with Hugging Face PEFT's names and initialisation, and PEFT's adapter
folders (`peft`)."""

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
    "read_peft_adapter",
    "save_peft_adapter",
]
