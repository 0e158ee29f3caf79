"""bloomnative.evaluation and tools/evaluate.py against lm-evaluation-harness's own `hf` model
on the Hugging Face export of the same checkpoint (the conftest's 2-process FSDP run, 3 steps),
on local tasks the tests write: multiple choice (acc, acc_norm), perplexity (word and byte
perplexity) and generation (exact match after stop strings)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval", reason="the eval extra (lm_eval) is not installed")

from lm_eval.tasks import TaskManager  # noqa: E402

from bloomnative.evaluation import BloomnativeLM  # noqa: E402
from bloomnative.generate import load_model  # noqa: E402
from bloomnative.interop import save_native_checkpoint  # noqa: E402
from harness.local_tasks import (  # noqa: E402
    STOP,
    TASKS,
    correct,
    loglikelihoods,
    responses,
    write_local_tasks,
)
from harness.training import REPO, load_tool  # noqa: E402

pytestmark = [
    pytest.mark.multiprocess,  # the conftest's 2-process run
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

REPO_TOKENIZER = REPO / "assets" / "pydocs" / "tokenizer.json"
"""The bundled corpus's tokenizer: 8,192 tokens, more than the test run's model has."""

evaluate_tool = load_tool("evaluate")
convert_hf = load_tool("convert_hf")


@pytest.fixture(scope="module")
def offline(monkeypatch_module):
    monkeypatch_module.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def setup(fsdp_run, tmp_path_factory, offline):
    """(dump folder, its Hugging Face export, task folder, task index)."""
    dump, _ = fsdp_run
    root = tmp_path_factory.mktemp("evaluation")
    hf = root / "hf"
    argv = ["to-hf", "--checkpoint", str(dump / "checkpoints" / "step-3"), "--out", str(hf)]
    assert convert_hf.main(argv) == 0
    tasks = root / "tasks"
    tasks.mkdir()
    write_local_tasks(tasks)
    return dump, hf, tasks, TaskManager(include_path=str(tasks))


@pytest.fixture(scope="module")
def reference(setup) -> dict:
    """lm_eval's own hf model on the export: the independent reference."""
    _, hf, _, manager = setup
    return lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={hf},dtype=float32",
        tasks=TASKS,
        task_manager=manager,
        batch_size=1,
        device="cpu",
        log_samples=True,
    )


@pytest.fixture(scope="module")
def ours(setup) -> dict:
    dump, _, _, manager = setup
    model = BloomnativeLM(checkpoint=dump, batch_size=5, device="cpu")
    return lm_eval.simple_evaluate(model=model, tasks=TASKS, task_manager=manager, log_samples=True)


def test_multiple_choice_gives_the_hf_models_answers_and_scores(ours, reference):
    for metric in ("acc", "acc_norm"):
        assert correct(ours, "local_choice", metric) == correct(reference, "local_choice", metric)
    ours_ll, ref_ll = (
        loglikelihoods(ours, "local_choice"),
        loglikelihoods(reference, "local_choice"),
    )
    assert len(ours_ll) == len(ref_ll) == 12 * 4
    assert ours_ll == pytest.approx(ref_ll, abs=1e-5)
    assert sum(ours_ll) == pytest.approx(sum(ref_ll), abs=1e-5)
    greedy = [[r[0][1] for r in sample["resps"]] for sample in ours["samples"]["local_choice"]]
    assert greedy == [[r[0][1] for r in s["resps"]] for s in reference["samples"]["local_choice"]]


def test_perplexities_equal_the_hf_models(ours, reference):
    ours_ll, ref_ll = loglikelihoods(ours, "local_text"), loglikelihoods(reference, "local_text")
    assert ours_ll == pytest.approx(ref_ll, abs=1e-5)
    assert sum(ours_ll) == pytest.approx(sum(ref_ll), abs=1e-5)
    for metric in ("word_perplexity,none", "byte_perplexity,none"):
        value = ours["results"]["local_text"][metric]
        assert math.isfinite(value) and value > 1
        assert value == pytest.approx(reference["results"]["local_text"][metric], rel=1e-6)


