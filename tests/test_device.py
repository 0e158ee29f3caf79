"""The one device choice (bloomnative/device.py) of the trainer, the tools and generation."""

from __future__ import annotations

import pytest
import torch

from bloomnative.device import pick_device


def test_cpu_and_auto_without_cuda(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert pick_device("cpu") == torch.device("cpu")
    expected = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert pick_device("auto") == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_cuda_without_a_cuda_device_is_an_error(name):
    with pytest.raises(ValueError, match="no CUDA device is available"):
        pick_device(name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_is_this_processs_local_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert pick_device("cuda") == torch.device("cuda", 0)
    assert pick_device("cuda:0") == torch.device("cuda", 0)


@pytest.mark.parametrize("name", ["gpu", "meta", "cpu:x"])
def test_anything_else_is_an_error_naming_the_choices(name):
    with pytest.raises(ValueError, match='is not "auto", "cpu", "cuda" or "cuda:N"'):
        pick_device(name)
