"""A job that shrinks instead of dying: two run_train.sh launchers act as two nodes of an elastic
job (NNODES=1:2, NPROC=2 each); one is killed after a checkpoint, and the survivor's torchrun
restarts its workers as a world of 2, which resumes from the newest verified checkpoint at the
same global batch (twice the accumulation), the same sample order and the same learning-rate
clock: every step's loss equals the uninterrupted 4-process run's. Each world size gets the memory
planner's least-memory layout within the fixed tp and pp, and its own "auto" recomputation.
Preflight refuses a node range whose smallest world cannot hold the layout, in one line, before
any worker starts."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
from pathlib import Path
from unittest.mock import ANY

import pytest

from bloomnative.config import model_args_from_config, parse_args
from bloomnative.launch.cli import LaunchSettings
from bloomnative.launch.preflight import preflight
from bloomnative.planner import estimate, workload_from_config
from bloomnative.train.resolved import resolve_run
from bloomnative.train.run_lock import JOB_VAR, DumpFolderInUseError, RunLock, this_process
from harness.launching import REPO, start, train_env, wait_for
from harness.slurm_cluster import free_port
from harness.training import TINY_RUN, metric_rows, run_training

RUN_TRAIN = str(REPO / "run_train.sh")
STEPS = 12  # the kill lands after the first checkpoint (step 2), well before the end
SAVE_EVERY = 2  # the steps replayed after the kill: those since the newest checkpoint
LAST_CALL_S = 5  # how long the rendezvous waits for more nodes once one has joined
STARTED = re.compile(r"\(world (\d+)\), device \S+, dtype \S+, starting at step (\d+)")
SAVED = re.compile(r"saved checkpoint step-(\d+)")


def args(dump: Path, corpus: str) -> list[str]:
    return [
        *TINY_RUN,
        f"--data.blend={corpus}",
        f"--job.dump_folder={dump}",
        f"--training.steps={STEPS}",
        f"--lr_scheduler.decay_steps={STEPS}",
        f"--checkpoint.interval={SAVE_EVERY}",
    ]


def listens_on(pid: int, port: int) -> bool:
    """Whether process `pid` has a socket listening on TCP `port` (Linux /proc)."""
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rpartition(":")[2], 16) == port:
                listening.add(f"socket:[{inode}]")
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd) in listening:
                return True
        except OSError:
            continue  # closed meanwhile
    return False


def checkpointed_at_world_4(log: Path) -> bool:
    """Whether the newest start logged in `log` (by rank 0, on whichever node it is) is a world
    of 4 that has since saved a checkpoint."""
    text = log.read_text()
    starts = list(STARTED.finditer(text))
    return bool(starts) and starts[-1][1] == "4" and bool(SAVED.search(text, starts[-1].end()))


@pytest.mark.multiprocess
def test_a_job_that_loses_a_node_continues_on_the_survivor_with_the_same_losses(
    tmp_path, synthetic_corpus
):
    reference = tmp_path / "reference"
    run_training(args(reference, synthetic_corpus), nproc=4, timeout=300)

    dump = tmp_path / "elastic"
    port = free_port()
    env = train_env(
        {
            "NPROC": "2",
            "NNODES": "1:2",
            "RDZV_ENDPOINT": f"127.0.0.1:{port}",
            "RDZV_LAST_CALL_S": str(LAST_CALL_S),
            "MAX_RESTARTS": "3",
        }
    )
    logs = [tmp_path / f"node_{node}.log" for node in (0, 1)]
    nodes = []
    for log in logs:
        with log.open("w") as out:
            nodes.append(
                start(
                    [RUN_TRAIN, *args(dump, synthetic_corpus)],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # a process group per node, killed as a whole
                )
            )
    both = lambda: "".join(f"--- node {n}\n{p.read_text()[-3000:]}" for n, p in enumerate(logs))
    try:
        wait_for(
            lambda: any(map(checkpointed_at_world_4, logs)),
            nodes[0],
            180,
            "a checkpoint of the 4-process world",
            both,
        )
        # Both nodes' launchers take the endpoint for their own; the first to bind it hosts the
        # rendezvous store, whose loss is another case (the store dies with it).
        store = next((i for i, node in enumerate(nodes) if listens_on(node.pid, port)), None)
        assert store is not None, f"no launcher listens on port {port}"
        survivor, lost = nodes[store], nodes[1 - store]
        os.killpg(lost.pid, signal.SIGKILL)  # the node is gone: its launcher and its workers
        lost.wait(timeout=30)
        survivor.wait(timeout=180)
    finally:
        for proc in nodes:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    output = logs[store].read_text()
    assert survivor.returncode == 0, both()
    starts = [(int(world), int(step)) for world, step in STARTED.findall(output)]
    assert starts[-1][0] == 2 and starts[-1][1] >= SAVE_EVERY, starts
    assert f"resumed from {dump / 'checkpoints' / f'step-{starts[-1][1]}'}" in output

    expected = {row["step"]: row for row in metric_rows(reference) if "loss" in row}
    shrunk = {row["step"]: row for row in metric_rows(dump) if "loss" in row}  # last of a step
    assert sorted(shrunk) == sorted(expected) == list(range(1, STEPS + 1))
    for step, row in expected.items():
        got = shrunk[step]
        # The same samples (the loader's position in the global order) at the same learning rate.
        assert got["consumed_samples"] == row["consumed_samples"], step
        assert got["lr"] == pytest.approx(row["lr"], rel=1e-6), step
        assert abs(got["loss"] - row["loss"]) / row["loss"] < 1e-5, (step, got, row)


def test_preflight_names_the_node_count_whose_world_cannot_hold_the_layout(
    capsys, synthetic_corpus, tmp_path
):
    """tp = 4 on NPROC=2: one node of the range 1:2 cannot hold it, and a 3rd node would split the
    global batch of 8 over 6 data-parallel ranks."""
    launch = LaunchSettings.from_env({"NPROC": "2", "NNODES": "1:3", "RDZV_ENDPOINT": "n0:29500"})
    argv = [*TINY_RUN, f"--data.blend={synthetic_corpus}", f"--job.dump_folder={tmp_path}"]
    assert preflight([*argv, "--parallelism.tp=4"], launch.world_sizes(), launch.nnodes) is None
    assert capsys.readouterr().err.splitlines() == [
        "config error: NNODES=1:3: an elastic job may run on 1 to 3 nodes of NPROC=2 processes, "
        "but at 1 node (world size 2): world size 2 is not divisible by dp_replicate*cp*tp*pp = "
        "1*1*4*1 = 4; change NPROC or the degrees; the layout holds at 2 nodes: set NNODES=2, "
        "or a layout that 2 processes can run"
    ]
    assert preflight(argv, launch.world_sizes(), launch.nnodes) is None
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith("config error: NNODES=1:3: ") and "at 3 nodes (world size 6): " in line
    assert "batch size 8 is not divisible by micro_batch_size * dp = 2 * 6" in line
    assert line.endswith("the layout holds at 1, 2 nodes: set NNODES=1:2, or a layout that 6 "
                         "processes can run")  # fmt: skip
    # One node more or less: every world size of the range holds it.
    fits = LaunchSettings.from_env({"NPROC": "2", "NNODES": "1:2", "RDZV_ENDPOINT": "n0:29500"})
    assert preflight(argv, fits.world_sizes(), fits.nnodes) is not None


def test_each_world_of_the_range_gets_the_planners_least_memory_layout_and_recompute():
    """BLOOM-1b7 on 1, 2 or 4 nodes of 8 GPUs (tp = pp = 2 fixed): at each world size the
    layout resolved (dp_shard takes what tp x pp leave) needs no more memory per device, by the
    planner, than any other split of its data-parallel ranks into replicas and shards, and
    "auto" recomputation is planned for that size: the smallest world recomputes more."""
    config = parse_args(
        [
            f"--config={REPO / 'configs' / 'bloom-1b7.toml'}",
            "--parallelism.tp=2",
            "--parallelism.pp=2",
            "--activation_checkpoint.memory_budget_gib=20",
        ]
    )
    args = model_args_from_config(config.model)
    recomputed_every = {}
    for world_size in (8, 16, 32):
        run = resolve_run(config, world_size, "cpu")
        assert (run.dims.tp, run.dims.pp, run.dims.dp) == (2, 2, world_size // 4)
        chosen = run.planner_layout()
        need = lambda layout: (
            # tp = 2: the loss is not compiled
            estimate(
                args, layout, workload_from_config(config, layout, "cpu", compiled_loss=False)
            ).worst.device_bytes
        )
        dp = run.dims.dp
        others = [
            dataclasses.replace(
                chosen, dims=dataclasses.replace(chosen.dims, dp_replicate=r, dp_shard=dp // r)
            )
            for r in range(2, dp + 1)
            if dp % r == 0
        ]
        assert others and all(need(chosen) < need(other) for other in others), world_size
        assert run.recompute is not None and run.recompute.mode != "none"
        recomputed_every[world_size] = run.recompute.every  # full: every block (1)
    assert recomputed_every[8] < recomputed_every[32], recomputed_every


@pytest.mark.parametrize(
    "ours,theirs,taken",
    [
        ("17@node0:29500", "17@node0:29500", True),  # rank 0 of this job's earlier world, lost
        ("17@node0:29500", "17@node0:29600", False),  # another job's
        ("17@node0:29500", "16@node0:29500", False),  # another job's, on the same endpoint
        ("17@node0:29500", None, False),  # a single-node run's, or one from before the field
        ("", "17@node0:29500", False),  # this run is not a multi-node job
    ],
)
def test_a_lock_from_another_host_is_taken_over_only_from_an_earlier_world_of_this_job(
    tmp_path, monkeypatch, ours, theirs, taken
):
    """The node that held rank 0 (and the dump folder's lock) is lost: the smaller world's rank
    0, on another host, takes the lock over when it names this job (rendezvous id and
    endpoint)."""
    holder = {**this_process(), "host": "node7-lost", "pid": 4321}
    holder.pop("job", None)
    if theirs is not None:
        holder["job"] = theirs
    (tmp_path / "run.lock").write_text(json.dumps(holder) + "\n")
    monkeypatch.setenv(JOB_VAR, ours)
    lock = RunLock(tmp_path)
    if taken:
        lock.acquire()
        assert json.loads((tmp_path / "run.lock").read_text()) == this_process() | {"started": ANY}
        lock.release()
        assert not (tmp_path / "run.lock").exists()
    else:
        with pytest.raises(DumpFolderInUseError, match="in use by a run on another host"):
            lock.acquire()
        assert json.loads((tmp_path / "run.lock").read_text()) == holder
