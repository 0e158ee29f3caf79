"""BLOOM in plain PyTorch.

word embedding -> embedding LayerNorm -> n_layer pre-LN blocks (ALiBi causal attention, tanh-GeLU
MLP) -> final LayerNorm -> lm head tied to the embedding. Dropout, when enabled, sits where
Megatron-DeepSpeed put it for BLOOM: after the embedding LayerNorm, on the attention
probabilities, and on the attention and MLP outputs before each residual add.

No parallelism here: `parallel/` applies it from outside. Layers sit in an `nn.ModuleDict`
keyed by index, and `forward` skips parts set to None, so a pipeline stage is this class with
entries removed. For sampling, `forward` takes an optional KV cache: after the prompt, each call
feeds only the new tokens (ALiBi needs no position ids: the bias depends on key - query distance
only).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from bloomnative.kernels import bias_gelu, layer_norm
from bloomnative.model.alibi import alibi_slopes
from bloomnative.model.args import BloomArgs
from bloomnative.model.attention import Segments, attention_backend, sdpa_alibi_attention


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """BLOOM's GeLU: the tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return F.gelu(x, approximate="tanh")


class FusedLayerNorm(nn.LayerNorm):
    """nn.LayerNorm computed by bloomnative's Triton kernel (same parameters, same state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, eps=self.eps)


def make_layer_norm(args: BloomArgs) -> nn.LayerNorm:
    cls = FusedLayerNorm if args.fused_kernels else nn.LayerNorm
    return cls(args.hidden_size, eps=args.layer_norm_epsilon)


class LayerKVCache:
    """One attention layer's keys and values of the tokens processed so far,
    [batch, heads, tokens, head_dim] each."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends the new tokens' keys and values; returns those of all tokens so far."""
        if self.k is not None and self.v is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        return k, v


class BloomAttention(nn.Module):
    """Fused QKV projection stored per head as [q, k, v] (the Hugging Face / Megatron layout), so
    a shard of dim 0 by whole heads is a tensor-parallel shard; ALiBi + causal attention."""

    alibi_slopes: torch.Tensor  # a buffer: the slopes of the heads in `head_range`

    def __init__(self, args: BloomArgs):
        super().__init__()
        self.n_head = args.n_head
        self.head_dim = args.head_dim
        self.query_key_value = nn.Linear(args.hidden_size, 3 * args.hidden_size)
        self.dense = nn.Linear(args.hidden_size, args.hidden_size)
        self.attend = attention_backend(args.attention)
        self.dropout = args.attention_dropout
        # The heads this module computes: all of them, or a tensor-parallel rank's slice.
        self.head_range = (0, args.n_head)
        self.register_buffer("alibi_slopes", alibi_slopes(args.n_head), persistent=False)

    def reset_alibi_slopes(self) -> None:
        start, end = self.head_range
        slopes = alibi_slopes(self.n_head)[start:end]
        self.alibi_slopes = slopes.to(self.alibi_slopes.device)

    def forward(
        self,
        x: torch.Tensor,
        cache: LayerKVCache | None = None,
        segments: Segments | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 instead of n_head: under tensor parallelism this rank holds a subset of the heads.
        qkv = self.query_key_value(x).view(batch, seq, -1, 3, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=3))  # each [b, heads, s, d]
        dropout = self.dropout if self.training else 0.0
        if cache is None:
            out = self.attend(q, k, v, self.alibi_slopes, dropout, segments)
        else:  # the new queries attend to every cached key: the portable path allows q_len < k_len
            if segments is not None:
                raise ValueError("a KV cache (generation) attends to one sequence: no segments")
            k, v = cache.extend(k, v)
            out = sdpa_alibi_attention(q, k, v, self.alibi_slopes, dropout)
        return self.dense(out.transpose(1, 2).reshape(batch, seq, -1))


class BloomMLP(nn.Module):
    def __init__(self, args: BloomArgs):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(args.hidden_size, 4 * args.hidden_size)
        self.dense_4h_to_h = nn.Linear(4 * args.hidden_size, args.hidden_size)
        self.fused_bias_gelu = args.fused_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_bias_gelu:
            up = self.dense_h_to_4h
            return self.dense_4h_to_h(bias_gelu(F.linear(x, up.weight), up.bias))
        return self.dense_4h_to_h(gelu_tanh(self.dense_h_to_4h(x)))


class BloomBlock(nn.Module):
    """Pre-LN block: x + dropout(attn(LN(x))), then + dropout(mlp(LN(.)))."""

    def __init__(self, args: BloomArgs):
        super().__init__()
        self.input_layernorm = make_layer_norm(args)
        self.self_attention = BloomAttention(args)
        self.post_attention_layernorm = make_layer_norm(args)
        self.mlp = BloomMLP(args)
        self.hidden_dropout = nn.Dropout(args.hidden_dropout)

    def forward(
        self,
        x: torch.Tensor,
        cache: LayerKVCache | None = None,
        segments: Segments | None = None,
    ) -> torch.Tensor:
        attention = self.self_attention(self.input_layernorm(x), cache=cache, segments=segments)
        x = x + self.hidden_dropout(attention)
        return x + self.hidden_dropout(self.mlp(self.post_attention_layernorm(x)))


