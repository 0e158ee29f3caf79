"""Tiny Hugging Face BLOOM models with random weights, made on the fly (no hub downloads).

Imported by the tests of this folder (pytest puts the folder on sys.path).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Gives every parameter random values, LayerNorm weights around 1 and non-zero biases, so a
    misplaced bias or norm shows up in the outputs."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "layernorm" in name or "ln_f" in name:
                param.copy_(1.0 + 0.1 * noise if name.endswith("weight") else 0.1 * noise)
            else:
                param.copy_(0.1 * noise)


def make_hf_bloom(
    hidden_size: int, n_head: int, n_layer: int, vocab_size: int, seed: int = 0
) -> transformers.BloomForCausalLM:
    """A transformers BloomForCausalLM in eval mode with random weights."""
    config = transformers.BloomConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, n_head=n_head, n_layer=n_layer
    )
    torch.manual_seed(seed)
    model = transformers.BloomForCausalLM(config).eval()
    randomize_(model, seed)
    return model


def save_hf_bloom(model: transformers.BloomForCausalLM, folder: Path, **kwargs) -> Path:
    """Saves with transformers' own save_pretrained and returns the folder."""
    model.save_pretrained(folder, **kwargs)
    return folder


def tokens(vocab_size: int, batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=generator)


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """max |ours - reference| / max |reference|."""
    ours, reference = ours.detach().float(), reference.detach().float()
    return ((ours - reference).abs().max() / reference.abs().max()).item()
