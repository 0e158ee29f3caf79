#!/usr/bin/env python3
"""Regenerate assets/pydocs/ (the corpus ./run_train.sh uses offline) from Debian's python3.11-doc.

    cd /tmp/pydoc && apt-get download python3.11-doc && dpkg -x python3.11-doc_*.deb x
    python tools/build_bundled_corpus.py --root /tmp/pydoc/x

Every step is deterministic, so the same package version gives byte-identical files:

1. Pages: the reStructuredText sources (``html/_sources/**/*.rst.txt``), taken whole, from
   the directories in ``PAGE_DIRECTORIES`` in that order (sorted within each), until
   ``TARGET_BYTES`` of text is reached.
2. Documents: each page is cut before every top-level heading (the page title's level and the
   level below it); a ``.. _label:`` line right before a heading goes with that heading, and
   a piece under ``MIN_DOCUMENT_CHARS`` (a bare title, a lone label) joins the next one.
   Documents are shuffled with a fixed seed, so a document-range split takes a random sample.
3. ``pydocs.jsonl.gz``: one ``{"source", "text"}`` object per document (gzip with mtime 0).
4. ``tokenizer.json``: byte-level BPE, 8,192 ids, ``<|endoftext|>`` (the EOD) is id 0.
5. ``pydocs_text_document.{bin,idx}``: the documents tokenized with an EOD after each.
6. ``SOURCE.md``: provenance, the licence terms quoted from the package, and the figures.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import random
import re
import sys
from pathlib import Path

import numpy as np

from bloomnative.data import IndexedDataset, split_boundaries
from bloomnative.data.preprocess import PreprocessConfig, preprocess

REPO = Path(__file__).resolve().parents[1]
EXPECTED_VERSION = "3.11.2-6+deb12u9"
RELEASE = "3.11.2"  # the Python release the package documents; |release| in its sources
SOURCES = "usr/share/doc/python3.11/html/_sources"
CHANGELOG = "usr/share/doc/python3.11-doc/changelog.Debian.gz"
# Prose and reference first; whatsnew/ (changelogs), c-api/ and distutils/ are left out.
PAGE_DIRECTORIES = (
    "tutorial", "reference", "howto", "faq", "glossary.rst.txt", "using", "extending",
    "installing", "library",
)  # fmt: skip
TARGET_BYTES = 5_000_000
SHUFFLE_SEED = 2026
VOCAB_SIZE = 8192
EOD = "<|endoftext|>"
DEBUG_SPLIT = "949,50,1"
MIN_DOCUMENT_CHARS = 200
ADORNMENT = set("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
LABEL = re.compile(r"^\.\. _[^:]+:\s*$")


def select_pages(sources: Path) -> list[Path]:
    """Whole pages in PAGE_DIRECTORIES order until TARGET_BYTES."""
    pages, total = [], 0
    for entry in PAGE_DIRECTORIES:
        path = sources / entry
        candidates = [path] if path.is_file() else sorted(path.rglob("*.rst.txt"))
        for page in candidates:
            if total >= TARGET_BYTES:
                return pages
            pages.append(page)
            total += page.stat().st_size
    return pages


def _is_adornment(line: str) -> bool:
    return len(line) >= 3 and line[0] in ADORNMENT and line == line[0] * len(line)


def split_top_level_sections(text: str) -> list[str]:
    """A page cut before each heading of its two highest levels (title and top sections)."""
    lines = text.splitlines()
    styles: list[tuple[str, bool]] = []  # heading styles in order of first use = their levels
    cuts = [0]
    for i in range(1, len(lines)):
        title, underline = lines[i - 1], lines[i]
        if not _is_adornment(underline) or not title.strip() or title[0].isspace():
            continue
        if len(underline) < len(title.rstrip()) or not any(c.isalnum() for c in title):
            continue
        overline = i >= 2 and lines[i - 2] == underline
        if not overline and i >= 2 and lines[i - 2].strip():
            continue  # a heading follows a blank line (or its overline)
        style = (underline[0], overline)
        if style not in styles:
            styles.append(style)
        if styles.index(style) > 1:
            continue
        start = i - 2 if overline else i - 1
        while start - 1 > cuts[-1] and (LABEL.match(lines[start - 1]) or not lines[start - 1]):
            start -= 1
        if start > cuts[-1]:
            cuts.append(start)
    cuts.append(len(lines))
    sections = ["\n".join(lines[a:b]).strip() for a, b in zip(cuts, cuts[1:], strict=False)]
    return _merge_short(sections)


def _merge_short(sections: list[str]) -> list[str]:
    """Fold sections under MIN_DOCUMENT_CHARS (a bare title, a lone label) into the next."""
    merged: list[str] = []
    carry = ""
    for section in sections:
        text = f"{carry}\n\n{section}" if carry else section
        if len(text) < MIN_DOCUMENT_CHARS:
            carry = text
        else:
            merged.append(text)
            carry = ""
    if carry:
        if merged:
            merged[-1] = f"{merged[-1]}\n\n{carry}"
        else:
            merged.append(carry)
    return merged


def build_documents(sources: Path) -> list[dict[str, str]]:
    documents = []
    for page in select_pages(sources):
        name = page.relative_to(sources).as_posix()
        for number, text in enumerate(split_top_level_sections(page.read_text("utf-8"))):
            documents.append({"source": f"{name}#{number}", "text": text + "\n"})
    random.Random(SHUFFLE_SEED).shuffle(documents)
    return documents


def write_jsonl_gz(documents: list[dict[str, str]], path: Path) -> None:
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=9) as gz:
        for document in documents:
            gz.write((json.dumps(document, ensure_ascii=False, sort_keys=True) + "\n").encode())
    path.write_bytes(buffer.getvalue())


def train_tokenizer(texts: list[str], path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOD],  # first special token -> id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    path.write_text(tokenizer.to_str(pretty=False) + "\n", encoding="utf-8")


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy in nats/token of the token frequencies: the loss of the best model that
    ignores context, which a trained model must beat."""
    counts = np.bincount(tokens.astype(np.int64))
    p = counts[counts > 0] / len(tokens)
    return float(-(p * np.log(p)).sum())


