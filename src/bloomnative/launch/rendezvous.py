"""torchrun's c10d rendezvous with words: what a launcher says and does when a node is lost.

`bloomnative.launch.torchrun` registers this as torchrun's rendezvous backend `bloomnative`
(`register()`; run_train.sh passes `--rdzv-backend=bloomnative` when NNODES is not 1). It is
torchrun's own c10d rendezvous (the store on RDZV_ENDPOINT, hosted by the launcher that binds it
first), wrapped so that no launcher waits without saying so:

- a launcher that does not host the store waits for it to answer on RDZV_ENDPOINT before
  torchrun connects (`reach_store`), saying so after `WAIT_WORDS_AFTER_S`; a store that does
  not answer within `join_timeout` is one line (`NoRendezvous`: is the first node's launcher
  started, is RDZV_ENDPOINT its address?) instead of torchrun's two 60 s connection timeouts,
  their C++ frames and a "lost node" that never was;
- a rendezvous that has not completed after `WAIT_WORDS_AFTER_S` (a restart after a lost node,
  or nodes started apart) says what it waits for and for how long (`join_timeout` in
  `--rdzv-conf`, which run_train.sh sets to job.collective_timeout_s); when that runs out the
  launcher ends with one line instead of torchrun's traceback: `NodeLost` once this launcher
  has been in a round that formed, else `NoRendezvous` (the job never formed: no node was
  lost);
- once a round has formed, every launcher beats a counter of its own for that round in the
  rendezvous store every `BEAT_S` and watches the others'. A node whose counter has not moved
  for `LOST_AFTER_S` is named in one line; if this node's workers have already finished
  (torchrun's exit barrier, which would wait 300 s for it), the launcher ends at once with
  exit 0. Workers still running
  find out on their own: their collective fails or times out (job.collective_timeout_s) and
  torchrun restarts them into a new rendezvous, which waits for the lost node to come back.

The store itself cannot outlive the node that hosts it: its loss ends every launcher at once
with `store_lost_line` (launch.py prints it). Each rendezvous round also gets fresh worker
addresses (TORCH_DISABLE_SHARE_RDZV_TCP_STORE): with torchrun's shared store a surviving launcher
keeps the previous round's and never publishes the new round's, which a node that rejoins waits
for until it times out (the workers then make their process group's store on the address
published for their round, as under plain torchrun).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.utils import (
    _matches_machine_hostname,
    parse_rendezvous_endpoint,
)

from bloomnative.log import get_logger

_log = get_logger(__name__)

BACKEND = "bloomnative"
WAIT_WORDS_AFTER_S = 5.0
BEAT_S = 1.0
LOST_AFTER_S = 15.0
"""As torchrun's own keep-alive (3 missed beats of 5 s) before it drops a node from the
rendezvous."""
_ALIVE = "bloomnative/alive/"


class NodeLost(RuntimeError):
    """A rendezvous that cannot complete after one that did: a node did not come back in time.
    Its text is the one line the launcher prints."""


class NoRendezvous(RuntimeError):
    """A first rendezvous that never formed: the store on RDZV_ENDPOINT did not answer, or the
    nodes did not all join. Nothing had started, so no node was lost. Its text is the one line
    the launcher prints."""


def reach_store(endpoint: str, timeout_s: float, retry_s: float = 1.0) -> None:
    """Waits until something accepts connections on `endpoint` (host:port), for a launcher that
    does not host the rendezvous store: the first node's launcher binds it once its preflight
    is done. Says what it waits for after WAIT_WORDS_AFTER_S.

    Raises:
        NoRendezvous: nothing answered within `timeout_s`, naming the endpoint and the last
            connection error.
    """
    host, port = parse_rendezvous_endpoint(endpoint, default_port=29400)
    start = time.monotonic()
    said = False
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(retry_s, 1.0)):
                return
        except OSError as e:
            error = e.strerror or str(e) or type(e).__name__
        waited = time.monotonic() - start
        if waited >= timeout_s:
            raise NoRendezvous(unreachable_line(endpoint, timeout_s, error))
        if not said and waited >= WAIT_WORDS_AFTER_S:
            said = True
            _log.warning(
                f"waiting for the rendezvous at {endpoint} (RDZV_ENDPOINT) to answer (up to "
                f"{timeout_s:g} s, job.collective_timeout_s): the first node's run_train.sh "
                f"hosts it once its preflight is done (last try: {error})"
            )
        time.sleep(min(retry_s, max(timeout_s - waited, 0.0)))


def unreachable_line(endpoint: str, timeout_s: float, error: str) -> str:
    """The launcher's last words when the rendezvous store was never reached."""
    return (
        f"could not reach the rendezvous at {endpoint} (RDZV_ENDPOINT) within {timeout_s:g} s "
        f"({error}); no node was lost: the job never formed. Is the first node's run_train.sh "
        "started (it hosts the rendezvous), and is RDZV_ENDPOINT its host:port on every node?"
    )


