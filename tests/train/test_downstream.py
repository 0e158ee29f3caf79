"""`[downstream]`: rank 0 scores the checkpoints a run saves on lm-evaluation-harness tasks in a
process of its own while training goes on. Against two independent references: the training
losses of the conftest's 2-process run without it (the same settings otherwise), and the
harness itself, in this process, on the checkpoints the run saved."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="the eval extra (lm_eval) is not installed")

from bloomnative.config import ConfigError, DownstreamConfig, parse_args  # noqa: E402
from bloomnative.evaluation import BloomnativeLM  # noqa: E402
from bloomnative.evaluation.task_names import task_manager  # noqa: E402
from bloomnative.launch.preflight import main as preflight  # noqa: E402
from bloomnative.train import downstream as downstream_module  # noqa: E402
from bloomnative.train.downstream import DownstreamEvaluator, metric_rows  # noqa: E402
from harness.local_tasks import TASKS, write_local_tasks  # noqa: E402
from harness.shared_world import SharedWorld  # noqa: E402
from harness.training import TINY_RUN, losses_by_step, write_word_tokenizer  # noqa: E402
from harness.training import metric_rows as rows_of  # noqa: E402

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]
LIMIT = 3


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tasks")
    write_local_tasks(folder)
    broken = folder / "broken"  # a task that resolves, on a data file that is not there
    broken.mkdir()
    spec = (folder / "text.yaml").read_text().replace("local_text", "local_gone", 1)
    (broken / "gone.yaml").write_text(
        spec.replace(str(folder / "text.jsonl"), "/nonexistent.jsonl")
    )
    return folder


def fsdp_run_settings(fsdp_run, synthetic_corpus, dump: Path) -> list[str]:
    """The conftest's 2-process run's training settings (its profiling and end-of-training
    sample aside, which change no loss), with another dump folder."""
    tokenizer = fsdp_run[0].parent / "tokenizer.json"
    return [
        *TINY_RUN,
        f"--data.blend={synthetic_corpus}",
        f"--data.tokenizer={tokenizer}",
        "--training.steps=3",
        "--parallelism.dp_shard=2",
        f"--job.dump_folder={dump}",
    ]


def downstream(tasks: Path, names: list[str], freq: int) -> list[str]:
    return [
        f"--checkpoint.interval={freq}",
        "--checkpoint.keep_latest_k=0",
        f"--downstream.freq={freq}",
        f"--downstream.tasks={','.join(names)}",
        f"--downstream.include_path={tasks}",
        f"--downstream.limit={LIMIT}",
        "--downstream.batch_size=4",
    ]


@pytest.fixture(scope="module")
def runs(fsdp_run, synthetic_corpus, tasks, tmp_path_factory) -> tuple[Path, SharedWorld]:
    """(folder, world) of two runs of the conftest's 2-process run's settings, in one world:
    "scored" scores its checkpoints every step on the local tasks, "broken" the final one on a
    task whose data file is missing."""
    out = tmp_path_factory.mktemp("downstream")
    world = SharedWorld(out / "world", 2)
    for name, settings in (
        ("scored", downstream(tasks, TASKS, 1)),
        ("broken", downstream(tasks / "broken", ["local_gone"], 3)),
    ):
        world.train(name, fsdp_run_settings(fsdp_run, synthetic_corpus, out / name) + settings)
    return out, world.run()


def test_each_due_checkpoint_is_scored_as_the_harness_scores_it_and_losses_do_not_change(
    runs, fsdp_run, tasks
):
    out, world = runs
    dump, proc = out / "scored", world.result("scored")
    assert losses_by_step(dump) == losses_by_step(fsdp_run[0])  # bit-equal
    scored = {row["step"]: row for row in rows_of(dump) if "downstream_seconds" in row}
    # One evaluation at a time, each taking longer than a step: step 1's starts, step 2 waits
    # and is replaced by step 3, which the end of training waits for.
    assert {1, 3} <= set(scored) <= {1, 2, 3}
    if 2 not in scored:
        assert "downstream: step-2 is not scored: step-3 replaces it" in proc.stdout
    manager = task_manager(TASKS, tasks)
    for step, row in scored.items():
        model = BloomnativeLM(dump / "checkpoints" / f"step-{step}", batch_size=4, device="cpu")
        reference = lm_eval.simple_evaluate(
            model=model, tasks=TASKS, limit=LIMIT, task_manager=manager
        )
        expected = metric_rows(reference)
        assert {"downstream/local_choice/acc", "downstream/local_text/word_perplexity"} <= set(
            expected
        )
        assert {k: v for k, v in row.items() if k.startswith("downstream/")} == pytest.approx(
            expected, rel=1e-9
        )


def test_a_failing_evaluation_is_one_line_and_changes_nothing_in_training(runs, fsdp_run):
    out, world = runs
    dump, proc = out / "broken", world.result("broken")
    assert losses_by_step(dump) == losses_by_step(fsdp_run[0])
    assert not [row for row in rows_of(dump) if "downstream_seconds" in row]
    output = (proc.stdout + proc.stderr).splitlines()
    failed = [line for line in output if "downstream: scoring" in line]
    assert len(failed) == 2, failed  # started, failed
    assert "scoring step-3 failed (exit code 1)" in failed[1]
    assert "nonexistent.jsonl" in failed[1], failed[1]


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            ["--downstream.tasks=local_choise"],
            "config error: downstream.tasks: unknown task 'local_choise' (not in lm_eval's "
            "registry or in {tasks}); nearest: local_choice",
        ),
        (["--downstream.limit=0"], "config error: downstream.limit must be >= 1, got 0"),
        (["--downstream.include_path={bad}"], "config error: downstream.tasks: task file {bad}/"),
        (
            ["--downstream.freq=3"],
            "config error: downstream.freq = 3 must be a multiple of checkpoint.interval = 2",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_training(
    settings, message, synthetic_corpus, tasks, tmp_path, capsys
):
    bad = tmp_path / "unparsable"
    bad.mkdir()
    (bad / "task.yaml").write_text("task: broken\n  dataset_path: [json\n")
    tokenizer = write_word_tokenizer(tmp_path / "tokenizer.json")
    argv = [*TINY_RUN, f"--data.blend={synthetic_corpus}", f"--data.tokenizer={tokenizer}"]
    argv += [f"--job.dump_folder={tmp_path / 'run'}", "--checkpoint.interval=2"]
    argv += ["--downstream.freq=2", "--downstream.tasks=local_choice"]
    argv += [f"--downstream.include_path={tasks}"]
    argv += [s.format(tasks=tasks, bad=bad) for s in settings]
    assert preflight(["--world-size=1", *argv]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(message.format(tasks=tasks, bad=bad)), line
    assert not (tmp_path / "run").exists()


def test_without_the_harness_downstream_is_refused_in_one_line(monkeypatch, tmp_path):
    # lm_eval made absent (an import of it fails, as when not installed), and the module that
    # imports it forgotten, so that preflight's check imports it again.
    for module in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")]:
        monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.delitem(sys.modules, "bloomnative.evaluation.task_names")
    argv = ["--downstream.freq=2", "--downstream.tasks=local_choice", "--checkpoint.interval=2"]
    tokenizer = write_word_tokenizer(tmp_path / "tokenizer.json")
    config = parse_args([*argv, f"--data.tokenizer={tokenizer}"])
    with pytest.raises(ConfigError) as refusal:
        downstream_module.check_tasks(config)
    (line,) = str(refusal.value).splitlines()
    assert line.startswith("downstream.freq = 2 needs lm-evaluation-harness"), line
    assert "pip install 'bloomnative[eval]'" in line


class Lines:
    """The module's logger, recording its lines."""

    def __init__(self):
        self.lines: list[str] = []

    def info(self, line: str) -> None:
        self.lines.append(line)

    warning = info


