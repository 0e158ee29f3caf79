"""A lost node is handled in seconds, with words (bloomnative.launch.rendezvous): two launchers of
run_train.sh on this host act as two nodes (NNODES=2, NPROC=1, RDZV_ENDPOINT on 127.0.0.1).

- the node that hosts the rendezvous store is killed: the other ends at once, exit 3, its last
  line naming the store's address and what to do, no C++ frames;
- the other node is killed: the survivor says it waits for it, the node's launcher started
  again rejoins, and the job resumes and ends with the losses of an uninterrupted run; a node
  whose launcher then freezes is named, and the survivor, its workers done, does not wait for
  it in torchrun's exit barrier (300 s);
- a node that never comes: the rendezvous ends after job.collective_timeout_s, with its line,
  which names no lost node (the job never formed) and exits 2 (tests/launch/
  test_rendezvous_words.py has the other words of a rendezvous that never formed).

The time bounds are bounds on waiting (generous for a loaded 2-core machine), not performance
figures."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from bloomnative.launch.rendezvous import LOST_AFTER_S, store_lost_line
from bloomnative.launch.torchrun import NODE_LOST_EXIT
from harness.launching import logged_rows, start, train_env, wait_for
from harness.slurm_cluster import free_port
from harness.training import REPO, TINY_RUN, losses_by_step, train_command

STEPS = 6
ENDED_WITHIN_S = 30  # after the event that should end a launcher
STARTED_WITHIN_S = 180  # a launcher's preflight, rendezvous and workers on a loaded machine


class Node:
    """One run_train.sh acting as a node, in a session of its own (a node's processes all die
    together: its launcher's process group, and its workers through exit_with_launcher)."""

    def __init__(self, name: str, args: list[str], endpoint: str, folder: Path):
        self.log = folder / f"{name}.log"
        env = {"NNODES": "2", "NPROC": "1", "RDZV_ENDPOINT": endpoint, "MAX_RESTARTS": "3"}
        with self.log.open("w") as out:
            self.proc = start(
                [str(REPO / "run_train.sh"), *args],
                env=train_env(env),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, predicate, what: str, timeout: float = STARTED_WITHIN_S) -> None:
        wait_for(predicate, self.proc, timeout, what, self.output)

    def says(self, text: str) -> bool:
        return text in self.output()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_two_nodes(args: list[str], folder: Path) -> tuple[Node, Node, str]:
    """(the store's host, the other node, the endpoint): the second starts once the first
    listens on the endpoint."""
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    host = Node("host", args, endpoint, folder)
    host.wait_for(lambda: listening(port), "the rendezvous store")
    return host, Node("other", args, endpoint, folder), endpoint


def run_args(corpus: str, dump: Path, *extra: str) -> list[str]:
    return [
        *TINY_RUN,
        f"--data.blend={corpus}",
        f"--job.dump_folder={dump}",
        f"--training.steps={STEPS}",
        f"--lr_scheduler.decay_steps={STEPS}",
        "--checkpoint.interval=2",
        *extra,
    ]


@pytest.mark.multiprocess
def test_the_loss_of_the_stores_node_ends_the_other_at_once_with_one_line(
    tmp_path, synthetic_corpus
):
    host, other, endpoint = start_two_nodes(run_args(synthetic_corpus, tmp_path / "run"), tmp_path)
    try:
        other.wait_for(lambda: logged_rows(tmp_path / "run") >= 1, "a logged step")
        host.kill()
        killed_at = time.monotonic()
        other.proc.wait(timeout=ENDED_WITHIN_S)  # not torchrun's 60 s store timeouts, or 600
        ended = time.monotonic() - killed_at
    finally:
        host.kill()
        other.kill()
    output = other.output()
    assert other.proc.returncode == NODE_LOST_EXIT, output[-4000:]
    assert output.splitlines()[-1] == store_lost_line(endpoint)
    assert "frame #" not in output
    assert ended < ENDED_WITHIN_S


@pytest.mark.multiprocess
def test_a_lost_node_rejoins_and_the_job_resumes_exactly_then_a_frozen_one_is_not_awaited(
    tmp_path, synthetic_corpus
):
    dump, reference = tmp_path / "run", tmp_path / "reference"
    args = run_args(synthetic_corpus, dump)
    # The same run uninterrupted, as 2 processes on one node, meanwhile.
    uninterrupted = start(
        train_command(run_args(synthetic_corpus, reference), nproc=2),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    host, other, endpoint = start_two_nodes(args, tmp_path)
    rejoined = None
    try:
        host.wait_for(lambda: logged_rows(dump) >= 3, "3 logged steps (a checkpoint at step 2)")
        waiting = f"waiting for NNODES=2 nodes to join the rendezvous at {endpoint}"
        said = host.output().count(waiting)  # at the start, while the other node started
        other.kill()
        killed_at = time.monotonic()
        rejoined = Node("rejoined", args, endpoint, tmp_path)  # joins once torchrun drops the
        # lost node from the rendezvous (15 s without its keep-alive)
        words = lambda: host.output().count(waiting) > said
        host.wait_for(words, "the survivor's words", ENDED_WITHIN_S)
        assert time.monotonic() - killed_at < ENDED_WITHIN_S
        # Rank 0, which says it, may be on either node: torch ranks the nodes of a round by
        # (host, launcher pid), and on one host the rejoined launcher's pid is smaller than
        # the survivor's once the system's pids have wrapped around.
        resumed = lambda: host.says("resumed from") or rejoined.says("resumed from")
        host.wait_for(resumed, "the resume")
        # Its launcher frozen (a hung node), its workers train on to the end; the survivor's
        # launcher, its workers done, names it and does not wait for it in the exit barrier.
        os.kill(rejoined.proc.pid, signal.SIGSTOP)
        host.wait_for(lambda: len(losses_by_step(dump)) == STEPS, "the last step")
        trained_at = time.monotonic()
        host.proc.wait(timeout=LOST_AFTER_S + ENDED_WITHIN_S)  # not torchrun's 300 s
        assert uninterrupted.wait(timeout=STARTED_WITHIN_S) == 0
    finally:
        for node in (host, other, rejoined):
            if node is not None:
                node.kill()
        if uninterrupted.poll() is None:
            uninterrupted.kill()
    output = host.output()
    assert host.proc.returncode == 0, output[-4000:]
    assert "node lost: node " in output and "has not answered for" in output
    assert output.splitlines()[-1].endswith(
        "this node's workers have finished: not waiting for the lost node in torchrun's exit "
        "barrier"
    )
    assert time.monotonic() - trained_at < LOST_AFTER_S + ENDED_WITHIN_S
    assert sorted(losses_by_step(dump)) == list(range(1, STEPS + 1))
    assert losses_by_step(dump) == pytest.approx(losses_by_step(reference), rel=1e-6)


@pytest.mark.multiprocess
def test_a_node_that_never_comes_ends_the_first_rendezvous_after_the_timeout_not_as_lost(
    tmp_path, synthetic_corpus
):
    endpoint = f"127.0.0.1:{free_port()}"
    args = [*run_args(synthetic_corpus, tmp_path / "run"), "--job.collective_timeout_s=8"]
    started = time.monotonic()
    alone = Node("alone", args, endpoint, tmp_path)
    try:
        alone.proc.wait(timeout=STARTED_WITHIN_S)
    finally:
        alone.kill()
    lines = alone.output().splitlines()
    assert alone.proc.returncode == 2, lines[-20:]
    assert lines[-1] == (
        f"the rendezvous at {endpoint} did not form: NNODES=2 nodes did not all join within 8 s "
        "(job.collective_timeout_s); no node was lost. Start run_train.sh on every node, each "
        "with this RDZV_ENDPOINT and the same RDZV_ID"
    )
    assert f"waiting for NNODES=2 nodes to join the rendezvous at {endpoint}" in lines[-2]
    assert time.monotonic() - started < STARTED_WITHIN_S
