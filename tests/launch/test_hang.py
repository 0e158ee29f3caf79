"""Hang diagnosis (train/hang.py, launch/hang_report.py): when one rank stalls, its peers'
collective times out (job.collective_timeout_s), each of them writes what it was doing into
<dump_folder>/hang/, and the summary names the rank that did not arrive."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bloomnative.checkpoint.checkpointer import CheckpointWriteError
from bloomnative.config import parse_args
from bloomnative.launch.hang_report import report, summarize_hang
from bloomnative.launch.worker import save_failure_label
from bloomnative.train.hang import HangRecorder
from harness.launching import SCENARIO_DIR, python_command, run
from harness.training import TINY_RUN

STALL = SCENARIO_DIR / "stall_scenario.py"


@pytest.mark.multiprocess
def test_a_stalled_rank_is_named_by_the_hang_summary(synthetic_corpus, tmp_path):
    dump = tmp_path / "run"
    argv = [
        *TINY_RUN,
        f"--data.blend={synthetic_corpus}",
        f"--job.dump_folder={dump}",
        "--checkpoint.enable=false",
        "--training.steps=5",
        "--parallelism.dp_shard=2",  # FSDP: the backward all-gathers wait for the stalled rank
        "--job.collective_timeout_s=4",
    ]
    started = time.time()
    proc = run(python_command([str(STALL), "1", "3", *argv], nproc=2), timeout=240, check=False)
    assert proc.returncode != 0, proc.stdout
    assert "rank 1 stalls at step 3" in proc.stdout
    folder = dump / "hang"
    assert [p.name for p in folder.glob("rank-*.json")] == ["rank-0.json"]
    record = json.loads((folder / "rank-0.json").read_text())
    assert (record["rank"], record["world_size"], record["step"]) == (0, 2, 3)
    assert (record["phase"], record["micro_batch"]) == ("forward-backward", 1)
    assert "Timed out" in record["error"]
    waited = record["in_flight"]
    assert waited["op"].startswith("gloo:") and not waited["is_p2p"]
    assert waited["group"] == "0 (default_pg) ranks [0, 1]"  # FSDP over the whole world
    assert record["flight_recorder"][-1]["profiling_name"] == waited["op"]
    line = summarize_hang(folder)
    where = f"{waited['op']} #{waited['seq']} of group {waited['group']}"
    assert line.startswith(
        f"hang: rank 1 did not arrive at {where}, step 3 (forward-backward, micro batch 1): it "
        "wrote no record"
    ), line
    # What the launcher prints after the job, and what a user runs.
    assert report(argv, since=started) == line
    assert report(argv, since=time.time()) is None  # a later launch's failure: not this hang
    summary = run(python_command(["-m", "bloomnative.launch.hang_report", str(folder)]))
    assert summary.stdout.strip() == line


def write_record(folder: Path, rank: int, seq: int, attempt: str = "job/1", at: float = 1.0):
    """A rank's record as HangRecorder.record writes it (the fields the summary reads), at step
    3 waiting in the default group's all-reduce number `seq`."""
    folder.mkdir(parents=True, exist_ok=True)
    group = "0 (default_pg) ranks [0, 1, 2]"
    record = {
        "rank": rank,
        "world_size": 3,
        "attempt": attempt,
        "written_at": at,
        "step": 3,
        "phase": "forward-backward",
        "micro_batch": 0,
        "pipeline_action": None,
        "in_flight": {"op": "gloo:all_reduce", "group": group, "seq": seq, "is_p2p": False},
        "last_seq_by_group": {group: seq},
    }
    (folder / f"rank-{rank}.json").write_text(json.dumps(record))


def test_the_summary_names_a_rank_behind_the_others(tmp_path):
    for rank, seq in ((0, 12), (1, 12), (2, 11)):
        write_record(tmp_path, rank, seq)
    line = summarize_hang(tmp_path)
    assert line.startswith("hang: rank 2 did not arrive at gloo:all_reduce #12 of group 0"), line
    assert "rank 2 at collective #11 of group 0 (default_pg) ranks [0, 1, 2] (others: #12)" in line
    assert "; ranks 0, 1 waited there" in line
    assert summarize_hang(tmp_path / "none") is None


