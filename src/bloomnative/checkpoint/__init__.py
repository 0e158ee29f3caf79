"""Checkpoint folders: the trainer's sharded DCP checkpoints (`checkpointer`: save, verify,
resume, rotate, async) and the checksum records that make a folder complete and checkable
(`integrity`: written as the files are, verified before anything is loaded). The model-only
checkpoints of `bloomnative.interop` and tools/generate.py use the same records. See
docs/checkpointing.md."""
