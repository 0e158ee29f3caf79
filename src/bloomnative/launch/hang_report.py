"""Hang diagnosis: which rank did not arrive at a collective, from the records the ranks wrote
(`bloomnative.train.hang`).

`summarize_hang(folder, since)` reads the records of the newest attempt and names, in one line,
the rank that did not arrive: one that wrote no record (stuck before the collective, and killed
there), or one whose records show it behind the others (an earlier collective of the group, an
earlier step). `python -m bloomnative.launch.hang_report <dump_folder>/hang` prints that line, and
a launcher whose job failed logs it with `report(trainer_argv, since=launch_time)`.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from bloomnative.log import get_logger
from bloomnative.train.hang import HANG_FOLDER

_log = get_logger(__name__)


def summarize_hang(folder: Path, since: float = 0.0) -> str | None:
    """One line naming the rank(s) that did not arrive, from the newest attempt's records in
    `folder` (<dump_folder>/hang) written at `since` (a time.time()) or later, as a launcher
    asks about its own job; None when there are none."""
    records = []
    for path in sorted(folder.glob("rank-*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # being written, or cut short: the others still tell
    records = [r for r in records if r["written_at"] >= since]
    if not records:
        return None
    newest = max(records, key=lambda r: r["written_at"])["attempt"]
    records = sorted((r for r in records if r["attempt"] == newest), key=lambda r: r["rank"])
    world = records[0]["world_size"]
    waited = [r for r in records if r["in_flight"]]
    where = _common_wait(waited or records)
    missing = sorted(set(range(world)) - {r["rank"] for r in records})
    if missing:
        culprits, why = missing, "it wrote no record (stuck before the collective)"
    else:
        culprits, why = _behind(records)
    recorded = [r["rank"] for r in records]
    if not culprits:
        return (
            f"hang: every rank ({_ranks(recorded)}) failed {where}; none is behind the others "
            f"(records in {folder})"
        )
    waiting = [rank for rank in recorded if rank not in culprits]
    return (
        f"hang: {_ranks(culprits)} did not arrive at {where}: {why}; {_ranks(waiting)} waited "
        f"there (records in {folder})"
    )


def _common_wait(records: list[dict[str, Any]]) -> str:
    """Where most ranks were: the collective and group, the step, micro batch, pipeline action."""
    r = Counter(
        json.dumps({k: r[k] for k in ("step", "phase", "micro_batch", "pipeline_action")})
        for r in records
    ).most_common(1)[0][0]
    r = json.loads(r)
    flights = Counter(
        f"{f['op']} #{f['seq']} of group {f['group']}"
        for f in (x["in_flight"] for x in records)
        if f
    )
    parts = [flights.most_common(1)[0][0]] if flights else ["a collective"]
    parts.append(f"step {r['step']} ({r['phase']}")
    if r["micro_batch"] is not None:
        parts[-1] += f", micro batch {r['micro_batch']}"
    if r["pipeline_action"]:
        parts[-1] += f", {r['pipeline_action']}"
    parts[-1] += ")"
    return ", ".join(parts)


def _behind(records: list[dict[str, Any]]) -> tuple[list[int], str]:
    """Ranks behind the others: at an earlier step, or at an earlier collective of a group."""
    top_step = max(r["step"] for r in records)
    behind = {r["rank"]: f"step {r['step']}" for r in records if r["step"] < top_step}
    groups = {g for r in records for g in r["last_seq_by_group"]}
    for group in sorted(groups):
        seqs = {
            r["rank"]: r["last_seq_by_group"][group]
            for r in records
            if group in r["last_seq_by_group"]
        }
        top = max(seqs.values())
        for rank, seq in seqs.items():
            if seq < top:
                behind.setdefault(rank, f"collective #{seq} of group {group} (others: #{top})")
    if not behind:
        return [], ""
    ranks = sorted(behind)
    return ranks, "behind the others: " + "; ".join(f"rank {r} at {behind[r]}" for r in ranks)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def report(trainer_argv: list[str], since: float) -> str | None:
    """What a launcher calls when its job failed: logs (and returns) the summary of the hang
    records its job wrote, started at `since` with the trainer arguments `trainer_argv`."""
    from bloomnative.config import ConfigError, parse_args

    try:
        dump_folder = Path(parse_args(trainer_argv).job.dump_folder)
    except ConfigError:
        return None  # preflight said so already
    line = summarize_hang(dump_folder / HANG_FOLDER, since)
    if line:
        _log.error(line)
    return line


def main(argv: list[str]) -> int:
    """`python -m bloomnative.launch.hang_report FOLDER`: prints `summarize_hang(FOLDER)`, if
    any."""
    if len(argv) != 1:
        usage = "usage: python -m bloomnative.launch.hang_report <dump_folder>/hang"
        print(usage, file=sys.stderr)
        return 2
    line = summarize_hang(Path(argv[0]))
    if line:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
