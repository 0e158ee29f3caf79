#!/usr/bin/env python
"""The baseline of `tools/bench_finetune.py --baseline peft`: Hugging Face PEFT's LoRA on
transformers' BloomForCausalLM, trained from the same folder on the same corpus, with the batch,
sequence length, adapters (rank, alpha, target modules) and AdamW learning rate of the
bloomnative runs beside it; with `--quantize nf4`, QLoRA as PEFT users run it (bitsandbytes'
4-bit NF4 base with double quantisation, bf16 compute).

    python tools/peft_baseline.py --base DIR --corpus PREFIX --seq 256 --steps 3 --dtype bf16 \
        --rank 8 --alpha 16 --targets query_key_value [--quantize nf4] --json OUT

Writes OUT: each step's time (from the batch on the device to the optimizer's step done,
synchronised on CUDA), its loss, and the peak memory of the training steps by bloomnative's own
measure (`train.metrics.PeakMemory`: the allocator's peak on CUDA, the resident set on CPU), so
that the two sides read the same counter. Run in a process of its own (bench_finetune.py does),
so that its peak is its own.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from cli_args import ArgumentParser, whole_number

from bloomnative.data import IndexedDataset
from bloomnative.train.metrics import PeakMemory

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="Hugging Face BLOOM folder")
    parser.add_argument("--corpus", required=True, help="indexed dataset prefix")
    parser.add_argument("--seq", type=whole_number(1), default=256)
    parser.add_argument("--steps", type=whole_number(2), default=3)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--rank", type=whole_number(1), default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--targets", default="query_key_value", help="comma-separated")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--quantize", choices=("none", "nf4"), default="none")
    parser.add_argument("--json", dest="json_path", required=True)
    return parser.parse_args(argv)


def quantisation_unavailable(device: torch.device) -> str | None:
    """Why PEFT's QLoRA cannot run here, or None."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return "bitsandbytes is not installed (PEFT's QLoRA stores the base with it)"
    if device.type != "cuda":
        return "bitsandbytes' 4-bit layers need a CUDA device"
    return None


def load_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """The folder's BLOOM with PEFT's adapters, base frozen, in training mode."""
    from peft import LoraConfig, get_peft_model
    from transformers import BloomForCausalLM

    options: dict = {"dtype": DTYPES[args.dtype]}
    if args.quantize == "nf4":
        from transformers import BitsAndBytesConfig

        options["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
        options["device_map"] = {"": device.index or 0}
    model = BloomForCausalLM.from_pretrained(args.base, **options)
    if args.quantize == "none":
        model = model.to(device)
    adapters = LoraConfig(
        r=args.rank,
        lora_alpha=args.alpha,
        lora_dropout=0.0,
        target_modules=args.targets.split(","),
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, adapters)
    model.config.use_cache = False
    return model.train()


def batches(prefix: str, seq: int, steps: int) -> list[torch.Tensor]:
    """One sample of seq + 1 tokens per step, from the corpus's documents in order."""
    dataset = IndexedDataset(prefix)
    samples = []
    for step in range(steps):
        tokens = np.asarray(dataset[step % len(dataset)][: seq + 1], dtype=np.int64)
        samples.append(torch.from_numpy(tokens)[None])
    return samples


def train(args: argparse.Namespace, device: torch.device) -> dict:
    model = load_model(args, device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, fused=device.type == "cuda")
    peak = PeakMemory(device)
    peak.reset()
    step_s, losses = [], []
    for sample in batches(args.corpus, args.seq, args.steps):
        start = time.perf_counter()
        sample = sample.to(device)
        loss = model(input_ids=sample[:, :-1], labels=sample[:, :-1].clone()).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_s.append(time.perf_counter() - start)
        losses.append(loss.item())
    return {
        "trainable_parameters": sum(p.numel() for p in trainable),
        "step_s": step_s,
        "losses": losses,
        "mem_peak_gib": peak.interval_peak_gib(),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    skipped = quantisation_unavailable(device) if args.quantize == "nf4" else None
    result = {"skipped": skipped} if skipped else train(args, device)
    Path(args.json_path).write_text(json.dumps({"device": str(device), **result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
