"""The worker side of `shared_world.py`: runs several scenarios, one after the other, in one
world of processes (torchrun's workers, or one plain process for a world of one), as if each
were a process of its own.

    torchrun --nproc-per-node N tests/harness/world_runner.py SPEC_JSON
    python tests/harness/world_runner.py SPEC_JSON

SPEC_JSON: {"out": DIR, "scenarios": [{"name": NAME, "call": TARGET, "args": [...],
"expect": CODE}, ...]}. TARGET is `module:function` or `path/to/file.py:function` (loaded
from that file, its folder on sys.path). A scenario calls `function(*args)` on every rank and
takes what it returns as its exit code (None: 0), as `bloomnative.launch.worker.main(argv)`
returns one; the rank's stdout and stderr (the file descriptors, so C++ output too) go to
DIR/NAME/rank<R>.out and .err, and DIR/NAME/rank<R>.exit gets the exit code once it is done
(an exception is exit code 1, its traceback on stderr).

The ranks start each scenario together, once every rank has ended the one before. A rank whose
code is not the scenario's `expect` (default 0) ends the world with that code at once, as a
failed worker ends a torchrun job: its peers may be waiting for it in a collective. In a world
of one every scenario runs, whatever the codes.

A trainer releases its process group at the end of its run and the next scenario's trainer
forms a new one. torchrun's store still holds the previous group's addresses, so each scenario
forms its group under keys of its own, as a restart attempt does (TORCHELASTIC_RESTART_COUNT:
see bloomnative.train.distributed._restart_attempt_store).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch.distributed as dist

from bloomnative.train.distributed import exit_process


def resolve(target: str) -> Callable:
    """`module:function` or `path/to/file.py:function`."""
    where, _, name = target.rpartition(":")
    if where.endswith(".py"):
        path = Path(where).resolve()
        module_name = f"_scenarios_{path.stem}"
        module = sys.modules.get(module_name)
        if module is None:
            if str(path.parent) not in sys.path:
                sys.path.insert(0, str(path.parent))
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


@contextlib.contextmanager
def output_to(out: Path, err: Path) -> Iterator[None]:
    """This process's stdout and stderr (Python's and the file descriptors) into files."""
    saved = []
    for stream, path in ((sys.stdout, out), (sys.stderr, err)):
        stream.flush()
        fd = stream.fileno()
        saved.append((stream, fd, os.dup(fd)))
        with path.open("ab") as f:
            os.dup2(f.fileno(), fd)
    try:
        yield
    finally:
        for stream, fd, copy in saved:
            stream.flush()
            os.dup2(copy, fd)
            os.close(copy)


def run_scenario(scenario: dict, folder: Path, rank: int) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    with output_to(folder / f"rank{rank}.out", folder / f"rank{rank}.err"):
        try:
            code = resolve(scenario["call"])(*scenario.get("args", []))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
    code = 0 if code is None else code
    written = folder / f"rank{rank}.exit.partial"
    written.write_text(str(code))
    written.rename(folder / f"rank{rank}.exit")
    return code


def wait_for_every_rank(folder: Path, world: int) -> None:
    """Until every rank has ended the scenario of `folder`: the next one starts together, and
    a rank that fails in it cannot end the world before the others have recorded this one."""
    while not all((folder / f"rank{rank}.exit").is_file() for rank in range(world)):
        time.sleep(0.01)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    for index, scenario in enumerate(spec["scenarios"]):
        os.environ["TORCHELASTIC_RESTART_COUNT"] = f"{attempt}-scenario-{index}"
        code = run_scenario(scenario, out / scenario["name"], rank)
        if world > 1 and code != scenario.get("expect", 0):
            exit_process(code)
        wait_for_every_rank(out / scenario["name"], world)
    if dist.is_initialized():  # left by a scenario that keeps it for the next one
        dist.destroy_process_group()
    exit_process(0)


if __name__ == "__main__":
    main()
