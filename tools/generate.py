#!/usr/bin/env python3
"""Sample text from a checkpoint; prints the prompt followed by the completion on stdout.

    python tools/generate.py --checkpoint outputs/debug --prompt "The list type" \\
        --max-new-tokens 80 --temperature 0.8 --top-k 40 --seed 1

--checkpoint is a dump folder (its newest checkpoint and config.toml), a checkpoints/step-N
folder saved under any parallel layout, or a Hugging Face folder. The model is loaded whole into
this process (no torchrun). Generation stops early at the end-of-document token. The same seed
gives the same text. --max-new-tokens may not ask for more than the KV cache can hold in the
memory available on the device. The logic is bloomnative.generate.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from cli_args import ArgumentParser, number, whole_number

# Run from a checkout without installing: the package lives in ../src.
from bloomnative.generate import (
    Sampling,
    load_model,
    load_tokenizer_for,
    sample_text,
)
from bloomnative.interop import CheckpointFormatError
from bloomnative.model import Bloom


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        prog="generate.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--checkpoint", required=True, type=Path, help="dump folder, step-N folder or HF folder"
    )
    parser.add_argument("--prompt", default="", help="text to continue (empty: a new document)")
    parser.add_argument(
        "--max-new-tokens", type=whole_number(0), default=100, help="tokens to add at most"
    )
    parser.add_argument(
        "--temperature", type=number(0), default=1.0, help="divides the logits; 0 is greedy"
    )
    parser.add_argument(
        "--top-k", type=whole_number(0), default=0, help="sample from the k likeliest (0: all)"
    )
    parser.add_argument(
        "--top-p",
        type=number(0, above=True, most=1),
        default=1.0,
        help="sample from the likeliest tokens holding p",
    )
    parser.add_argument("--seed", type=whole_number(0), default=0, help="seed of the sampling")
    parser.add_argument("--device", default="auto", help='"auto" (CUDA if present), "cpu", "cuda"')
    parser.add_argument(
        "--tokenizer", type=Path, help="tokenizer.json (default: the checkpoint's own)"
    )
    return parser.parse_args(argv)


def kv_cache_bytes_per_token(model: Bloom) -> int:
    """Bytes the KV cache grows by per token: a key and a value of hidden_size per layer."""
    args, itemsize = model.args, next(model.parameters()).element_size()
    return 2 * args.n_layer * args.hidden_size * itemsize


def available_bytes(device: torch.device) -> int:
    """Memory free for the cache: the device's free memory on CUDA, else the host's available
    memory (MemAvailable)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable line")


def check_tokens_fit(model: Bloom, prompt_tokens: int, max_new_tokens: int) -> None:
    """Raises ValueError, naming the largest --max-new-tokens that fits, when the KV cache of
    the prompt and `max_new_tokens` more tokens would not fit the memory available now."""
    device = next(model.parameters()).device
    per_token, free = kv_cache_bytes_per_token(model), available_bytes(device)
    if (prompt_tokens + max_new_tokens) * per_token <= free:
        return
    fits = max(free // per_token - prompt_tokens, 0)
    raise ValueError(
        f"--max-new-tokens {max_new_tokens}: the KV cache of the prompt and that many tokens "
        f"needs {(prompt_tokens + max_new_tokens) * per_token / 2**30:.1f} GiB, more than the "
        f"{free / 2**30:.1f} GiB available on {device}; at most {fits} fit"
    )


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 printed the text, 2 a bad argument or checkpoint (one line)."""
    args = parse_args(argv)
    try:
        sampling = Sampling(args.temperature, args.top_k, args.top_p)
        model = load_model(args.checkpoint, args.device)
        tokenizer = load_tokenizer_for(args.checkpoint, args.tokenizer)
        check_tokens_fit(model, len(tokenizer.encode(args.prompt)) or 1, args.max_new_tokens)
        text = sample_text(model, tokenizer, args.prompt, args.max_new_tokens, sampling, args.seed)
    except (CheckpointFormatError, OSError, ValueError) as e:
        print(f"generate.py: error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