def store_lost_line(endpoint: str) -> str:
    """The launcher's last words when the rendezvous store on `endpoint` stops answering."""
    return (
        f"node lost: the rendezvous store at {endpoint} (RDZV_ENDPOINT) no longer answers: the "
        "node that hosts it (where the first launcher started) is gone, and the job with it on "
        "every node. Start run_train.sh again on every node: the job resumes from the newest "
        "complete checkpoint"
    )


def register(workers_running: Callable[[], bool], before_exit: Callable[[], None]) -> None:
    """Makes `--rdzv-backend=bloomnative` known to torchrun in this process (idempotent).
    `workers_running`: whether this launcher has live workers; `before_exit` runs before a
    launcher whose workers finished stops waiting for a lost node."""
    _launcher.update(workers_running=workers_running, before_exit=before_exit)
    rendezvous_handler_registry.register(BACKEND, _create)


_launcher: dict[str, Callable[[], object]] = {}
"""What `register` was given."""


def _create(params: RendezvousParameters) -> RendezvousHandler:
    c10d = RendezvousParameters(
        "c10d",
        params.endpoint,
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        **params.config,
    )
    # Read by the handler at each rendezvous, and by torchrun's agent when it starts workers.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    join_timeout_s = int(params.get("join_timeout", 600))
    host, _ = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    if not _matches_machine_hostname(host):  # the store is another node's (torch's own rule)
        reach_store(params.endpoint, join_timeout_s)
    try:
        handler = rendezvous_handler_registry.create_handler(c10d)
    except (RendezvousConnectionError, dist.DistNetworkError) as e:  # it answered, then not
        cause = e.__cause__ or e
        raise NoRendezvous(
            unreachable_line(params.endpoint, join_timeout_s, str(cause).splitlines()[0])
        ) from None
    return WatchedRendezvous(
        handler,
        params.endpoint,
        params.min_nodes,
        params.max_nodes,
        join_timeout_s,
    )


class WatchedRendezvous(RendezvousHandler):
    """torchrun's c10d rendezvous handler with words (see the module docstring); what is not
    defined here is the wrapped handler's."""

    def __init__(
        self,
        handler: RendezvousHandler,
        endpoint: str,
        min_nodes: int,
        max_nodes: int,
        join_timeout_s: int,
    ):
        self._handler = handler
        self._endpoint = endpoint
        self._nodes = str(min_nodes) if min_nodes == max_nodes else f"{min_nodes}:{max_nodes}"
        self._join_timeout_s = join_timeout_s
        self._watch: _PeerWatch | None = None
        self._formed = False
        """Whether a round of this launcher's has formed: only then can a node be lost."""
        self._last_call = time.monotonic()

    def get_run_id(self) -> str:
        return self._handler.get_run_id()

    def is_closed(self) -> bool:
        return self._handler.is_closed()

    def set_closed(self) -> None:
        self._handler.set_closed()

    @property
    def use_agent_store(self) -> bool:
        return self._handler.use_agent_store

    def next_rendezvous(self) -> RendezvousInfo:
        if self._watch is not None:
            self._watch.stop()
        self._last_call = float("inf")  # not waiting on the agent while in here
        words = threading.Timer(WAIT_WORDS_AFTER_S, self._say_waiting)
        words.daemon = True
        words.start()
        try:
            info = self._handler.next_rendezvous()
        except RendezvousTimeoutError:
            if not self._formed:
                raise NoRendezvous(
                    f"the rendezvous at {self._endpoint} did not form: NNODES={self._nodes} "
                    f"nodes did not all join within {self._join_timeout_s} s "
                    "(job.collective_timeout_s); no node was lost. Start run_train.sh on every "
                    "node, each with this RDZV_ENDPOINT and the same RDZV_ID"
                ) from None
            raise NodeLost(
                f"node lost: NNODES={self._nodes} nodes did not all join the rendezvous at "
                f"{self._endpoint} within {self._join_timeout_s} s (job.collective_timeout_s). "
                "Start run_train.sh again on the missing node (it rejoins a waiting job), or "
                "on every node: the job resumes from the newest complete checkpoint"
            ) from None
        finally:
            words.cancel()
            self._last_call = time.monotonic()
        self._formed = True
        # The round's workers' address (fresh each round) names the round's beats.
        bootstrap = info.bootstrap_store_info
        assert bootstrap is not None  # c10d's handler always publishes it
        round_id = f"{bootstrap.master_addr}:{bootstrap.master_port}"
        self._watch = _PeerWatch(
            self._endpoint, round_id, info.rank, info.world_size, self._agent_idle
        )
        return info

    def get_backend(self) -> str:
        return BACKEND

    def shutdown(self) -> bool:
        """The agent is done: nothing left to watch."""
        if self._watch is not None:
            self._watch.stop()
        return self._handler.shutdown()

    def num_nodes_waiting(self) -> int:
        self._last_call = time.monotonic()  # the agent asks this while its workers run
        return self._handler.num_nodes_waiting()

    def _say_waiting(self) -> None:
        how = (
            "a node that was lost rejoins when run_train.sh is started on it again"
            if self._formed
            else "each node joins when its run_train.sh has passed preflight"
        )
        _log.warning(
            f"waiting for NNODES={self._nodes} nodes to join the rendezvous at {self._endpoint} "
            f"(up to {self._join_timeout_s} s, job.collective_timeout_s); {how}"
        )

    def _agent_idle(self) -> bool:
        """Whether torchrun's agent has stopped polling this handler with no workers left:
        its workers finished and it waits in the exit barrier."""
        idle_s = time.monotonic() - self._last_call
        return idle_s > 2 * BEAT_S and not _launcher["workers_running"]()


