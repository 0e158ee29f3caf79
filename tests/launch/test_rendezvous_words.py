"""What a launcher says when the rendezvous does not form (bloomnative.launch.rendezvous), decided
without starting a job: "node lost" only once the job had formed; a first rendezvous that never
formed (the store on RDZV_ENDPOINT not reached, or not every node joined) says so.

(A mistyped RDZV_ENDPOINT that resolved used to be, after two of torchrun's 60 s connection
timeouts and their C++ frames, "node lost: the rendezvous store ... no longer answers".)"""

from __future__ import annotations

import signal
import socket
import threading
import time

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from bloomnative.launch import rendezvous, torchrun
from bloomnative.launch.rendezvous import NodeLost, NoRendezvous, WatchedRendezvous
from harness.slurm_cluster import free_port


def test_a_store_that_never_answers_is_not_a_lost_node():
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    with pytest.raises(NoRendezvous) as unreachable:
        rendezvous.reach_store(endpoint, timeout_s=2, retry_s=0.2)
    assert time.monotonic() - started < 10
    line = str(unreachable.value)
    assert line.startswith(
        f"could not reach the rendezvous at {endpoint} (RDZV_ENDPOINT) within 2 s ("
    )
    assert line.endswith(
        "no node was lost: the job never formed. Is the first node's run_train.sh started (it "
        "hosts the rendezvous), and is RDZV_ENDPOINT its host:port on every node?"
    )
    assert "node lost" not in line


def test_a_store_that_starts_late_is_waited_for():
    """The first node's launcher binds the store only once its preflight is done."""
    port = free_port()
    listener = socket.socket()

    def listen_later() -> None:
        time.sleep(1.0)
        listener.bind(("127.0.0.1", port))
        listener.listen()

    threading.Thread(target=listen_later, daemon=True).start()
    try:
        rendezvous.reach_store(f"127.0.0.1:{port}", timeout_s=30, retry_s=0.2)
    finally:
        listener.close()


def test_a_launcher_that_does_not_host_the_store_waits_for_it_before_torch_connects(monkeypatch):
    """Not torch's TCPStore connection (60 s, twice, then RendezvousConnectionError, which the
    launcher took for the loss of the store's node)."""
    monkeypatch.setattr(rendezvous, "_matches_machine_hostname", lambda host: False)
    # _create sets it for torchrun's agent; the test process's later worlds must not inherit it
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")
    endpoint = f"127.0.0.1:{free_port()}"
    params = RendezvousParameters(
        "bloomnative", endpoint, "job", 2, 2, join_timeout=1, read_timeout=60
    )
    started = time.monotonic()
    with pytest.raises(NoRendezvous, match="could not reach the rendezvous at "):
        rendezvous._create(params)
    assert time.monotonic() - started < 10


class _Handler:
    """torchrun's handler, as far as WatchedRendezvous uses it: each call to next_rendezvous
    forms a round or times out, as the test says."""

    def __init__(self, rounds: list[bool]):
        self.rounds = rounds

    def next_rendezvous(self) -> RendezvousInfo:
        if not self.rounds.pop(0):
            raise RendezvousTimeoutError("timed out")
        return RendezvousInfo(None, 0, 2, RendezvousStoreInfo("127.0.0.1", 1))  # type: ignore[arg-type]

    def shutdown(self) -> bool:
        return True


class _NoWatch:
    def __init__(self, *args) -> None:
        pass

    def stop(self) -> None:
        pass


def test_a_rendezvous_that_times_out_names_a_lost_node_only_after_one_formed(monkeypatch):
    monkeypatch.setattr(rendezvous, "_PeerWatch", _NoWatch)
    first = WatchedRendezvous(_Handler([False]), "node0:29500", 2, 2, 8)  # type: ignore[arg-type]
    with pytest.raises(NoRendezvous) as never_formed:
        first.next_rendezvous()
    assert str(never_formed.value) == (
        "the rendezvous at node0:29500 did not form: NNODES=2 nodes did not all join within 8 s "
        "(job.collective_timeout_s); no node was lost. Start run_train.sh on every node, each "
        "with this RDZV_ENDPOINT and the same RDZV_ID"
    )
    restarted = WatchedRendezvous(_Handler([True, False]), "node0:29500", 2, 2, 8)  # type: ignore[arg-type]
    restarted.next_rendezvous()  # formed: the job ran
    with pytest.raises(NodeLost, match="^node lost: NNODES=2 nodes did not all join"):
        restarted.next_rendezvous()


def test_the_launcher_ends_a_rendezvous_that_never_formed_with_its_line_and_exit_2(
    capsys, monkeypatch
):
    line = rendezvous.unreachable_line("node0:29500", 600, "Connection refused")

    def torchrun_that_cannot_reach(argv: list[str]) -> None:
        raise NoRendezvous(line)

    # What the launcher sets up for its workers is this test's only (restored after it).
    for name in (torchrun.LAUNCHER_PID_VAR, torchrun.FINAL_ERRORS_VAR):
        monkeypatch.setenv(name, "")
    handler = signal.getsignal(torchrun.FINAL_ERROR_SIGNAL)
    try:
        assert torchrun._run_torchrun(torchrun_that_cannot_reach, []) == 2
    finally:
        signal.signal(torchrun.FINAL_ERROR_SIGNAL, handler)
    assert capsys.readouterr().err.strip() == line
