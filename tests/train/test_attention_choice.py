"""model.attention = "auto": the fastest backend on the run's shapes, timed once, cached in the
dump folder; "sdpa" on CPU. Timings are injected (no GPU in CI)."""

import json

import pytest

from bloomnative.config import Config, ConfigError, model_args_from_config, validate
from bloomnative.train.attention_choice import (
    CACHE_FILE,
    AttentionShape,
    choose_attention,
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


def choose(tmp_path, timer, shape=SHAPE, env=ENV, on_gpu=True, log=None):
    messages = [] if log is None else log
    choice = choose_attention(
        shape, on_gpu, tmp_path, timer=timer, environment=lambda: env, log=messages.append
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
    assert any("triton cannot run here (RuntimeError: triton does not run)" in m for m in log)
    with pytest.raises(RuntimeError, match="no attention backend runs"):
        choose(tmp_path / "empty", Timings())


def test_a_corrupt_cache_is_ignored(tmp_path):
    (tmp_path / CACHE_FILE).write_text("{not json")
    assert choose(tmp_path, Timings(triton=1.0, flex=2.0, sdpa=3.0))[0] == "triton"


def test_cpu_runs_pick_sdpa_without_timing(tmp_path):
    timer = Timings(triton=0.1, flex=0.1, sdpa=9.0)
    assert choose(tmp_path, timer, on_gpu=False)[0] == "sdpa"
    assert timer.calls == [] and not (tmp_path / CACHE_FILE).exists()


def test_auto_is_a_valid_attention_key_and_describes_the_model_shape():
    config = Config()
    config.model.attention = "auto"
    validate(config)
    assert model_args_from_config(config.model).attention == "sdpa"
    config.model.attention = "fastest"
    with pytest.raises(ConfigError, match="model.attention = 'fastest' is not valid"):
        validate(config)
