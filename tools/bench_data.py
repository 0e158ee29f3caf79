#!/usr/bin/env python3
"""Measure the data pipeline: preprocessing, sample-index and blend builds, the loader.

    python tools/bench_data.py                      # everything, prints Markdown
    python tools/bench_data.py --only loader index  # some sections

Sections:
  preprocess  tokens/s of tools/preprocess_data.py's logic on the bundled corpus, per --workers
  index       build_sample_index over 1e9 tokens in 2M synthetic documents (seq_len 2048)
  blend       blend order build time, and how far each rule lets counts drift from their share
  loader      samples/s and tokens/s of GPTDataset and PretrainingLoader on one thread
  check       preflight's check_indexed_dataset on a 1e9-token dataset (2M documents), uint16
              (vocab 8192) and int32 (vocab 250,880), from the page cache and from disk, and the
              whole preflight command; the files go to a temporary folder, removed afterwards
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bloomnative.data import (
    GPTDataset,
    IndexedDataset,
    IndexedDatasetBuilder,
    build_blending_indices,
    build_sample_index,
    check_indexed_dataset,
)
from bloomnative.data.indexed_format import write_index
from bloomnative.data.preprocess import PreprocessConfig, preprocess

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "pydocs"
STEP_SECONDS = 0.05


def timed(fn, repeats: int = 3) -> float:
    """Median seconds of ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_preprocess(workers: list[int]) -> None:
    """Wall-clock rates (best of 2) and, steadier on a shared machine, tokens per CPU-second
    of the worker processes."""
    print(
        "| workers | documents/s | tokens/s | MB/s | tokens per worker CPU-second |\n"
        "| --- | --- | --- | --- | --- |"
    )
    for count in workers:
        best = None
        for _ in range(2):
            with tempfile.TemporaryDirectory() as tmp:
                config = PreprocessConfig(
                    inputs=(str(ASSETS / "pydocs.jsonl.gz"),),
                    tokenizer=str(ASSETS / "tokenizer.json"),
                    output_prefix=f"{tmp}/bench",
                    workers=count,
                    append_eod=True,
                )
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                summary = preprocess(config, log=lambda message: None)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            if best is None or summary.seconds < best[0].seconds:
                best = (summary, cpu)
        summary, cpu = best
        s = summary.seconds
        print(
            f"| {count} | {summary.documents / s:,.0f} | {summary.tokens / s:,.0f} | "
            f"{summary.input_bytes / 1e6 / s:.2f} | {summary.tokens / cpu:,.0f} |"
        )


def synthetic_sizes(num_documents: int, total_tokens: int, seed: int = 0) -> np.ndarray:
    """Log-normal document lengths (median ~400 tokens, long tail) scaled to total_tokens."""
    lengths = np.random.default_rng(seed).lognormal(6.0, 1.0, num_documents)
    return np.maximum(1, lengths / lengths.sum() * total_tokens).astype(np.int32)


def bench_index() -> None:
    sizes = synthetic_sizes(2_000_000, 1_000_000_000)
    documents = np.arange(len(sizes))
    tokens = int(sizes.sum())
    print("| build | samples | seconds |\n| --- | --- | --- |")
    for epochs in (1.0, 3.5):
        num_samples = int(tokens * epochs) // 2048
        seconds = timed(lambda n=num_samples: build_sample_index(sizes, documents, 2048, n, 1234))
        print(f"| {tokens:,} tokens x {epochs} epochs | {num_samples:,} | {seconds:.2f} |")


def _megatron_rule_order(weights: np.ndarray, n: int) -> np.ndarray:
    counts, order = np.zeros(len(weights)), np.empty(n, dtype=np.int64)
    for i in range(n):
        chosen = int(np.argmax(weights * max(i, 1) - counts))
        order[i] = chosen
        counts[chosen] += 1
    return order


def _largest_drift(order: np.ndarray, weights: np.ndarray) -> float:
    one_hot = np.zeros((len(order), len(weights)))
    one_hot[np.arange(len(order)), order] = 1
    targets = np.arange(1, len(order) + 1)[:, None] * weights[None, :]
    return float(np.abs(np.cumsum(one_hot, axis=0) - targets).max())


def bench_blend() -> None:
    print("| weights | samples | seconds |\n| --- | --- | --- |")
    for weights, n in (
        (["0.2", "0.3", "0.5"], 100_000_000),
        (["0.123457", "0.3", "0.1", "0.476543"], 1_000_000),
    ):
        seconds = timed(lambda w=weights, n=n: build_blending_indices(w, n), repeats=1)
        print(f"| {' '.join(weights)} | {n:,} | {seconds:.2f} |")
    rng = np.random.default_rng(1)
    drift = {"Megatron (w * max(i, 1) - c)": 0.0, "bloomnative (Tijdeman)": 0.0}
    for _ in range(150):
        count = int(rng.integers(2, 10))
        raw = rng.dirichlet(np.full(count, rng.choice([0.3, 0.5, 1.0, 3.0]))) + 1e-4
        text = [f"{w:.6f}" for w in raw]
        weights = np.array([float(w) for w in text]) / sum(float(w) for w in text)
        ours, _ = build_blending_indices(text, 3000)
        megatron = _megatron_rule_order(weights, 3000)
        drift["bloomnative (Tijdeman)"] = max(
            drift["bloomnative (Tijdeman)"], _largest_drift(ours, weights)
        )
        drift["Megatron (w * max(i, 1) - c)"] = max(
            drift["Megatron (w * max(i, 1) - c)"], _largest_drift(megatron, weights)
        )
    print("\nLargest |count - weight x n| over 150 random blends of 2-9 datasets, 3,000 samples:\n")
    print("| rule | drift (samples) |\n| --- | --- |")
    for rule, value in drift.items():
        print(f"| {rule} | {value:.3f} |")