def test_the_summary_leaves_out_the_records_of_an_earlier_attempt(tmp_path):
    write_record(tmp_path, 0, 12, attempt="job/1", at=10.0)
    write_record(tmp_path, 1, 12, attempt="job/1", at=11.0)
    write_record(tmp_path, 2, 40, attempt="job/0", at=1.0)  # the last restart's: not this hang
    line = summarize_hang(tmp_path)
    assert line.startswith("hang: rank 2 did not arrive at gloo:all_reduce #12"), line
    assert "it wrote no record" in line and "ranks 0, 1 waited there" in line
    assert "rank 2 waited" not in line
    assert summarize_hang(tmp_path, since=20.0) is None  # all written before this launch


class FakeStage:
    """The methods of torch's PipelineStage that the schedule calls per micro batch."""

    stage_index = 1

    def forward_one_chunk(self, chunk, *args, **kwargs):
        self.seen = recorder.progress.pipeline_action
        return "output"

    def backward_one_chunk(self, chunk, *args, **kwargs):
        return None

    def backward_weight_one_chunk(self, chunk, *args, **kwargs):
        return None


recorder = HangRecorder(Path("unused"), rank=0, world_size=2, timeout_s=1)


def test_the_pipeline_action_is_recorded_while_it_runs_and_when_done():
    stage = FakeStage()
    recorder.watch_pipeline([stage])
    assert stage.forward_one_chunk(2, "x", kw=1) == "output"
    assert stage.seen == "stage 1 forward of micro batch 2"
    assert recorder.progress.pipeline_action == "stage 1 forward of micro batch 2 (done)"
    stage.backward_weight_one_chunk(3)
    assert recorder.progress.pipeline_action == "stage 1 weight backward of micro batch 3 (done)"


def test_run_train_shs_launcher_prints_the_summary_of_its_failed_jobs_hang(
    tmp_path, monkeypatch, capsys
):
    """bloomnative.launch.cli (what run_train.sh runs): after a failed job, the hang summary of
    the records that job wrote, on the launcher's stderr."""
    from bloomnative.launch import cli, preflight, torchrun

    dump = tmp_path / "run"

    def job_that_hangs(torchrun_argv: list[str]) -> int:
        for rank, seq in ((0, 12), (1, 12), (2, 11)):
            write_record(dump / "hang", rank, seq, at=time.time())
        return 1

    monkeypatch.setattr(preflight, "preflight", lambda argv, world_sizes, nnodes: parse_args(argv))
    monkeypatch.setattr(torchrun, "main", job_that_hangs)
    monkeypatch.setenv("NPROC", "1")
    assert cli.main(["--config=configs/debug.toml", f"--job.dump_folder={dump}"]) == 1
    assert "hang: rank 2 did not arrive at gloo:all_reduce #12" in capsys.readouterr().err


# What gloo raised on rank 0 when its peer's process ended during an all_reduce (torch 2.13).
LOST_PEER = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
    "peer [127.0.0.1]:57484. This is typically caused by a remote worker crashing."
)


@pytest.mark.parametrize(
    "cause, label",
    [
        (RuntimeError(LOST_PEER), "lost a peer while saving"),
        (OSError(28, "No space left on device"), "checkpoint error"),
        (None, "checkpoint error"),
    ],
)
def test_a_save_that_lost_a_peer_is_not_reported_as_a_checkpoint_error(cause, label):
    """A checkpoint the ranks write together fails on every rank when one of them dies: the
    survivors say a peer was lost, not that the checkpoint or its disk failed."""
    failure = CheckpointWriteError("writing checkpoint step-4 into step-4.partial failed")
    failure.__cause__ = cause
    assert save_failure_label(failure) == label
