"""The BLOOM model as plain `nn.Module`s; usable without the rest of bloomnative."""

from bloomnative.model.alibi import alibi_causal_bias, alibi_slopes
from bloomnative.model.args import PRESETS, BloomArgs
from bloomnative.model.bloom import Bloom, BloomAttention, BloomBlock, BloomMLP, LayerKVCache

__all__ = [
    "PRESETS",
    "Bloom",
    "BloomArgs",
    "BloomAttention",
    "BloomBlock",
    "BloomMLP",
    "LayerKVCache",
    "alibi_causal_bias",
    "alibi_slopes",
]
