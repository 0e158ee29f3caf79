#!/usr/bin/env python3
"""Sample text from a checkpoint; prints the prompt followed by the completion on stdout.

    python tools/generate.py --checkpoint outputs/debug --prompt "The list type" \\
        --max-new-tokens 80 --temperature 0.8 --top-k 40 --seed 1

--checkpoint is a dump folder (its newest checkpoint and config.toml), a checkpoints/step-N
folder saved under any parallel layout, or a Hugging Face folder. The model is loaded whole into
this process (no torchrun). Generation stops early at the end-of-document token. The same seed
gives the same text. The logic is bloomnative.generate.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run from a checkout without installing: the package lives in ../src.
from bloomnative.generate import (
    Sampling,
    load_model,
    load_tokenizer_for,
    sample_text,
)
from bloomnative.interop import CheckpointFormatError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="generate.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--checkpoint", required=True, type=Path, help="dump folder, step-N folder or HF folder"
    )
    parser.add_argument("--prompt", default="", help="text to continue (empty: a new document)")
    parser.add_argument("--max-new-tokens", type=int, default=100, help="tokens to add at most")
    parser.add_argument(
        "--temperature", type=float, default=1.0, help="divides the logits; 0 is greedy"
    )
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest (0: all)")
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="sample from the likeliest tokens holding p"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    parser.add_argument("--device", default="auto", help='"auto" (CUDA if present), "cpu", "cuda"')
    parser.add_argument(
        "--tokenizer", type=Path, help="tokenizer.json (default: the checkpoint's own)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.max_new_tokens < 0:
            raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
        sampling = Sampling(args.temperature, args.top_k, args.top_p)
        model = load_model(args.checkpoint, args.device)
        tokenizer = load_tokenizer_for(args.checkpoint, args.tokenizer)
        text = sample_text(model, tokenizer, args.prompt, args.max_new_tokens, sampling, args.seed)
    except (CheckpointFormatError, FileNotFoundError, ValueError) as e:
        print(f"generate.py: error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
