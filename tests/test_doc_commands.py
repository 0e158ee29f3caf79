"""Every shell command in README.md and docs/*.md runs, as a user runs it from the repository
root, and exits 0.

A fenced block names its language: `bash` holds commands, `text` output or listings (a block
without one fails here, so none is left out unnoticed). A `bash` block whose first line is
`# GPU only...` or `# Not run in tests: <why>` is skipped, saying so.

The commands run in a scratch copy of the root: every top-level entry of the repository linked,
except `outputs/`, which starts empty (nothing lands in the checkout, and a later command finds
what an earlier one wrote). `python` and `.venv/bin/python` are the Python running the tests,
which `run_train.sh` and `run_tests.sh` use too (BLOOMNATIVE_PYTHON), so the GPU machines' stack
is exercised when CI runs under it. The inputs the docs name as placeholders (a user's corpus,
jsonl files, a tokenizer) are made there by `write_inputs`. SUBSTITUTIONS, the one place that
changes what a command says, keeps each run small and gives the reason for each change; READS
says which command's output a command reads, so that one runs first.
"""

from __future__ import annotations

import fnmatch
import gzip
import json
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import launching
from harness.training import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
SKIP_MARKER = re.compile(r"# (GPU only\b.*|Not run in tests: \S.*)")
LOOKS_LIKE_A_MARKER = re.compile(r"#\s*(gpu|not run)", re.IGNORECASE)
TRAINS = re.compile(r"run_train\.sh|bloomnative\.train\.main")
# Set by torchrun for its workers; a command must not inherit them from the test process.
LAUNCHER_VARS = {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"}


SHRUNK_BLOOM = (
    " --model.preset=debug --training.seq_len=128 --training.global_batch_size=4"
    " --training.micro_batch_size=4 --training.rampup_batch_size="
)
SMALL_BENCH = "python tools/bench_train.py --model.n_layer=1 --matmul-size=256"
SMALL_CKPT = "--hidden 64 --layers 2 --vocab 1024 --reps 1"
FEW_STEPS = ("--warmup 3 --steps 10", "--warmup 1 --steps 1")
WHY_SHRUNK = "the debug model's shape and batch: BLOOM-560m at seq 2048 does not train on a CPU"
WHY_COLLECT = "the suite runs these tests itself: here they are collected, so the path is checked"
WHY_BENCH = "one warm-up and one timed step: the test checks that it runs, not the timing"
WHY_SMALL_BENCH = (
    "one block, small ceiling matmuls: compiling whole-model baselines grows with depth"
)
WHY_WARM = "one compile cache for all the commands: a cold compile costs about a CPU-minute"
WHY_SWEEP = "the sweep's placeholders, filled with one small point of it"
WHY_CKPT = "a small model, one repetition: the test checks that it runs, not the timing"
WHY_SAME_BENCH = (
    "docs/benchmarks.md's command, which writes there: it is run once (a command the scratch root "
    "has run as it stands is not run again)"
)
WHY_REPEAT = "one timed run per model: the test checks that it runs, not the timing"
WHY_RUN = "README.md's training run (2 steps) stands for a run's dump folder"
WHY_HF = "the export above, of the debug model, stands for a downloaded BLOOM-560m"
WHY_DEBUG = "the placeholder, as configs/debug.toml sets it"

# doc -> (text in a command, its replacement, why): applied in this order to each command of the
# doc (continuation lines joined, comments removed).
SUBSTITUTIONS: dict[str, list[tuple[str, str, str]]] = {
    "README.md": [
        (
            "./run_tests.sh",
            "./run_tests.sh tests/test_doc_references.py",
            "the whole suite takes 25 minutes (this test included): one small file of it shows "
            "that the command sets up and runs pytest",
        ),
        ("configs/bloom-560m.toml", "configs/bloom-560m.toml" + SHRUNK_BLOOM, WHY_SHRUNK),
    ],
    "docs/benchmarks.md": [
        ("--training.steps=S", "--training.steps=2", WHY_SWEEP),
        ("_size=B", "_size=4", WHY_SWEEP),
        ("lr=LR/10", "lr=3e-4", WHY_SWEEP),
        ("lr=LR", "lr=3e-3", WHY_SWEEP),
        ("warmup_steps=W", "warmup_steps=1", WHY_SWEEP),
        ("freq=S/4", "freq=1", WHY_SWEEP),
        ("steps=V", "steps=1", WHY_SWEEP),
        (
            "[--model.hidden_size=128 --model.n_head=4]",
            "--model.hidden_size=128 --model.n_head=4",
            WHY_SWEEP,
        ),
        ("/tmp/sweep/NAME", "outputs/sweep/h128", WHY_SWEEP),
        (*FEW_STEPS, WHY_BENCH),
        ("python tools/bench_train.py", SMALL_BENCH, WHY_SMALL_BENCH),
        ("--cold-compile ", "", WHY_WARM),
        ("test_memory_measured.py", "test_memory_measured.py --collect-only", WHY_COLLECT),
        ("OUT_DIR", "outputs/memory_worker", "a placeholder"),
        (
            "--model.n_layer=8 --model.vocab_size=50176",
            "--model.n_layer=4 --model.vocab_size=8192",
            "a smaller row of the same table: the test checks that the scenario runs",
        ),
        (
            "tools/bench_data.py",
            "tools/bench_data.py --only index blend loader",
            "its check section writes and reads 2-4 GB; docs/data.md's command preprocesses",
        ),
        ("--reps 9", SMALL_CKPT, WHY_CKPT),
        ("--steps 6 --parallelism", "--steps 1 --parallelism", WHY_BENCH),
        (
            "tools/bench_one_rank_fsdp.py",
            "tools/bench_one_rank_fsdp.py --model.n_layer=1 --training.global_batch_size=4",
            "one block, two micro batches: the test checks that it runs, not the figures",
        ),
        ("--hidden 1024 --layers 8 --vocab 50176 --reps 5", SMALL_CKPT, WHY_CKPT),
        ("/tmp/bench_ckpt", "outputs/bench_ckpt", "the test's own folder, not /tmp"),
        (
            "configs/bloom-560m.toml --training.steps=12",
            "configs/bloom-560m.toml --training.steps=12" + SHRUNK_BLOOM,
            WHY_SHRUNK + " (the measurement's run; the estimate beside it keeps BLOOM-560m)",
        ),
        (
            "fp8_loss_curves.py --steps 200",
            "fp8_loss_curves.py --steps 2 --model.n_layer=1",
            "two steps of one block: the test checks that the figure's command runs",
        ),
        (
            "docs/fp8_loss_curves",
            "fp8_loss_curves",
            "written in the scratch root: the recorded figure stays as it is",
        ),
    ],
    "docs/hf_interop.md": [
        ("outputs/run/checkpoints/step-2000", "outputs/debug/checkpoints/step-2", WHY_RUN),
        ("path/to/bloom-560m", "exports/run-step-2000", WHY_HF),
        ("configs/bloom-560m.toml", "configs/bloom-560m.toml" + SHRUNK_BLOOM, WHY_HF),
    ],
    "docs/continuing.md": [
        (
            "outputs/bloom-560m-continued/checkpoints/step-660750",
            "outputs/debug/checkpoints/step-2",
            WHY_RUN,
        ),
        ("path/to/bloom-560m", "exports/run-step-2000", WHY_HF),
        ("my_language.jsonl", "a.jsonl", "the documents `write_inputs` makes"),
    ],
    "docs/finetuning.md": [
        ("path/to/bloomz-560m", "exports/run-step-2000", WHY_HF),
        ("pairs.jsonl", "xp3_en.jsonl", "the pairs `write_inputs` makes"),
        (
            "'<pad>'",
            "'<|endoftext|>'",
            "the export above carries the debug run's tokenizer, whose one special token pads",
        ),
        ("configs/bloom-560m.toml", "configs/bloom-560m.toml" + SHRUNK_BLOOM, WHY_SHRUNK),
    ],
    "docs/performance.md": [
        (
            "--steps 10 --json out.json",
            "--steps 10 --json outputs/bench/debug_cpu.json",
            WHY_SAME_BENCH,
        ),
        (
            "--cold-compile --json out.json",
            "--cold-compile --json outputs/bench/debug_cpu_hf.json",
            WHY_SAME_BENCH,
        ),
        (*FEW_STEPS, WHY_BENCH),
        ("python tools/bench_train.py", SMALL_BENCH, WHY_SMALL_BENCH),
        ("--cold-compile ", "", WHY_WARM),
        ("[--explain] [--json plan.json]", "--explain --json outputs/plan.json", "given"),
        (
            "./run_tests.sh tests/planner tests/tools",
            "./run_tests.sh tests/planner tests/tools --collect-only",
            WHY_COLLECT,
        ),
    ],
    "docs/training.md": [
        (
            "--profiling.start_step=10",
            "--profiling.start_step=1",
            "the window starts where the test's 2 steps reach it",
        ),
        ("<dump_folder>", "outputs/debug", WHY_RUN),
        ("<sample_prompt>", "The ", WHY_DEBUG),
        ("--max-new-tokens N", "--max-new-tokens 48", WHY_DEBUG),
        ("<job.seed>", "42", WHY_DEBUG),
    ],
    "docs/evaluation.md": [
        ("outputs/debug/checkpoints/step-1200", "outputs/debug/checkpoints/step-2", WHY_RUN),
        ("--repeat 5", "--repeat 1", WHY_REPEAT),
    ],
}
TRAINING_STEPS = "--training.steps=2"
"""Appended to every command that trains (the last value of a key wins): 2 steps go through the
set-up, a step, the log, the checkpoint and the end-of-training sample."""

# (doc, a command as the doc spells it, `*` for any text) -> the command whose output it reads
README_RUN = ("README.md", "./run_train.sh")
TO_HF = ("docs/hf_interop.md", "python tools/convert_hf.py to-hf --checkpoint outputs/run/*")
LORA_PAIRS = ("docs/finetuning.md", "python tools/preprocess_data.py *")
LORA_RUN = ("docs/finetuning.md", "./run_train.sh *")
EVAL_EXPORT = ("docs/evaluation.md", "python tools/convert_hf.py to-hf *")
VOCAB_TRIM = ("docs/continuing.md", "python tools/vocab.py trim --model path/*")
VOCAB_EXTEND = ("docs/continuing.md", "python tools/vocab.py extend *")
READS = {
    ("docs/evaluation.md", "python tools/evaluate.py *"): README_RUN,
    ("docs/evaluation.md", "python -m bloomnative.evaluation *"): README_RUN,
    EVAL_EXPORT: README_RUN,
    ("docs/evaluation.md", "python tools/bench_eval.py *"): EVAL_EXPORT,
    ("README.md", "python tools/generate.py *"): README_RUN,
    TO_HF: README_RUN,
    ("docs/hf_interop.md", "python tools/convert_hf.py to-native *"): TO_HF,
    ("docs/hf_interop.md", "./run_train.sh --config configs/bloom-560m.toml *"): TO_HF,
    ("docs/training.md", "python tools/generate.py *"): README_RUN,
    LORA_PAIRS: TO_HF,
    LORA_RUN: LORA_PAIRS,
    ("docs/finetuning.md", "python tools/generate.py *"): LORA_RUN,
    ("docs/finetuning.md", "python tools/convert_hf.py to-peft *"): LORA_RUN,
    VOCAB_TRIM: TO_HF,
    ("docs/continuing.md", "python tools/vocab.py trim --model outputs/*"): TO_HF,
    VOCAB_EXTEND: VOCAB_TRIM,
    ("docs/continuing.md", "python tools/preprocess_data.py *"): VOCAB_EXTEND,
    ("docs/hf_interop.md", "python tools/convert_hf.py to-peft *"): LORA_RUN,
    ("docs/hf_interop.md", "python tools/convert_hf.py to-hf --merge *"): LORA_RUN,
}


def write_inputs(root: Path) -> None:
    """What the docs' placeholders stand for: a user's corpus and tokenizer (the bundled ones)
    and the inputs of docs/data.md's preprocessing examples (documents, and pairs)."""
    corpus = REPO / "assets" / "pydocs" / "pydocs_text_document"
    tokenizer = REPO / "assets" / "pydocs" / "tokenizer.json"
    (root / "my").mkdir()
    for suffix in (".bin", ".idx"):
        (root / "my" / f"corpus_text_document{suffix}").symlink_to(f"{corpus}{suffix}")
    (root / "data").mkdir()
    (root / "data" / "tokenizer.json").symlink_to(tokenizer)
    (root / "tokenizer.json").symlink_to(tokenizer)
    lines = [json.dumps({"text": f"Document {i}: the list type is mutable."}) for i in range(20)]
    (root / "a.jsonl").write_text("\n".join(lines) + "\n")
    with gzip.open(root / "b.jsonl.gz", "wt") as f:
        f.write("\n".join(lines) + "\n")
    (root / "notes.txt").write_text("A note about dictionaries.\n\nAnother about sets.\n")
    pairs = [
        {"inputs": f"Is {i} even?", "targets": "yes" if i % 2 == 0 else "no"} for i in range(9)
    ]
    chat = [
        {"role": "user", "content": "Name a mutable type."},
        {"role": "assistant", "content": "list"},
    ]
    records = [*pairs, {"messages": chat}]
    (root / "xp3_en.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    language: str
    text: str

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def first_line(self) -> str:
        return self.text.split("\n", 1)[0].strip()

    def skip_reason(self) -> str | None:
        """The marker on the block's first line: "GPU only...", or "Not run in tests: why"."""
        marker = SKIP_MARKER.fullmatch(self.first_line)
        return marker[1] if marker else None


def fenced_blocks(path: Path) -> list[Block]:
    text = path.read_text()
    doc = str(path.relative_to(REPO))
    return [Block(doc, text[: m.start()].count("\n") + 1, m[1], m[2]) for m in FENCE.finditer(text)]


def shell_blocks() -> list[Block]:
    return [b for doc in DOCS for b in fenced_blocks(doc) if b.language == "bash"]


def without_comment(line: str) -> str:
    """`line` up to a `#` that starts a shell comment (after a blank, outside quotes)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line


def doc_commands(block: Block) -> list[str]:
    """The block's command lines as the doc spells them: continuations joined, no comments."""
    joined = re.sub(r"\s*\\\n\s*", " ", block.text)
    return [c for c in (without_comment(ln).strip() for ln in joined.splitlines()) if c]


@dataclass(frozen=True)
class Command:
    doc: str
    text: str
    """As the doc spells it."""
    exports: tuple[str, ...]
    """The block's `export` lines before it: the user's shell has them."""

    def as_run(self) -> str:
        run = self.text
        for old, new, _ in SUBSTITUTIONS.get(self.doc, []):
            run = run.replace(old, new)
        return f"{run} {TRAINING_STEPS}" if TRAINS.search(run) else run

    def reads(self) -> tuple[str, str] | None:
        sources = (src for (doc, pattern), src in READS.items() if self.matches(doc, pattern))
        return next(sources, None)

    def matches(self, doc: str, pattern: str) -> bool:
        return self.doc == doc and fnmatch.fnmatchcase(self.text, pattern)


def commands(block: Block) -> list[Command]:
    out, exports = [], []
    for line in doc_commands(block):
        if line.startswith("export "):
            exports.append(line)
        else:
            out.append(Command(block.doc, line, tuple(exports)))
    return out


def runnable_commands() -> list[Command]:
    return [c for b in shell_blocks() if not b.skip_reason() for c in commands(b)]


class DocRoot:
    """The scratch repository root, and the commands run in it so far (each once)."""

    def __init__(self, root: Path, bin_dir: Path):
        self.root = root
        self.env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
        self.env.update(
            BLOOMNATIVE_PYTHON=sys.executable,
            PYTHONPATH=f"{REPO / 'src'}:{REPO}",
            PATH=f"{bin_dir}:{os.environ['PATH']}",
        )
        self.done: set[str] = set()
        """The scripts run so far, as run (exports, substitutions and all)."""

    def run(self, command: Command) -> None:
        """Runs `command`, after the one whose output it reads, unless the same script has run
        already (the same command in another doc, or twice in one); a failure fails the test
        with the command's output."""
        if source := command.reads():
            (provider,) = [c for c in runnable_commands() if c.matches(*source)]
            self.run(provider)
        run = command.as_run()
        script = "\n".join(["set -eo pipefail", *command.exports, run])
        if script in self.done:
            return
        proc = launching.run(["bash", "-c", script], cwd=self.root, env=self.env, check=False)
        if proc.returncode != 0:
            raise AssertionError(
                f"{command.doc}: {command.text}\nran as: {run}\nexit code {proc.returncode}\n"
                f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
            )
        self.done.add(script)


@pytest.fixture(scope="module")
def doc_root(tmp_path_factory) -> DocRoot:
    root = tmp_path_factory.mktemp("doc_root")
    for entry in REPO.iterdir():
        if entry.name not in ("outputs", ".venv", ".git"):
            (root / entry.name).symlink_to(entry)
    bin_dir = tmp_path_factory.mktemp("doc_bin")
    shim = f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n'
    for path in (bin_dir / "python", root / ".venv" / "bin" / "python"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(shim)
        path.chmod(0o755)
    write_inputs(root)
    return DocRoot(root, bin_dir)


@pytest.mark.multiprocess
@pytest.mark.parametrize("block", shell_blocks(), ids=lambda b: b.id)
def test_the_commands_of_a_doc_block_run(block, doc_root):
    if reason := block.skip_reason():
        pytest.skip(reason)
    for command in commands(block):
        doc_root.run(command)


def test_every_fenced_block_names_its_language():
    unnamed = [b.id for doc in DOCS for b in fenced_blocks(doc) if not b.language]
    assert not unnamed, f"name the language (bash: commands, text: output) of {unnamed}"


def test_every_skip_marker_is_spelled_so_the_test_reads_it():
    misspelled = [
        b.id
        for b in shell_blocks()
        if LOOKS_LIKE_A_MARKER.match(b.first_line) and not SKIP_MARKER.fullmatch(b.first_line)
    ]
    assert not misspelled, f"write '# GPU only...' or '# Not run in tests: <why>' in {misspelled}"


def test_every_substitution_and_read_matches_a_command_of_its_doc():
    runnable = runnable_commands()
    stale = [
        (doc, old)
        for doc, subs in SUBSTITUTIONS.items()
        for old, _, _ in subs
        if not any(c.doc == doc and old in c.text for c in runnable)
    ]
    stale += [r for r in [*READS, *READS.values()] if sum(c.matches(*r) for c in runnable) != 1]
    assert not stale, f"these no longer match one command of their doc: {stale}"
