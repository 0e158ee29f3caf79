"""model.attention = "auto": the fastest backend on the run's shapes, timed once the way the run
executes it (compiled or eager), each candidate in a process of its own, cached in the dump
folder; "sdpa" on CPU. Timings are injected (no GPU in CI), except in the last test, which times
real candidates in child processes on CPU."""

import json
import os
import sys
from pathlib import Path

import pytest

from bloomnative.config import Config, ConfigError, model_args_from_config, validate
from bloomnative.train.attention_choice import (
    CACHE_FILE,
    AttentionShape,
    choose_attention,
    time_in_own_process,
)

SHAPE = AttentionShape(batch=4, heads=16, seq_len=2048, head_dim=128, dtype="bfloat16")
ENV = {"torch": "2.11.0", "device": "NVIDIA H100 80GB HBM3", "triton": "3.6.0"}


class Timings:
    """A timer returning fixed milliseconds per backend (raising for the missing ones), counting
    its calls."""

    def __init__(self, **ms: float) -> None:
        self.ms, self.calls = ms, []

    def __call__(self, name: str, shape: AttentionShape) -> float:
        self.calls.append((name, shape))
        if name not in self.ms:
            raise RuntimeError(f"{name} does not run")
        return self.ms[name]


def choose(tmp_path, timer, shape=SHAPE, env=ENV, timed=True, log=None):
    messages = [] if log is None else log
    choice = choose_attention(
        shape, timed, tmp_path, timer=timer, environment=lambda: env, log=messages.append
    )
    return choice, messages


def test_the_fastest_backend_is_chosen_and_the_times_are_logged_and_cached(tmp_path):
    timer = Timings(triton=0.9, flex=1.0, sdpa=3.1)
    choice, log = choose(tmp_path, timer)
    assert choice == "triton"
    assert {name for name, _ in timer.calls} == {"triton", "flex", "sdpa"}
    assert "triton 0.900 ms, flex 1.000 ms, sdpa 3.100 ms" in log[-1]
    saved = json.loads((tmp_path / CACHE_FILE).read_text())
    assert saved["choice"] == "triton" and saved["times_ms"]["sdpa"] == 3.1
    assert saved["key"]["shape"]["head_dim"] == 128


def test_with_attention_dropout_flex_is_no_candidate(tmp_path):
    """FlexAttention has no dropout, so a run with attention dropout never resolves to it."""
    timer = Timings(triton=2.0, flex=1.0, sdpa=3.0)
    shape = AttentionShape(**{**SHAPE.__dict__, "dropout_p": 0.1})
    choice, _ = choose(tmp_path, timer, shape=shape)
    assert choice == "triton"
    assert {name for name, _ in timer.calls} == {"triton", "sdpa"}


def test_a_restart_reads_the_cached_choice_without_timing(tmp_path):
    choose(tmp_path, Timings(triton=2.0, flex=1.0, sdpa=3.0))
    again = Timings(triton=0.1, flex=1.0, sdpa=3.0)
    choice, log = choose(tmp_path, again)
    assert choice == "flex" and again.calls == []
    assert "timed before" in log[-1]


@pytest.mark.parametrize(
    "shape, env",
    [
        (AttentionShape(4, 16, 4096, 128, "bfloat16"), ENV),  # another sequence length
        (AttentionShape(4, 8, 2048, 128, "bfloat16"), ENV),  # another tensor-parallel degree
        (SHAPE, {**ENV, "triton": "3.7.0"}),  # another Triton
        (SHAPE, {**ENV, "device": "NVIDIA H200"}),  # another GPU
        (AttentionShape(**{**SHAPE.__dict__, "compiled": True}), ENV),  # compiled, not eager
    ],
)
def test_the_cache_is_only_used_for_the_same_shapes_device_and_versions(tmp_path, shape, env):
    choose(tmp_path, Timings(triton=2.0, flex=1.0, sdpa=3.0))
    retimed = Timings(triton=0.5, flex=1.0, sdpa=3.0)
    assert choose(tmp_path, retimed, shape=shape, env=env)[0] == "triton"
    assert len(retimed.calls) == 3


