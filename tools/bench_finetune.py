#!/usr/bin/env python
"""Peak memory and step time of the three ways to fine-tune a BLOOM, side by side in one run:
a full fine-tune (every weight trains, fp32 AdamW state), LoRA (adapters on a frozen base held
in the run's dtype) and QLoRA (the same adapters on a base whose block linears are NF4); with
`--baseline peft`, also Hugging Face PEFT's LoRA and QLoRA on transformers' BloomForCausalLM
from the same folder (tools/peft_baseline.py; its QLoRA needs bitsandbytes and a CUDA device,
and is reported as skipped, with the reason, where they are missing).

    PYTHONPATH=src python tools/bench_finetune.py [--layers 24 --hidden 1024 --heads 16
        --vocab 250880] [--seq 256] [--steps 3] [--dtype bf16] [--rank 8] [--alpha 16]
        [--targets query_key_value] [--modes full,lora,qlora] [--baseline peft] [--work DIR]
        [--json OUT]

The defaults are BLOOM-560m's shape. The script writes a random base of that shape as a Hugging
Face folder and a corpus of random tokens under --work, then runs the real trainer
(`python -m bloomnative.train.main`) once per mode, each in its own process so that each has its
own peak, one after the other, from that folder (`checkpoint.initial_hf`), micro and global batch
1, no checkpoints, no validation. Reported per mode, from its metrics.jsonl: the step time of
every step (tokens of the step / its tokens_per_sec) and their median after the first (which
includes the first-call costs); `mem_peak_gib`, the trainer's peak resident set while training
(train/metrics.py PeakMemory); and the process's peak resident set from start to end
(`wait4`'s ru_maxrss, which includes reading the folder and, for QLoRA, the base whole before
it is quantised). A PEFT run reports its own step times (synchronised on CUDA) and the same
two peaks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from cli_args import ArgumentParser, whole_number

from bloomnative.data import IndexedDatasetBuilder
from bloomnative.model import Bloom, BloomArgs

REPO = Path(__file__).resolve().parents[1]
MODES = ("full", "lora", "qlora")
PEFT_MODES = {"peft lora": "none", "peft qlora": "nf4"}
"""PEFT's runs, by the quantisation of their base."""
CORPUS_DOCUMENTS = 64
LR = 1e-4
"""AdamW's learning rate in every run, bloomnative's and PEFT's."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=whole_number(1), default=24)
    parser.add_argument("--hidden", type=whole_number(1), default=1024)
    parser.add_argument("--heads", type=whole_number(1), default=16)
    parser.add_argument("--vocab", type=whole_number(1), default=250880)
    parser.add_argument(
        "--seq", type=whole_number(1), default=256, help="sequence length (batch: 1)"
    )
    parser.add_argument(
        "--steps", type=whole_number(2), default=3, help="steps per mode, the first untimed"
    )
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument(
        "--rank", type=whole_number(1), default=8, help="the adapters' rank (LoRA, QLoRA)"
    )
    parser.add_argument("--alpha", type=float, default=16.0, help="lora.alpha (PEFT's lora_alpha)")
    parser.add_argument("--targets", default="query_key_value", help="lora.target_modules")
    parser.add_argument(
        "--modes", default=",".join(MODES), help=f"bloomnative's runs, some of {','.join(MODES)}"
    )
    parser.add_argument(
        "--baseline", choices=("none", "peft"), default="none", help="also PEFT's LoRA and QLoRA"
    )
    parser.add_argument("--work", help="folder for the base, the corpus and the runs (temporary)")
    parser.add_argument("--json", dest="json_path", help="write the report here ('-': stdout)")
    args = parser.parse_args(argv)
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        parser.error(f"--modes {args.modes}: {', '.join(sorted(unknown))} is not one of {MODES}")
    return args


def write_base(args: argparse.Namespace, folder: Path) -> BloomArgs:
    """A random BLOOM of the benchmark's shape as a Hugging Face folder (bf16 weights)."""
    shape = BloomArgs(
        n_layer=args.layers, hidden_size=args.hidden, n_head=args.heads, vocab_size=args.vocab
    )
    model = Bloom(shape)
    model.init_weights(seed=0)
    model.save_pretrained_hf(str(folder), dtype=torch.bfloat16)
    return shape


def write_corpus(prefix: Path, vocab: int, seq: int) -> str:
    """Documents of random tokens, enough for every step's sample."""
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(str(prefix), vocab_size=vocab) as builder:
        for _ in range(CORPUS_DOCUMENTS):
            builder.add_document(rng.integers(0, vocab, 2 * seq))
    return str(prefix)