def test_generation_stops_at_the_stop_string_as_the_hf_model_does(ours, reference):
    texts = responses(ours, "local_qa")
    assert texts == responses(reference, "local_qa")
    assert all(STOP not in text[0] and text[0] for text in texts)  # cut before the stop string
    assert correct(ours, "local_qa", "exact_match") == correct(reference, "local_qa", "exact_match")


def test_bf16_scores_stay_near_fp32(setup, ours):
    dump, _, _, manager = setup
    model = BloomnativeLM(checkpoint=dump, dtype="bfloat16", batch_size=5, device="cpu")
    assert next(model.model.parameters()).dtype == torch.bfloat16
    half = lm_eval.simple_evaluate(model=model, tasks=["local_text"], task_manager=manager)
    for metric in ("word_perplexity,none", "byte_perplexity,none"):
        fp32 = ours["results"]["local_text"][metric]
        assert half["results"]["local_text"][metric] == pytest.approx(fp32, rel=0.02)


def test_a_one_process_save_of_the_fsdp_checkpoint_gives_the_same_numbers(setup, ours, tmp_path):
    dump, _, _, manager = setup
    single = save_native_checkpoint(load_model(dump), tmp_path / "single")
    model = BloomnativeLM(
        checkpoint=single, tokenizer=dump.parent / "tokenizer.json", batch_size=2, device="cpu"
    )
    again = lm_eval.simple_evaluate(
        model=model, tasks=TASKS, task_manager=manager, log_samples=True
    )
    for task in TASKS:
        assert responses(again, task) == responses(ours, task)


def test_evaluate_tool_writes_the_results_under_the_dump_folder(setup, reference, capsys):
    dump, _, tasks, _ = setup
    argv = ["--checkpoint", str(dump / "checkpoints" / "step-3"), "--tasks", ",".join(TASKS)]
    argv += ["--include-path", str(tasks), "--limit", "4", "--log-samples", "--batch-size", "3"]
    assert evaluate_tool.main(argv) == 0
    out = capsys.readouterr()
    assert "|local_choice|" in out.out and "acc_norm" in out.out
    assert "evaluate.py: wrote" in out.err
    results = json.loads((dump / "eval" / "step-3.json").read_text())["results"]
    first = [json.loads(line) for line in (dump / "eval" / "step-3.samples.jsonl").open()]
    assert sorted({row["task"] for row in first}) == sorted(TASKS)
    assert len(first) == 4 * len(TASKS)
    choice = [r for r in first if r["task"] == "local_choice"]
    expected = reference["samples"]["local_choice"][:4]
    assert [r["acc"] for r in choice] == [r["acc"] for r in expected]
    assert results["local_choice"]["acc,none"] == pytest.approx(sum(r["acc"] for r in expected) / 4)


def run_tool(argv: list[str], capsys) -> tuple[int, str]:
    """evaluate.py's exit code (argparse's errors exit through SystemExit) and stderr."""
    try:
        code = evaluate_tool.main(argv)
    except SystemExit as e:
        code = int(e.code or 0)
    return code, capsys.readouterr().err.strip()


def test_bad_input_is_one_line_and_exit_2(setup, tmp_path, capsys):
    dump, _, tasks, _ = setup
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "task.yaml").write_text("task: broken\n  dataset_path: [json\n")
    cases = [
        (["--tasks", "local_choise", "--include-path", str(tasks)], "nearest: local_choice"),
        (["--tasks", "local_choice", "--include-path", str(broken)], "does not parse"),
        (["--tasks", "local_choice", "--limit", "0"], "--limit: '0' is not a whole number >= 1"),
    ]
    for argv, message in cases:
        code, err = run_tool(["--checkpoint", str(dump), *argv], capsys)
        assert code == 2 and message in err and len(err.splitlines()) == 1, err


def test_model_arguments_that_cannot_work_are_refused_by_name(setup):
    dump = setup[0]
    cases = [
        ({"batch_size": "auto"}, "batch_size must be a whole number > 0, got 'auto'"),
        ({"dtype": "fp16"}, "dtype 'fp16': choose one of"),
        ({"tokenizer": REPO_TOKENIZER}, "does not belong to the model"),
    ]
    for arguments, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            BloomnativeLM(checkpoint=dump, device="cpu", **arguments)
