"""Import and export: Hugging Face BLOOM folders and bloomnative's model-only DCP checkpoints."""

from bloomnative.interop.checkpoint_model import load_native_model
from bloomnative.interop.hf import load_hf_model, save_hf_model
from bloomnative.interop.native_checkpoint import CheckpointFormatError, save_native_checkpoint

__all__ = [
    "CheckpointFormatError",
    "load_hf_model",
    "load_native_model",
    "save_hf_model",
    "save_native_checkpoint",
]
