"""What the README, the docs, the launch scripts and the tools' help say about the repository is
still true: the files they name exist, and the default model has the size the README gives."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bloomnative.config import model_args_from_config, parse_args

REPO = Path(__file__).resolve().parents[1]
TEXTS = [
    REPO / "README.md",
    REPO / "run_train.sh",
    REPO / "run_tests.sh",
    REPO / ".ci" / "run",
    *sorted((REPO / "docs").glob("*.md")),
    *sorted((REPO / "tools").glob("*.py")),
]
# A repo-relative path (not the tail of a longer one), or a module path inside the package.
REPO_PATH = re.compile(
    r"(?<![\w/.-])((?:tests|tools|configs|docs|scripts)/[\w./-]+\.(?:py|md|toml|sh))"
)
PACKAGE_PATH = re.compile(r"(?<![\w/.-])bloomnative/([\w/]+(?:\.py|/))")


@pytest.mark.parametrize("text", TEXTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_file_a_text_names_exists(text):
    content = text.read_text()
    missing = [p for p in REPO_PATH.findall(content) if not (REPO / p).exists()]
    missing += [
        f"bloomnative/{p}"
        for p in PACKAGE_PATH.findall(content)
        if not (REPO / "src" / "bloomnative" / p).exists()
    ]
    assert not missing, f"{text.relative_to(REPO)} names files that do not exist: {missing}"


def test_the_readme_gives_the_default_models_parameter_count():
    (stated,) = re.findall(r"a ([\d.]+)M-parameter BLOOM", (REPO / "README.md").read_text())
    params = model_args_from_config(parse_args([]).model).num_params()
    assert stated == f"{params / 1e6:.1f}"
