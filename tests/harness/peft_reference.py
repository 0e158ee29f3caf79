"""Hugging Face PEFT, the reference of the adapter tests: loading an adapter folder the way a
PEFT user does, and checking that PEFT found every key it expected and no other.

Imported by the tests of this folder (pytest puts the folder on sys.path).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from harness.hf_models import transformers

peft = pytest.importorskip("peft")

KEY_COMPLAINTS = ("missing", "unexpected")
"""Words of PEFT's and transformers' warnings about keys a folder lacks or has in excess."""


def loaded_in_peft(base: Path, folder: Path, capfd: pytest.CaptureFixture):
    """`PeftModel.from_pretrained(BloomForCausalLM.from_pretrained(base), folder)` in eval mode,
    failing the test when a warning or a logger (stderr) says a key was missing or unexpected."""
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = transformers.BloomForCausalLM.from_pretrained(base)
        loaded = peft.PeftModel.from_pretrained(model, folder).eval()
    said = [str(w.message) for w in caught] + capfd.readouterr().err.splitlines()
    complaints = [s for s in said if any(word in s.lower() for word in KEY_COMPLAINTS)]
    assert not complaints, complaints
    return loaded