def test_a_backend_that_fails_is_skipped_and_reported(tmp_path):
    choice, log = choose(tmp_path, Timings(flex=1.5, sdpa=1.2))
    assert choice == "sdpa"
    assert any("triton excluded (RuntimeError('triton does not run'))" in m for m in log)
    with pytest.raises(RuntimeError, match="no attention backend runs"):
        choose(tmp_path / "empty", Timings())


def test_a_corrupt_cache_is_ignored(tmp_path):
    (tmp_path / CACHE_FILE).write_text("{not json")
    assert choose(tmp_path, Timings(triton=1.0, flex=2.0, sdpa=3.0))[0] == "triton"


def test_cpu_runs_pick_sdpa_without_timing(tmp_path):
    timer = Timings(triton=0.1, flex=0.1, sdpa=9.0)
    assert choose(tmp_path, timer, timed=False)[0] == "sdpa"
    assert timer.calls == [] and not (tmp_path / CACHE_FILE).exists()


def test_auto_is_a_valid_attention_key_and_describes_the_model_shape():
    config = Config()
    config.model.attention = "auto"
    validate(config)
    assert model_args_from_config(config.model).attention == "sdpa"
    config.model.attention = "fastest"
    with pytest.raises(ConfigError, match="model.attention = 'fastest' is not valid"):
        validate(config)


# Loaded by the candidates' child processes (PYTHONPATH): "triton" dies as a process does on a
# CUDA device fault, "flex" fails as a compile error does, "sdpa" runs; every torch.compile call
# is recorded (and made cheap: aot_eager, the same tracing without Inductor's code generation).
_CANDIDATE_FAULTS = """
import os
import torch
from bloomnative.model import attention

_compile = torch.compile

def _recorded_compile(fn, **kwargs):
    with open(os.environ["COMPILE_RECORD"], "a") as record:
        record.write(f"compiled fullgraph={kwargs.get('fullgraph')}\\n")
    return _compile(fn, backend="aot_eager", **kwargs)

@torch.library.custom_op("test_faults::device_fault", mutates_args=())
def _device_fault(q: torch.Tensor) -> torch.Tensor:
    os.abort()


@_device_fault.register_fake
def _(q):
    return torch.empty_like(q)


_device_fault.register_autograd(lambda ctx, grad: grad)

def _compile_error(*args):
    raise RuntimeError("a backend torch.compile cannot compile")

torch.compile = _recorded_compile
attention._BACKENDS.update(triton=lambda q, k, v, slopes, p: _device_fault(q), flex=_compile_error)
"""


@pytest.mark.multiprocess
def test_candidates_run_compiled_in_their_own_processes_and_a_dead_one_poisons_none(
    tmp_path, monkeypatch
):
    """A candidate whose process dies (the way a device fault ends a CUDA process) or whose
    compile fails is excluded with its reason; the others are still timed, compiled as the run
    will execute them."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_CANDIDATE_FAULTS)
    record = tmp_path / "compiled.txt"
    src = Path(__file__).resolve().parents[2] / "src"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), str(src)]))
    monkeypatch.setenv("COMPILE_RECORD", str(record))
    shape = AttentionShape(1, 2, 32, 16, "float32", compiled=True)
    cpu = __import__("torch").device("cpu")

    def timer(name, shape):
        return time_in_own_process(name, shape, cpu, timeout_s=300)

    choice, log = choose(tmp_path, timer, shape=shape)
    assert choice == "sdpa", log
    assert any("triton excluded (its process was killed by SIGABRT" in m for m in log), log
    # torch.compile fails on the raise it traces: a compile error, named by its exception line.
    assert any("flex excluded (its process exited with code 1: torch._dynamo" in m for m in log)
    assert "compiled forward + backward: sdpa" in log[-1]
    assert record.read_text().splitlines() == ["compiled fullgraph=True"] * 3
    saved = json.loads((tmp_path / CACHE_FILE).read_text())
    assert set(saved["excluded"]) == {"triton", "flex"} and set(saved["times_ms"]) == {"sdpa"}
    assert sys.executable  # the children ran under the test's own interpreter
