"""Model hyper-parameters and the published BLOOM shapes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ATTENTION_BACKENDS = ("sdpa", "flex", "triton")


@dataclass
class BloomArgs:
    """Shape and numerics of a BLOOM model. Every field is a hyper-parameter of the network."""

    n_layer: int = 2
    """Number of transformer blocks."""
    hidden_size: int = 64
    """Width of the residual stream; the MLP is 4x wider."""
    n_head: int = 4
    """Attention heads; any count (ALiBi slopes are defined for non powers of two)."""
    vocab_size: int = 512
    """Rows of the (tied) embedding; BLOOM pads its 250,680-token vocabulary to 250,880."""
    layer_norm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm."""
    init_std: float = 0.02
    """Std of the normal init; output projections use init_std / sqrt(2 * n_layer)."""
    attention: str = "sdpa"
    """Attention backend: "sdpa" (portable, additive ALiBi bias), "flex" (FlexAttention with an
    ALiBi score_mod, GPU) or "triton" (bloomnative's flash kernel with ALiBi in the kernel)."""
    fused_kernels: bool = False
    """Use bloomnative's fused LayerNorm and bias-GeLU kernels instead of the torch ops."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_head

    def __post_init__(self) -> None:
        if self.hidden_size % self.n_head:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by n_head={self.n_head}"
            )
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention={self.attention!r} is not one of {', '.join(ATTENTION_BACKENDS)}"
            )

    def num_params(self, include_embedding: bool = True) -> int:
        """Exact parameter count (the head is tied, so it adds nothing)."""
        h, v = self.hidden_size, self.vocab_size
        per_block = (
            4 * h + (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h)
        )
        total = self.n_layer * per_block + 2 * h  # final LayerNorm
        if include_embedding:
            total += v * h + 2 * h  # embedding + its LayerNorm
        return total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6N for the matmuls (N includes the tied head, which is a
        matmul) plus 12 * L * h * s for attention scores and values (forward and backward)."""
        n = self.num_params(include_embedding=True)
        return 6 * n + 12 * self.n_layer * self.hidden_size * seq_len

    @classmethod
    def from_preset(cls, name: str, **overrides) -> BloomArgs:
        """The published shapes (`bloom-560m` ... `bloom-176b`) or the CPU-sized `debug` model."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


_BLOOM_VOCAB = 250_880

PRESETS: dict[str, BloomArgs] = {
    "debug": BloomArgs(n_layer=4, hidden_size=192, n_head=6, vocab_size=8192),
    "bloom-560m": BloomArgs(n_layer=24, hidden_size=1024, n_head=16, vocab_size=_BLOOM_VOCAB),
    "bloom-1b1": BloomArgs(n_layer=24, hidden_size=1536, n_head=16, vocab_size=_BLOOM_VOCAB),
    "bloom-1b7": BloomArgs(n_layer=24, hidden_size=2048, n_head=16, vocab_size=_BLOOM_VOCAB),
    "bloom-3b": BloomArgs(n_layer=30, hidden_size=2560, n_head=32, vocab_size=_BLOOM_VOCAB),
    "bloom-7b1": BloomArgs(n_layer=30, hidden_size=4096, n_head=32, vocab_size=_BLOOM_VOCAB),
    "bloom-176b": BloomArgs(
        n_layer=70, hidden_size=14336, n_head=112, vocab_size=_BLOOM_VOCAB, init_std=0.0048
    ),
}