class _PeerWatch:
    """Every launcher of a round beats its counter in the rendezvous store every BEAT_S and
    watches the others' (see the module docstring). Through a connection of its own: torchrun's
    agent holds its own for as long as a wait takes (the exit barrier's, 300 s)."""

    def __init__(
        self,
        endpoint: str,
        round_id: str,
        rank: int,
        world_size: int,
        agent_idle: Callable[[], bool],
    ):
        self._endpoint, self._round_id = endpoint, round_id
        self._rank, self._world_size = rank, world_size
        self._agent_idle = agent_idle
        self._stopped = threading.Event()
        threading.Thread(target=self._run, name="bloomnative-peer-watch", daemon=True).start()

    def _connect(self) -> dist.Store:
        host, port = parse_rendezvous_endpoint(self._endpoint, default_port=29400)
        store = dist.TCPStore(
            host, port, is_master=False, timeout=datetime.timedelta(seconds=LOST_AFTER_S)
        )
        return dist.PrefixStore(f"{_ALIVE}{self._round_id}/", store)

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        try:
            self._store = self._connect()
            self._store.set(
                f"name/{self._rank}", f"{socket.gethostname()} (launcher pid {os.getpid()})"
            )
        except Exception:  # the store is gone: the agent's next call says so
            return
        start = time.monotonic()
        # rank: (its count, when it last moved)
        seen = {r: (0, start) for r in range(self._world_size) if r != self._rank}
        reported: set[int] = set()
        idle_before = False
        while not self._stopped.wait(BEAT_S):
            try:
                self._store.add(f"beat/{self._rank}", 1)
                counts = {
                    r: self._store.add(f"beat/{r}", 0)
                    for r in range(self._world_size)
                    if r != self._rank
                }
            except Exception:  # the store is gone: the agent's next call says so
                return
            now = time.monotonic()
            for r, count in counts.items():
                if seen[r][0] != count:
                    seen[r] = (count, now)
            lost = [r for r, (_, moved) in seen.items() if now - moved > LOST_AFTER_S]
            for r in sorted(set(lost) - reported):
                reported.add(r)
                _log.warning(
                    f"node lost: {self._describe(r)} has not answered for {LOST_AFTER_S:g} s"
                )
            # Idle twice in a row: a restart leaves the agent without workers for a moment only.
            idle = self._agent_idle()
            if lost and idle and idle_before:
                _log.warning(
                    "this node's workers have finished: not waiting for the lost node in "
                    "torchrun's exit barrier"
                )
                _launcher["before_exit"]()
                sys.stderr.flush()
                os._exit(0)
            idle_before = idle

    def _describe(self, rank: int) -> str:
        key = f"name/{rank}"
        try:  # a node lost before it wrote its name has none
            name = self._store.get(key).decode() if self._store.check([key]) else "unnamed"
        except Exception:
            name = "unnamed"
        return f"node {rank} of the rendezvous ({name})"
