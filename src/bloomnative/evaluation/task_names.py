"""Which lm-evaluation-harness tasks a command line names, checked before any model is loaded:
the harness's own registry plus the task YAMLs of an include folder (local tasks, e.g. reading
JSONL files). The harness itself skips a YAML that does not parse and treats a missing folder
as empty; here either is an error that names the file."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path

from lm_eval.tasks import TaskManager
from lm_eval.tasks._yaml_loader import load_yaml


class TaskError(ValueError):
    """A task name or task folder the harness cannot use; the message is one line."""


def check_task_folder(folder: str | Path) -> None:
    """Raises TaskError when `folder` is not a folder or one of its *.yaml files (at any depth)
    does not parse as a task configuration (a YAML mapping; `!function` tags are not run)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TaskError(f"task folder {folder} is not a folder")
    for path in sorted(folder.rglob("*.yaml")):
        try:
            load_yaml(path, resolve_func=False)
        except Exception as e:  # yaml's errors, ValueError, OSError: all unusable
            reason = " ".join(str(e).split())
            raise TaskError(f"task file {path} does not parse: {reason}") from None


def task_manager(names: Sequence[str], include_path: str | Path | None = None) -> TaskManager:
    """The harness's task index (its own tasks and those of `include_path`), once every name in
    `names` (a task, group or tag) is found in it. When every name is a task of `include_path`
    the index holds that folder alone: indexing the harness's registry costs seconds (docs/
    evaluation.md), and a task read from one YAML needs nothing else. Raises TaskError naming
    the first unknown one and the nearest known names."""
    if not names:
        raise TaskError("no task named")
    if include_path is not None:
        check_task_folder(include_path)
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        index = local.task_index
        if all(name in index and index[name].kind.name == "TASK" for name in names):
            return local
    manager = TaskManager(include_path=None if include_path is None else str(include_path))
    known = manager.all_tasks
    for name in names:
        if name not in known:
            nearest = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
            hint = f"; nearest: {', '.join(nearest)}" if nearest else ""
            where = f" or in {include_path}" if include_path is not None else ""
            raise TaskError(f"unknown task {name!r} (not in lm_eval's registry{where}){hint}")
    return manager
