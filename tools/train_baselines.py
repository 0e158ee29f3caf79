"""The models `tools/bench_train.py --baseline` compares bloomnative with, built at the shape of
the benchmarked BLOOM preset: Hugging Face's BloomForCausalLM, and torchtitan's Llama 3."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from bloomnative.model import BloomArgs

BASELINES = ("hf", "torchtitan")
LLAMA3_VOCAB = 128_256  # Llama 3's tokenizer


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """fp32 cross-entropy summed over the tokens: the trainer's loss before its division."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")


@dataclass
class BaselineModel:
    """A model to time with bloomnative's step (batches, schedule, clipping, AdamW)."""

    module: torch.nn.Module
    forward: Callable[[torch.Tensor], torch.Tensor]
    """token ids [batch, seq] -> logits [batch, seq, vocab]"""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(logits, labels) -> summed cross-entropy"""
    vocab_size: int
    """Token ids are taken modulo this (torchtitan's Llama 3 has a smaller vocabulary)."""
    flops_per_token: int
    """Training FLOPs per token by the baseline's own count."""
    details: dict = field(default_factory=dict)


def build_baseline(
    name: str, args: BloomArgs, seq_len: int, device: torch.device, seed: int, compiled: bool
) -> BaselineModel:
    builders = {"hf": build_hf, "torchtitan": build_torchtitan}
    return builders[name](args, seq_len, device, seed, compiled)


def build_hf(
    args: BloomArgs, seq_len: int, device: torch.device, seed: int, compiled: bool
) -> BaselineModel:
    """transformers' BloomForCausalLM with bloomnative's shape and dropout (random init, no KV
    cache; its dropout sits where bloomnative's does except after the embedding, which it
    lacks); `compiled`: torch.compile of the whole model."""
    from transformers import BloomConfig, BloomForCausalLM

    hf_config = BloomConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        layer_norm_epsilon=args.layer_norm_epsilon,
        initializer_range=args.init_std,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        use_cache=False,
    )
    torch.manual_seed(seed)
    model = BloomForCausalLM(hf_config).to(device).train()
    runner = torch.compile(model) if compiled else model
    return BaselineModel(
        module=model,
        forward=lambda inputs: runner(input_ids=inputs).logits,
        loss=summed_cross_entropy,
        vocab_size=args.vocab_size,
        flops_per_token=args.flops_per_token(seq_len),
        details={"model": "transformers BloomForCausalLM", "params": args.num_params()},
    )


def build_torchtitan(
    args: BloomArgs, seq_len: int, device: torch.device, seed: int, compiled: bool
) -> BaselineModel:
    """torchtitan's Llama 3 (its model code and initialisation) at BLOOM's width, depth and head
    count with Llama 3's vocabulary (BLOOM's if smaller): SwiGLU MLP, RMSNorm, RoPE, untied
    output layer, multi-head attention through SDPA, no dropout (Llama has none). At BLOOM-1b7's
    shape it has 1.7B parameters.
    `compiled`: what torchtitan's trainer does with compile.enable, each TransformerBlock
    compiled (its own apply_compile) and the loss compiled. FLOPs per token are torchtitan's
    count (6 x non-embedding parameters + 12 x layers x hidden x seq)."""
    from torchtitan.config.job_config import Compile
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs
    from torchtitan.models.llama3.infra.parallelize import apply_compile

    vocab = min(args.vocab_size, LLAMA3_VOCAB)
    llama_args = TransformerModelArgs(
        dim=args.hidden_size,
        n_layers=args.n_layer,
        n_heads=args.n_head,
        vocab_size=vocab,
        norm_eps=args.layer_norm_epsilon,
        max_seq_len=seq_len,
    )
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(llama_args)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    model.train()
    loss = summed_cross_entropy
    if compiled:
        apply_compile(model, Compile(enable=True, components=["model", "loss"]))
        loss = torch.compile(summed_cross_entropy)
    params, flops = llama_args.get_nparams_and_flops(model, seq_len)
    return BaselineModel(
        module=model,
        forward=model,
        loss=loss,
        vocab_size=vocab,
        flops_per_token=flops,
        details={
            "model": "torchtitan Llama 3 Transformer",
            "params": params,
            "dim": llama_args.dim,
            "n_layers": llama_args.n_layers,
            "n_heads": llama_args.n_heads,
            "ffn_hidden": model.layers["0"].feed_forward.w1.out_features,
            "vocab_size": vocab,
        },
    )