def licence_block(license_text: str, anchor: str) -> str:
    """The parsed-literal licence text under ``.. _<anchor>:`` in license.rst.txt."""
    lines = license_text.splitlines()
    start = lines.index(f".. _{anchor}:")
    literal = lines.index(".. parsed-literal::", start) + 1
    block = []
    for line in lines[literal:]:
        if line and not line[0].isspace():
            break
        block.append(line)
    text = "\n".join(block).strip("\n")
    indent = min(len(x) - len(x.lstrip()) for x in block if x.strip())
    return "\n".join(x[indent:] for x in text.splitlines()).replace("|release|", RELEASE)


def package_version(root: Path) -> str:
    with gzip.open(root / CHANGELOG, "rt", encoding="utf-8") as stream:
        first = stream.readline()
    match = re.match(r"\S+ \(([^)]+)\)", first)
    return match.group(1) if match else "unknown"


def write_source_md(out: Path, root: Path, stats: dict) -> None:
    license_text = (root / SOURCES / "license.rst.txt").read_text("utf-8")
    psf = licence_block(license_text, "PSF-license")
    bsd0 = licence_block(license_text, "BSD0")
    directories = ", ".join(d.removesuffix(".rst.txt") for d in PAGE_DIRECTORIES)
    docs = " / ".join(f"{n:,}" for n in stats["split_docs"])
    tokens = " / ".join(f"{n:,}" for n in stats["split_tokens"])
    text = f"""# pydocs: the bundled training corpus

Generated by `python tools/build_bundled_corpus.py --root <extracted package>`; do not edit.

## Source

- Debian package `python3.11-doc`, version `{stats["version"]}` (Debian 12 "bookworm"),
  fetched with `apt-get download python3.11-doc` and unpacked with `dpkg -x`.
- Text: the reStructuredText sources of the Python 3.11 documentation shipped in the package,
  `/{SOURCES}/**/*.rst.txt`.
- Pages taken whole, directory by directory, until {TARGET_BYTES:,} bytes:
  {stats["pages"]} pages, {stats["text_bytes"]:,} bytes of text. Directories, in order:
  {directories}.

## Changes made (PSF licence, clause 3)

Pages were split into documents at their top-level headings, shuffled (seed {SHUFFLE_SEED})
and stored as JSON lines; a BPE tokenizer was trained on them and they were tokenized. The
text itself is unchanged.

## Files

| file | what |
| --- | --- |
| `pydocs.jsonl.gz` | {stats["documents"]:,} documents: `{{"source": "<page>#<n>", "text": ...}}` |
| `tokenizer.json` | byte-level BPE, {VOCAB_SIZE:,} ids, `{EOD}` = id {stats["eod_id"]} (the EOD) |
| `pydocs_text_document.bin/.idx` | Megatron MMIDIDX, uint16 tokens, EOD after each document |

- Tokens: {stats["tokens"]:,} ({stats["bytes_per_token"]:.2f} bytes of text per token).
- Unigram entropy of the token stream: {stats["entropy"]:.4f} nats/token.
- Split `"{DEBUG_SPLIT}"`, train / valid / test: {docs} documents; {tokens} tokens.
- SHA-256 of `pydocs.jsonl.gz`: `{stats["jsonl_sha256"]}`.

## Licence

Copyright © 2001-2023 Python Software Foundation; All Rights Reserved.

From `license.rst.txt` of the same package: "Python software and documentation are licensed
under the PSF License Agreement. Starting with Python 3.8.6, examples, recipes, and other code
in the documentation are dual licensed under the PSF License Agreement and the Zero-Clause BSD
license." Both texts follow, as the package states them (`|release|` = {RELEASE}).

### PSF License Agreement for Python {RELEASE}

```
{psf}
```

### Zero-Clause BSD license for code in the Python {RELEASE} documentation

```
{bsd0}
```
"""
    (out / "SOURCE.md").write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--root", default="/tmp/pydoc/x", help="where python3.11-doc_*.deb was unpacked"
    )
    parser.add_argument("--out", default=str(REPO / "assets" / "pydocs"))
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    root, out = Path(args.root), Path(args.out)
    sources = root / SOURCES
    if not sources.is_dir():
        print(
            f"{sources} does not exist; unpack the package first:\n"
            f"  mkdir -p /tmp/pydoc && cd /tmp/pydoc && apt-get download python3.11-doc "
            "&& dpkg -x python3.11-doc_*.deb x",
            file=sys.stderr,
        )
        return 1
    version = package_version(root)
    if version != EXPECTED_VERSION:
        print(
            f"warning: python3.11-doc {version}, the committed assets come from "
            f"{EXPECTED_VERSION}; the output will differ",
            file=sys.stderr,
        )
    out.mkdir(parents=True, exist_ok=True)

    documents = build_documents(sources)
    jsonl = out / "pydocs.jsonl.gz"
    write_jsonl_gz(documents, jsonl)
    train_tokenizer([d["text"] for d in documents], out / "tokenizer.json")
    summary = preprocess(PreprocessConfig(
        inputs=(str(jsonl),), tokenizer=str(out / "tokenizer.json"),
        output_prefix=str(out / "pydocs"), workers=args.workers, append_eod=True,
    ))  # fmt: skip

    dataset = IndexedDataset(summary.outputs[0])
    tokens = np.asarray(dataset._tokens)
    sizes = dataset.sequence_lengths.astype(np.int64)
    bounds = split_boundaries(DEBUG_SPLIT, len(dataset))
    text_bytes = sum(len(d["text"].encode()) for d in documents)
    stats = {
        "version": version,
        "pages": len(select_pages(sources)),
        "text_bytes": text_bytes,
        "documents": len(documents),
        "tokens": int(len(tokens)),
        "bytes_per_token": text_bytes / len(tokens),
        "eod_id": json.loads((out / "tokenizer.json").read_text())["added_tokens"][0]["id"],
        "entropy": unigram_entropy(tokens),
        "split_docs": [bounds[i + 1] - bounds[i] for i in range(3)],
        "split_tokens": [int(sizes[bounds[i] : bounds[i + 1]].sum()) for i in range(3)],
        "jsonl_sha256": hashlib.sha256(jsonl.read_bytes()).hexdigest(),
    }
    write_source_md(out, root, stats)
    print(json.dumps(stats, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
