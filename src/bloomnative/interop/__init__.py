"""Import and export: Hugging Face BLOOM folders and bloomnative's model-only DCP checkpoints,
Hugging Face folders and training checkpoints with a trimmed or extended vocabulary, and
Megatron-DeepSpeed checkpoints imported with their optimizer state and exported back as
DeepSpeed's universal checkpoint."""

from bloomnative.interop.checkpoint_model import load_native_model
from bloomnative.interop.hf import load_hf_model, save_hf_model
from bloomnative.interop.mds_export import export_mds_checkpoint
from bloomnative.interop.megatron_deepspeed import import_mds_checkpoint
from bloomnative.interop.native_checkpoint import CheckpointFormatError, save_native_checkpoint
from bloomnative.interop.vocabulary import VocabularyError, extend_hf_folder, trim_hf_folder
from bloomnative.interop.vocabulary_checkpoint import extend_checkpoint, trim_checkpoint

__all__ = [
    "CheckpointFormatError",
    "VocabularyError",
    "export_mds_checkpoint",
    "extend_checkpoint",
    "extend_hf_folder",
    "import_mds_checkpoint",
    "load_hf_model",
    "load_native_model",
    "save_hf_model",
    "save_native_checkpoint",
    "trim_checkpoint",
    "trim_hf_folder",
]