class FakeProcess:
    """An evaluation process that ends when the test says (`returncode`)."""

    def __init__(self, started: list, command: list[str], env: dict[str, str], **_):
        self.command, self.env, self.pid, self.returncode = command, env, len(started), None
        started.append(self)

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        self.returncode = -9

    def wait(self) -> int | None:
        return self.returncode


class Rows:
    def __init__(self):
        self.rows: list[dict] = []

    def log(self, row: dict) -> None:
        self.rows.append(row)


@pytest.fixture
def fake_evaluations(tmp_path, monkeypatch):
    """(make an evaluator, the processes it started, its log lines, its metrics rows); no
    process is started."""
    started: list[FakeProcess] = []
    lines, rows = Lines(), Rows()
    monkeypatch.setattr(downstream_module, "_log", lines)
    monkeypatch.setattr(
        downstream_module.subprocess,
        "Popen",
        lambda command, **kwargs: FakeProcess(started, command, **kwargs),
    )
    monkeypatch.setenv("RANK", "0")  # torchrun's, which the evaluation must not see

    def make(**settings) -> DownstreamEvaluator:
        cfg = DownstreamConfig(tasks=["t"], freq=2, **settings)
        return DownstreamEvaluator(cfg, tmp_path / "checkpoints", tmp_path, rows)

    return make, started, lines.lines, rows.rows


