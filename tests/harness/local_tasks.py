"""Local lm-evaluation-harness tasks for the evaluation tests: task YAMLs reading JSONL files, in
the words of the synthetic corpus's word tokenizer (harness.training.write_word_tokenizer), and
what the tests read from the harness's per-sample records (simple_evaluate with log_samples)."""

from __future__ import annotations

import json
import random
from pathlib import Path

TASKS = ["local_choice", "local_text", "local_qa"]
"""One of each kind: multiple choice (acc, acc_norm), perplexity (word and byte perplexity) and
generation (exact match after stop strings)."""
STOP = " "
"""The generation task's stop string: the word tokenizer decodes tokens joined by spaces, so
every continuation longer than one word is cut by it."""


def write_local_tasks(folder: Path, seed: int = 0) -> Path:
    """Three task YAMLs reading JSONL files in `folder`, in the synthetic corpus's words."""
    rng = random.Random(seed)

    def words(least: int, most: int) -> str:
        return " ".join(f"w{rng.randint(1, 127)}" for _ in range(rng.randint(least, most)))

    rows = {
        "choice": [
            {"context": words(2, 9), "choices": [words(1, 4) for _ in range(4)], "answer": i % 4}
            for i in range(12)
        ],
        "text": [{"text": words(5, 40)} for _ in range(6)],
        "qa": [{"question": words(2, 6), "answer": words(1, 1)} for _ in range(6)],
    }
    for name, records in rows.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    common = "dataset_path: json\ntest_split: test\ndataset_kwargs:\n  data_files:\n"
    specs = {
        "choice": "output_type: multiple_choice\ndoc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n",
        "text": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n",
        "qa": "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: '{{answer}}'\ngeneration_kwargs:\n"
        f"  until: [{json.dumps(STOP)}]\n  max_gen_toks: 5\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n",
    }
    for name, spec in specs.items():
        data = f"    test: {folder / (name + '.jsonl')}\n"
        (folder / f"{name}.yaml").write_text(f"task: local_{name}\n{common}{data}{spec}")
    return folder


def responses(results: dict, task: str) -> list:
    return [sample["resps"] for sample in results["samples"][task]]


def loglikelihoods(results: dict, task: str) -> list[float]:
    """Every log-likelihood the task asked for, item by item, choice by choice."""
    out = []
    for sample in results["samples"][task]:
        for resp in sample["resps"]:
            value = resp[0]
            out.append(float(value[0] if isinstance(value, (list, tuple)) else value))
    return out


def correct(results: dict, task: str, metric: str) -> int:
    return sum(int(sample[metric]) for sample in results["samples"][task])