def trainer_argv(args: argparse.Namespace, mode: str, base: Path, corpus: str, dump: Path):
    """The trainer's command-line overrides for one mode."""
    argv = [
        f"--model.n_layer={args.layers}",
        f"--model.hidden_size={args.hidden}",
        f"--model.n_head={args.heads}",
        f"--model.vocab_size={args.vocab}",
        "--model.attention=sdpa",
        f"--training.seq_len={args.seq}",
        "--training.global_batch_size=1",
        "--training.micro_batch_size=1",
        f"--training.steps={args.steps}",
        f"--training.dtype={args.dtype}",
        f"--optimizer.lr={LR}",
        "--lr_scheduler.warmup_steps=0",
        f"--data.blend={corpus}",
        "--data.split=1000,0,0",
        "--data.tokenizer=",
        "--data.prefetch=false",
        f"--checkpoint.initial_hf={base}",
        "--checkpoint.enable=false",
        "--validation.freq=0",
        "--validation.sample_tokens=0",
        "--metrics.log_freq=1",
        "--metrics.tensorboard=false",
        f"--job.dump_folder={dump}",
    ]
    if mode != "full":
        argv += [
            f"--lora.rank={args.rank}",
            f"--lora.alpha={args.alpha}",
            f"--lora.target_modules={args.targets}",
        ]
    if mode == "qlora":
        argv.append("--lora.quantize_base=nf4")
    return argv


def run_mode(program: list[str], log: Path) -> int:
    """Runs `python PROGRAM...` (the trainer, or PEFT's baseline) in a process of its own, its
    output in `log`; returns that process's peak resident set in bytes. Raises RuntimeError,
    with the log's last lines, if it fails."""
    env = dict(os.environ)
    path = [str(REPO / "src"), str(REPO / "tools"), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, path))
    command = [sys.executable, *program]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        tail = "\n".join(log.read_text().splitlines()[-20:])
        raise RuntimeError(f"{program[:2]} exited with {process.returncode}; {log} ends:\n{tail}")
    return usage.ru_maxrss * 1024  # KiB on Linux


def summarize(mode: str, dump: Path, seq: int, peak_rss: int) -> dict:
    """One mode's figures from its metrics.jsonl and its process's peak."""
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "loss" in row]
    step_s = [seq / row["tokens_per_sec"] for row in rows]
    return {
        "mode": mode,
        "steps": len(rows),
        "step_s": step_s,
        "median_step_s": statistics.median(step_s[1:]),
        "mem_peak_gib": max(row["mem_peak_gib"] for row in rows),
        "process_peak_rss_gib": peak_rss / 2**30,
        "losses": [row["loss"] for row in rows],
    }


def peft_argv(args: argparse.Namespace, quantize: str, base: Path, corpus: str, out: Path):
    """tools/peft_baseline.py's arguments: the bloomnative runs' batch, adapters and lr."""
    return [
        str(REPO / "tools" / "peft_baseline.py"),
        *("--base", str(base), "--corpus", corpus, "--seq", str(args.seq)),
        *("--steps", str(args.steps), "--dtype", args.dtype, "--rank", str(args.rank)),
        *("--alpha", str(args.alpha), "--targets", args.targets, "--lr", str(LR)),
        *("--quantize", quantize, "--json", str(out)),
    ]


def summarize_peft(mode: str, result: dict, peak_rss: int) -> dict:
    """One PEFT run's figures in summarize's terms (or why it was skipped)."""
    if result.get("skipped"):
        return {"mode": mode, "skipped": result["skipped"]}
    return {
        "mode": mode,
        "steps": len(result["step_s"]),
        "step_s": result["step_s"],
        "median_step_s": statistics.median(result["step_s"][1:]),
        "mem_peak_gib": result["mem_peak_gib"],
        "process_peak_rss_gib": peak_rss / 2**30,
        "losses": result["losses"],
        "trainable_parameters": result["trainable_parameters"],
    }


def environment() -> dict:
    """Where and with what the figures were measured."""
    import torchao

    return {
        "date": datetime.date.today().isoformat(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_average_1min": os.getloadavg()[0],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchao": torchao.__version__,
    }


def format_table(runs: list[dict]) -> str:
    lines = [f"{'mode':10} {'median step':>12} {'mem_peak_gib':>13} {'process peak':>13}"]
    for r in runs:
        if "skipped" in r:
            lines.append(f"{r['mode']:10} skipped: {r['skipped']}")
            continue
        lines.append(
            f"{r['mode']:10} {r['median_step_s']:>10.2f} s {r['mem_peak_gib']:>9.2f} GiB "
            f"{r['process_peak_rss_gib']:>9.2f} GiB"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(args.work or scratch)
        work.mkdir(parents=True, exist_ok=True)
        shape = write_base(args, work / "base")
        corpus = write_corpus(work / "corpus", args.vocab, args.seq)
        runs = []
        for mode in args.modes.split(","):
            dump = work / mode
            argv_mode = trainer_argv(args, mode, work / "base", corpus, dump)
            program = ["-m", "bloomnative.train.main", *argv_mode]
            peak = run_mode(program, work / f"{mode}.log")
            runs.append(summarize(mode, dump, args.seq, peak))
        for mode, quantize in PEFT_MODES.items() if args.baseline == "peft" else ():
            out = work / f"{mode.replace(' ', '_')}.json"
            program = peft_argv(args, quantize, work / "base", corpus, out)
            peak = run_mode(program, work / f"{mode.replace(' ', '_')}.log")
            runs.append(summarize_peft(mode, json.loads(out.read_text()), peak))
    report = {
        "environment": environment(),
        "shape": {"parameters": shape.num_params(), **vars(args)},
        "runs": runs,
    }
    print(format_table(runs))
    if args.json_path == "-":
        print(json.dumps(report, indent=2))
    elif args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
