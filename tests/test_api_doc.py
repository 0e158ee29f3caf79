"""docs/api.md is the public API: each package's `__all__` is exactly the names its section
lists, every listed name exists, and every snippet on the page runs."""

from __future__ import annotations

import importlib
import re
import socket

import pytest

from harness.launching import python_command, run
from harness.training import REPO, train_env

API_DOC = REPO / "docs" / "api.md"
PACKAGES = [
    "model",
    "kernels",
    "parallel",
    "planner",
    "data",
    "interop",
    "adapters",
    "evaluation",
    "train",
]


def sections() -> dict[str, str]:
    """Package name -> the text of its `## bloomnative.X` section."""
    parts = re.split(r"^## `bloomnative\.(\w+)`\n", API_DOC.read_text(), flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def listed_names(section: str) -> set[str]:
    """The first column of the section's table rows: | `name` | what |."""
    return set(re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE))


def snippets() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", API_DOC.read_text(), re.MULTILINE | re.DOTALL)


def test_every_package_has_a_section_and_a_snippet():
    found = sections()
    assert sorted(found) == sorted(PACKAGES)
    for package, text in found.items():
        assert "```python\n" in text, f"bloomnative.{package} has no snippet in {API_DOC}"


@pytest.mark.parametrize("package", PACKAGES)
def test_all_matches_the_names_the_document_lists(package):
    module = importlib.import_module(f"bloomnative.{package}")
    listed = listed_names(sections()[package])
    exported = set(module.__all__)
    assert len(module.__all__) == len(exported), f"bloomnative.{package}.__all__ repeats a name"
    assert exported == listed, (
        f"bloomnative.{package}: in __all__ but not in docs/api.md: {sorted(exported - listed)}; "
        f"in docs/api.md but not in __all__: {sorted(listed - exported)}"
    )
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert not missing, f"bloomnative.{package}.__all__ names what it does not define: {missing}"


_RUN_SNIPPETS = """
import sys
from bloomnative.train import exit_process
for number, code in enumerate(sys.argv[1:], 1):
    try:
        exec(compile(code, f"docs/api.md snippet {number}", "exec"), {"__name__": "__main__"})
    except BaseException:
        import traceback
        traceback.print_exc()
        exit_process(1)
exit_process(0)
"""


@pytest.mark.multiprocess
def test_every_snippet_runs(tmp_path):
    """In one process started as torchrun would start a world of one, from a folder with the
    repo's configs and bundled corpus (what the snippets read) and room for what they write."""
    for name in ("assets", "configs"):
        (tmp_path / name).symlink_to(REPO / name)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **train_env(),
        **{"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"},
        **{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
    }
    run(python_command(["-c", _RUN_SNIPPETS, *snippets()]), cwd=tmp_path, env=env, timeout=300)
    assert (tmp_path / "outputs" / "api-snippet" / "metrics.jsonl").is_file()
