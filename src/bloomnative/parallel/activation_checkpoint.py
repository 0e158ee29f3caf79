"""Activation checkpointing: recompute a block's activations in backward instead of storing
them (Megatron's "full" recompute, or every N-th block for "selective"). With dropout the
recomputation replays the random state of the forward, so it draws the same masks."""

from __future__ import annotations

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from bloomnative.model import Bloom


def apply_activation_checkpointing(model: Bloom, mode: str, every: int = 2) -> None:
    """Wraps blocks of `model` (a `Bloom` or a pipeline stage of it) in place so that backward
    recomputes their activations: mode "full" every block, "selective" the blocks whose index
    is a multiple of `every`, "none" nothing.

    Where it goes among the plans, and why: docs/architecture.md (the order of the parallel
    plans).
    """
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"activation_checkpoint.mode = {mode!r}; valid: none, full, selective")
    if mode == "selective" and every < 1:
        raise ValueError(f"activation_checkpoint.every must be >= 1, got {every}")
    for name, block in list(model.layers.items()):
        if mode == "full" or int(name) % every == 0:
            model.layers[name] = checkpoint_wrapper(
                block, preserve_rng_state=model.args.uses_dropout
            )


def canonical_name(name: str) -> str:
    """A parameter name without the prefixes that wrappers insert (checkpoint, compile)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