def test_one_evaluation_at_a_time_the_newest_due_checkpoint_waits(fake_evaluations, tmp_path):
    make, started, lines, rows = fake_evaluations
    evaluator = make()

    def saved(step: int) -> None:
        (tmp_path / "checkpoints" / f"step-{step}").mkdir(parents=True)
        evaluator.checkpoint_saved(step)

    evaluator.checkpoint_saved(1)  # not due
    evaluator.checkpoint_saved(2)  # an async save: not complete yet
    assert started == []
    saved(4)  # step-2 is not there: replaced
    assert [p.command[-3] for p in started] == [str(tmp_path / "checkpoints" / "step-4")]
    assert "RANK" not in started[0].env
    saved(6)
    saved(8)
    assert len(started) == 1
    assert lines[-2:] == [
        "downstream: step-6 waits: step-4 is still being scored",
        "downstream: step-6 is not scored: step-8 replaces it",
    ]
    (tmp_path / "eval" / "step-4.log").write_text("Traceback\n  ...\nFileNotFoundError: x\n")
    started[0].returncode = 1
    evaluator.poll()
    assert "downstream: scoring step-4 failed (exit code 1)" in lines[-2]
    assert ": FileNotFoundError: x (log: " in lines[-2]
    assert started[1].command[-3].endswith("step-8") and rows == []
    results = {"results": {"t": {"alias": "t", "sample_len": 3, "acc,none": 0.5}}}
    results["results"]["t"] |= {"acc_stderr,none": 0.1, "exact_match,strip": 1, "ppl,none": "N/A"}
    Path(started[1].command[-2]).write_text(json.dumps(results))
    started[1].returncode = 0
    evaluator.finish()
    (row,) = rows
    assert row["step"] == 8 and row["downstream_seconds"] >= 0
    assert {k: v for k, v in row.items() if k.startswith("downstream/")} == {
        "downstream/t/acc": 0.5,
        "downstream/t/exact_match,strip": 1.0,
    }


def test_unparsable_results_one_past_wait_s_and_one_that_cannot_start_are_one_line(
    fake_evaluations, tmp_path, monkeypatch
):
    make, started, lines, rows = fake_evaluations
    evaluator = make(wait_s=0)
    for step in (2, 4):
        (tmp_path / "checkpoints" / f"step-{step}").mkdir(parents=True)
    evaluator.checkpoint_saved(2)
    Path(started[0].command[-2]).write_text("{not json")
    started[0].returncode = 0
    evaluator.checkpoint_saved(4)
    assert "downstream: the results of step-2" in lines[-2] and "do not parse" in lines[-2]
    evaluator.finish()
    assert lines[-1].startswith("downstream: abandoned the score of step-4 after ")
    assert started[1].returncode == -9 and rows == []

    def no_process(command, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(downstream_module.subprocess, "Popen", no_process)
    (tmp_path / "checkpoints" / "step-6").mkdir()
    evaluator.checkpoint_saved(6)  # not started: one line, and training goes on
    assert (
        lines[-1] == "downstream: scoring step-6 could not start: [Errno 12] Cannot allocate memory"
    )
    assert len(started) == 2 and evaluator.running is None
