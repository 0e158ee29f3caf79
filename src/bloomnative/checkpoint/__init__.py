"""Checkpoint folders: the trainer's sharded DCP checkpoints (`checkpointer`: save, verify,
rotate, async), how a run starts from its folder (`resume`: afresh, resumed, or from a model-only
checkpoint's or a Hugging Face folder's weights) and the checksum records that make a folder
complete and checkable (`integrity`: written as the files are, verified before anything is
loaded). The model-only checkpoints of `bloomnative.interop` and tools/generate.py use the same
records. See docs/checkpointing.md."""