def bench_loader() -> None:
    import torch

    from bloomnative.data import PretrainingLoader

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        rng = np.random.default_rng(0)
        sizes = synthetic_sizes(100_000, 50_000_000)
        with IndexedDatasetBuilder(f"{tmp}/corpus", vocab_size=50_257) as builder:
            for size in sizes:
                builder.add_document(rng.integers(0, 50_257, size, dtype=np.uint16))
        indexed = IndexedDataset(f"{tmp}/corpus")
        dataset = GPTDataset(indexed, (0, len(indexed)), 2048, 20_000, seed=1)
        print("| reader | samples/s | tokens/s |\n| --- | --- | --- |")
        count = 4096
        seconds = timed(lambda: [dataset[i] for i in range(count)])
        print(f"| GPTDataset[i], seq_len 2048 | {count / seconds:,.0f} | "
              f"{count * 2048 / seconds:,.0f} |")  # fmt: skip
        for prefetch in (False, True):
            loader = PretrainingLoader(dataset, micro_batch_size=8, dp_rank=0, dp_size=1,
                                       prefetch=prefetch)  # fmt: skip
            steps, gbs = 16, 256
            start = time.perf_counter()
            for _ in range(steps):
                loader.next_batch(gbs)
            seconds = time.perf_counter() - start
            loader.close()
            samples = steps * gbs
            print(f"| PretrainingLoader, mbs 8, gbs 256, prefetch={prefetch} | "
                  f"{samples / seconds:,.0f} | {samples * 2048 / seconds:,.0f} |")  # fmt: skip
        print(
            "\nTime the training loop waits in next_batch(256) when each step computes for "
            f"{STEP_SECONDS * 1000:.0f} ms (the prefetch thread works meanwhile):\n\n"
            "| prefetch | wait per step (ms) |\n| --- | --- |"
        )
        for prefetch in (False, True):
            loader = PretrainingLoader(dataset, 8, 0, 1, prefetch=prefetch)
            waits = []
            for _ in range(12):
                start = time.perf_counter()
                loader.next_batch(256)
                waits.append(time.perf_counter() - start)
                time.sleep(STEP_SECONDS)  # the step's compute; releases the GIL like a GPU step
            loader.close()
            print(f"| {prefetch} | {1000 * statistics.median(waits[2:]):.1f} |")


def write_synthetic_dataset(prefix: str, sizes: np.ndarray, dtype: np.dtype, vocab: int) -> None:
    """One sequence per document, uniform random ids below `vocab`, written 64M tokens at a
    time (the format written directly: a builder call per document would dominate)."""
    rng = np.random.default_rng(0)
    total = int(sizes.sum())
    with open(prefix + ".bin", "wb") as f:
        for start in range(0, total, 1 << 26):
            count = min(1 << 26, total - start)
            f.write(rng.integers(0, vocab, count, dtype=np.int64).astype(dtype).tobytes())
    with open(prefix + ".idx", "wb") as f:
        write_index(f, sizes, np.arange(len(sizes) + 1), np.dtype(dtype))


def evict_from_page_cache(prefix: str) -> None:
    for suffix in (".bin", ".idx"):
        fd = os.open(prefix + suffix, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def bench_check(folder: str | None) -> None:
    sizes = synthetic_sizes(2_000_000, 1_000_000_000)
    print(
        "| tokens | dtype, vocab | .bin GB | check, page cache (s) | check, from disk (s) | "
        "preflight command, page cache (s) |\n| --- | --- | --- | --- | --- | --- |"
    )
    for dtype, vocab in ((np.dtype(np.uint16), 8192), (np.dtype(np.int32), 250_880)):
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            prefix = os.path.join(tmp, "big_text_document")
            write_synthetic_dataset(prefix, sizes, dtype, vocab)
            cold = []
            for _ in range(2):
                evict_from_page_cache(prefix)
                cold.append(timed(lambda p=prefix, v=vocab: check_indexed_dataset(p, v), 1))
            warm = timed(lambda p=prefix, v=vocab: check_indexed_dataset(p, v))
            command = [
                sys.executable, "-m", "bloomnative.launch.preflight", f"--data.blend={prefix}",
                f"--model.vocab_size={vocab}", "--data.tokenizer=",
            ]  # fmt: skip
            whole = timed(lambda c=command: subprocess.run(c, check=True, capture_output=True), 3)
            gb = os.path.getsize(prefix + ".bin") / 1e9
            print(
                f"| {int(sizes.sum()):,} | {dtype}, {vocab:,} | {gb:.1f} | {warm:.2f} | "
                f"{statistics.median(cold):.2f} | {whole:.2f} |"
            )


# Each section, given the parsed command line.
SECTIONS = {
    "preprocess": lambda args: bench_preprocess(args.workers),
    "index": lambda args: bench_index(),
    "blend": lambda args: bench_blend(),
    "loader": lambda args: bench_loader(),
    "check": lambda args: bench_check(args.tmp),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="+", choices=sorted(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--tmp", help="folder for the check section's 2-4 GB files (default /tmp)")
    args = parser.parse_args(argv)
    import torch

    print(
        f"Machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
        f"torch {torch.__version__}, numpy {np.__version__}, load average at start "
        f"{os.getloadavg()[0]:.1f}\n"
    )
    for section in args.only:
        print(f"### {section}\n")
        SECTIONS[section](args)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