class Bloom(nn.Module):
    """The BLOOM language model: `logits = model(input_ids)`.

    Build on the meta device and call `init_weights()` after materialising (`to_empty`) so a
    large model is never allocated whole on one rank before it is sharded.
    """

    # None on a pipeline stage that does not hold the part.
    word_embeddings: nn.Embedding | None
    word_embeddings_layernorm: nn.LayerNorm | None
    ln_f: nn.LayerNorm | None
    lm_head: nn.Linear | None

    def __init__(self, args: BloomArgs):
        super().__init__()
        self.args = args
        self.word_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.word_embeddings_layernorm = make_layer_norm(args)
        self.embedding_dropout = nn.Dropout(args.hidden_dropout)
        self.layers = nn.ModuleDict({str(i): BloomBlock(args) for i in range(args.n_layer)})
        self.ln_f = make_layer_norm(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()
        # Set by a trainer whose loss applies the head itself (a fused, chunked lm head +
        # cross-entropy that never holds all the logits): forward then stops before the head.
        self.head_in_loss = False

    def tie_weights(self) -> None:
        """Makes the head share the embedding's parameter. Needed again after `to_empty`, which
        gives each module its own new tensor."""
        if self.word_embeddings is not None and self.lm_head is not None:
            self.lm_head.weight = self.word_embeddings.weight

    def forward(
        self,
        tokens: torch.Tensor,
        cache: dict[str, LayerKVCache] | None = None,
        segments: Segments | None = None,
    ) -> torch.Tensor:
        """tokens: int ids [batch, seq] (or, on a later pipeline stage, hidden states
        [batch, seq, hidden]). Returns logits [batch, seq, vocab], or hidden states when this
        stage has no lm head. With a `cache` (from `new_kv_cache`), `tokens` are the ones that
        follow the cached tokens, and their keys and values are added to it. `segments`: for
        packed sequences, where each token's segment starts and ends (``Segments``): attention
        stays inside a segment, so each one is computed as if it were alone."""
        h = tokens
        if self.word_embeddings is not None and self.word_embeddings_layernorm is not None:
            h = self.embedding_dropout(self.word_embeddings_layernorm(self.word_embeddings(h)))
        for name, layer in self.layers.items():
            h = layer(h, cache=None if cache is None else cache[name], segments=segments)
        if self.ln_f is not None:
            h = self.ln_f(h)
        if self.lm_head is not None and not self.head_in_loss:
            h = self.lm_head(h)
        return h

    def blocks(self) -> Iterator[BloomBlock]:
        """The transformer blocks this model (or pipeline stage) holds, in order."""
        return (cast(BloomBlock, block) for block in self.layers.values())

    def new_kv_cache(self) -> dict[str, LayerKVCache]:
        """An empty KV cache for incremental decoding, one entry per layer."""
        return {name: LayerKVCache() for name in self.layers}

    def initial_value(self, name: str, like: torch.Tensor, seed: int) -> torch.Tensor:
        """The initial value of parameter `name`, full-size, on `like`'s device.

        Normal(0, init_std) for matrices, scaled by 1/sqrt(2 n_layer) for the two output
        projections (GPT-2 / Megatron), zero biases, LayerNorms to 1 and 0. Each parameter draws
        from its own generator seeded by (seed, name), so the values do not depend on which
        parameters a rank holds: every parallel layout starts from the same weights, and the
        tied head on a last pipeline stage starts equal to the embedding on the first.
        """
        if name == "lm_head.weight":
            name = "word_embeddings.weight"
        if name.endswith("layernorm.weight") or name == "ln_f.weight":
            return torch.ones(like.shape, dtype=like.dtype, device=like.device)
        if name.endswith(".bias"):
            return torch.zeros(like.shape, dtype=like.dtype, device=like.device)
        std = self.args.init_std
        if name.endswith(("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")):
            std /= math.sqrt(2 * self.args.n_layer)
        device = like.device if like.device.type == "cuda" else torch.device("cpu")
        generator = torch.Generator(device=device).manual_seed(
            seed * 1_000_003 + zlib.crc32(name.encode())
        )
        value = torch.empty(like.shape, dtype=torch.float32, device=device)
        value.normal_(mean=0.0, std=std, generator=generator)
        return value.to(device=like.device, dtype=like.dtype)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Fills every parameter with `initial_value` and recomputes the ALiBi slope buffers.
        For a model whose parameters are DTensors use `bloomnative.parallel.init_weights`."""
        for name, param in self.named_parameters():
            param.copy_(self.initial_value(name, param, seed))
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Non-persistent buffers (ALiBi slopes); needed after `to_empty`."""
        for module in self.modules():
            if isinstance(module, BloomAttention):
                module.reset_alibi_slopes()

    @classmethod
    def from_pretrained_hf(cls, hf_dir: str, **overrides) -> Bloom:
        """Loads a Hugging Face BLOOM folder (config.json + safetensors) as an fp32 model."""
        from bloomnative.interop.hf import load_hf_model

        return load_hf_model(hf_dir, **overrides)

    def save_pretrained_hf(self, out_dir: str, dtype: torch.dtype = torch.float32) -> None:
        """Writes a folder that `transformers.BloomForCausalLM.from_pretrained` loads."""
        from bloomnative.interop.hf import save_hf_model

        save_hf_model(self, out_dir, dtype=dtype)
