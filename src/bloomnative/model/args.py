"""Model hyper-parameters and the published BLOOM shapes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from bloomnative.model.attention import ATTENTION_BACKENDS, TRAITS, AttentionBackend, backends_with


@dataclass
class BloomArgs:
    """Shape and numerics of a BLOOM model. Every field is a hyper-parameter of the network."""

    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = ("n_layer", "hidden_size", "n_head", "vocab_size")
    """The fields that define the model's shape: a config overrides them one by one (0 keeps the
    preset's), and a checkpoint or Hugging Face folder loads only into a model that has them
    all equal."""

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
    hidden_dropout: float = 0.0
    """Dropout on the embedding output (after its LayerNorm) and on the attention and MLP
    outputs before each residual add, in training mode (Megatron's --hidden-dropout)."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities, in training mode (Megatron's
    --attention-dropout); not available with the "flex" backend."""
    attention: AttentionBackend = "sdpa"
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
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1)")
        if self.attention_dropout and not TRAITS[self.attention].dropout:
            choices = " or ".join(repr(name) for name in backends_with("dropout"))
            raise ValueError(
                f"attention_dropout={self.attention_dropout} needs attention {choices}: "
                f"{TRAITS[self.attention].title} has no dropout"
            )

    @property
    def uses_dropout(self) -> bool:
        """Whether training draws random numbers (any dropout probability above 0)."""
        return self.hidden_dropout > 0 or self.attention_dropout > 0

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

    def flops_per_token(self, seq_len: int, adapter_params: int = 0) -> int:
        """Training FLOPs per token: 6N for the matmuls (forward, input gradient and weight
        gradient; N includes the tied head, which is a matmul) plus 12 * L * h * s for attention
        scores and values (forward and backward). With `adapter_params` > 0 (LoRA adapters) the
        model's N weights are frozen and get no weight gradient: 4N for them, and 6 per adapter
        parameter."""
        n = self.num_params(include_embedding=True)
        matmuls = 4 * n + 6 * adapter_params if adapter_params else 6 * n
        return matmuls + 12 * self.n_layer * self.hidden_size * seq_len

    @classmethod
    def from_preset(cls, name: str, **overrides) -> BloomArgs:
        """The published shapes (`bloom-560m` ... `bloom-176b`) or the CPU-sized `debug` model."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


_BLOOM_VOCAB = 250_880
# Every BigScience tr11 script (train/tr11-176B-ml/tr11-176B-ml.slurm and smaller_models/*.slurm
# of github.com/bigscience-workshop/bigscience) passes --init-method-std 0.0048.
_BLOOM_INIT_STD = 0.0048


def _bloom(n_layer: int, hidden_size: int, n_head: int) -> BloomArgs:
    return BloomArgs(
        n_layer=n_layer,
        hidden_size=hidden_size,
        n_head=n_head,
        vocab_size=_BLOOM_VOCAB,
        init_std=_BLOOM_INIT_STD,
    )


PRESETS: dict[str, BloomArgs] = {
    "debug": BloomArgs(n_layer=4, hidden_size=192, n_head=6, vocab_size=8192),
    # The published names, with the script that trained each: tr11e-350M-ml, tr11d-760M-ml,
    # tr11b-1B3-ml, tr11c-2B5-ml, tr11f-6B3-ml (named before the 250k vocabulary was counted)
    # and tr11-176B-ml.
    "bloom-560m": _bloom(24, 1024, 16),
    "bloom-1b1": _bloom(24, 1536, 16),
    "bloom-1b7": _bloom(24, 2048, 16),
    "bloom-3b": _bloom(30, 2560, 32),
    "bloom-7b1": _bloom(30, 4096, 32),
    "bloom-176b": _bloom(70, 14336, 112),
}
