"""Megatron-DeepSpeed BLOOM checkpoints (BF16_Optimizer ZeRO partitions) imported with their
optimizer state: the tensors equal the source's and DeepSpeed's own reader's, one AdamW step
from the import equals a float64 step from the source, bad folders and planted pickles are
refused."""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from bloomnative.checkpoint import checkpointer as ckpt
from bloomnative.checkpoint import reading
from bloomnative.config import OptimizerConfig, parse_args
from bloomnative.data.rampup import BatchSizeSchedule
from bloomnative.interop import CheckpointFormatError, save_native_checkpoint
from bloomnative.interop.mds_export import read_native_state
from bloomnative.interop.megatron_deepspeed import (
    canonical_name,
    import_mds_checkpoint,
    read_mds_state,
    write_training_checkpoint,
)
from bloomnative.interop.native_checkpoint import open_checkpoint
from bloomnative.model import Bloom
from bloomnative.train.optimizer import build_optimizer
from harness.mds_layout import (
    WEIGHT_DECAY,
    Run,
    adamw_float64,
    rank_params,
    saved_classes,
    source_tensors,
    write_checkpoint,
)
from harness.training import TINY_RUN, load_tool, run_train_sh

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
RUN = Run()  # tp2 x pp2 x dp2, as the issue asks
convert_mds = load_tool("convert_mds")


@pytest.fixture(scope="module")
def source() -> dict[str, dict[str, torch.Tensor]]:
    return source_tensors(RUN)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, source) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("mds"), RUN, source)


def test_import_gives_the_source_tensors_and_counters(folder, source):
    state = read_mds_state(folder)
    assert state.args.vocab_size == RUN.padded_vocab  # the padded rows kept by default
    assert (state.step, state.iteration) == (RUN.step, RUN.iteration)
    assert (state.consumed_samples, state.lr_samples) == (RUN.consumed, RUN.lr_samples)
    assert state.tensors.keys() == source.keys()
    for name, states in source.items():
        for s, tensor in states.items():
            assert torch.equal(state.tensors[name][s], tensor), (name, s)
        assert state.hyper[name]["weight_decay"] == (WEIGHT_DECAY if tensor.ndim >= 2 else 0.0)
    cut = read_mds_state(folder, vocab_size=RUN.vocab)
    for s, tensor in source["word_embeddings.weight"].items():
        assert torch.equal(cut.tensors["word_embeddings.weight"][s], tensor[: RUN.vocab])


def test_deepspeed_reads_the_same_tensors(tmp_path, folder):
    """DeepSpeed's reader (DeepSpeedCheckpoint) and ds_to_universal, which joins the DP
    fragments and TP slices itself, give bloomnative's tensors under DeepSpeed's names."""
    pytest.importorskip("deepspeed")
    from deepspeed.checkpoint import DeepSpeedCheckpoint, ds_to_universal

    out = tmp_path / "universal"
    with saved_classes():  # the args hold Megatron's PositionEmbeddingType, which DeepSpeed imports
        reader = DeepSpeedCheckpoint(str(folder))
        assert (reader.tp_degree, reader.pp_degree, reader.dp_degree) == (RUN.tp, RUN.pp, RUN.dp)
        assert reader.get_iteration() == RUN.iteration
        ds_to_universal.main(
            argparse.Namespace(
                input_folder=str(folder),
                output_folder=str(out),
                num_extract_workers=1,
                num_merge_workers=1,
                keep_temp_folder=False,
                strict=True,
                inject_missing_state=False,
            )
        )
    # The fixture's universal_checkpoint_info cuts the vocabulary to RUN.vocab, as BLOOM's did.
    ours = read_mds_state(folder, vocab_size=RUN.vocab)
    _assert_same_state(read_mds_state(out), read_mds_state(folder), zero_rows_from=RUN.vocab)
    params = sorted(p.name for p in (out / "zero").iterdir() if p.is_dir())
    assert sorted(canonical_name(p, first_layer=3) for p in params) == sorted(ours.tensors)
    for param in params:
        name = canonical_name(param, first_layer=3)
        for s in ("fp32", "exp_avg", "exp_avg_sq"):
            theirs = torch.load(out / "zero" / param / f"{s}.pt", weights_only=False)["param"]
            assert torch.equal(theirs, ours.tensors[name][s]), (param, s)
        assert int(torch.load(out / "zero" / param / "step.pt", weights_only=False)) == ours.step


def _assert_same_state(got, want, zero_rows_from: int | None = None) -> None:
    """`got` (an MdsState) equals `want`; with `zero_rows_from`, the embedding's rows from there
    on are zero in `got` (a universal checkpoint's padding, as DeepSpeed's loader pads)."""
    assert got.args == want.args
    counters = ("step", "iteration", "consumed_samples", "lr_samples")
    assert [getattr(got, c) for c in counters] == [getattr(want, c) for c in counters]
    assert got.tensors.keys() == want.tensors.keys()
    for name, states in want.tensors.items():
        for s, tensor in states.items():
            mine = got.tensors[name][s]
            if zero_rows_from is not None and name == "word_embeddings.weight":
                assert not mine[zero_rows_from:].any()
                mine, tensor = mine[:zero_rows_from], tensor[:zero_rows_from]
            assert torch.equal(mine, tensor), (name, s)
        options = ("lr", "eps", "weight_decay")
        assert [got.hyper[name][o] for o in options] == [want.hyper[name][o] for o in options]
        assert tuple(got.hyper[name]["betas"]) == tuple(want.hyper[name]["betas"])


def test_to_mds_is_read_back_by_deepspeeds_universal_loader(tmp_path, folder, source, capsys):
    """to-mds of the import: DeepSpeed's universal loader (load_hp_checkpoint_state, as each
    BF16_Optimizer parameter calls it) gives every (pp, tp) rank of the source's tp2 x pp2
    layout its slice of the source tensors and step; to-native of it is the import again; a
    planted pickle in it does not run."""
    pytest.importorskip("deepspeed")
    from deepspeed.checkpoint.universal_checkpoint import load_hp_checkpoint_state
    from deepspeed.utils.tensor_fragment import fragment_address, tensor_fragment

    dump, out = tmp_path / "dump", tmp_path / "universal"
    checkpoint = import_mds_checkpoint(folder, dump)
    assert convert_mds.main(["to-mds", "--checkpoint", str(checkpoint), "--out", str(out)]) == 0
    step_folder = out / f"global_step{RUN.iteration}"
    assert (out / "latest_universal").read_text() == step_folder.name
    groups = torch.load(step_folder / "zero" / "optimizer_state.pt", weights_only=True)
    assert [g["weight_decay"] for g in groups["param_groups"]] == [WEIGHT_DECAY, 0.0]  # Megatron's
    for pp in range(RUN.pp):
        for tp in range(RUN.tp):
            for ds, states in rank_params(RUN, source, pp, tp).items():
                param = torch.empty(states["fp32"].shape)
                numel = param.numel()
                param._hp_mapping = tensor_fragment(
                    lp_fragment=param.view(-1),
                    lp_fragment_address=fragment_address(numel=numel, start=0),
                    hp_fragment=torch.zeros(numel),
                    hp_fragment_address=fragment_address(numel=numel, start=0),
                    gradient_dict={},
                    offload_gradient_dict={},
                    use_offload=False,
                    param_group_index=0,
                )
                step = load_hp_checkpoint_state(param, str(step_folder / "zero" / ds), tp, RUN.tp)
                assert int(step) == RUN.step
                loaded = {"fp32": param._hp_mapping.hp_fragment, **param._hp_mapping.optim_fragment}
                for s, tensor in states.items():
                    assert torch.equal(loaded[s], tensor.reshape(-1)), (ds, pp, tp, s)
    _assert_same_state(read_mds_state(step_folder), read_mds_state(folder))
    missing = shutil.copytree(step_folder, tmp_path / "missing" / step_folder.name)
    (missing / "zero" / "6.weight" / "exp_avg_sq.pt").unlink()
    code = convert_mds.main(["to-native", "--checkpoint", str(missing), "--out", str(dump)])
    assert code == 2
    assert f"{missing}: missing file exp_avg_sq.pt of 6.weight" in capsys.readouterr().err
    marker = tmp_path / "ran"
    victim = step_folder / "zero" / "3.input_layernorm.weight" / "fp32.pt"
    _planted(victim, marker)
    with pytest.raises(CheckpointFormatError, match=r"fp32\.pt: holds (posix|os)\.mkdir"):
        read_mds_state(step_folder)
    assert not marker.exists()


def _megatron_batch_size(consumed: int, start: int, increment: int, ramp: int, gbs: int) -> int:
    """Megatron's RampupBatchsizeNumMicroBatches.update (megatron/microbatches.py), transcribed."""
    if consumed > ramp:
        return gbs
    return start + int(consumed / (ramp / ((gbs - start) // increment))) * increment


def test_the_batch_size_rampup_continues_exactly(tmp_path, source, capsys):
    """The args' global batch size and rampup become run_train.sh arguments under which every
    step's global batch size, from the samples consumed, is Megatron's; a rampup that does not
    land on the global batch size is refused in one line."""
    ramp = Run(global_batch=16, rampup=(4, 4, 60), tp=1, pp=1, dp=1)
    folder = write_checkpoint(tmp_path / "ramp", ramp, source_tensors(ramp))
    dump = tmp_path / "dump"
    assert convert_mds.main(["to-native", "--checkpoint", str(folder), "--out", str(dump)]) == 0
    overrides = read_mds_state(folder).training_overrides()
    assert " ".join(overrides) in capsys.readouterr().err
    training = parse_args([*overrides, "--training.micro_batch_size=4"]).training
    schedule = BatchSizeSchedule(training.global_batch_size, tuple(training.rampup_batch_size))
    for consumed in range(0, 80):
        assert schedule(consumed) == _megatron_batch_size(consumed, 4, 4, 60, 16), consumed
    assert read_mds_state(
        write_checkpoint(tmp_path / "flat", Run(), source)
    ).training_overrides() == [
        "--training.global_batch_size=8",
        "--training.rampup_batch_size=",
    ]
    uneven = Run(global_batch=16, rampup=(4, 5, 60), tp=1, pp=1, dp=1)
    folder = write_checkpoint(tmp_path / "uneven", uneven, source_tensors(uneven))
    assert convert_mds.main(["to-native", "--checkpoint", str(folder), "--out", str(dump)]) == 2
    line = capsys.readouterr().err.strip()
    assert "mp_rank_00_model_states.pt: args.rampup_batch_size ['4', '5', '60']" in line
    assert "\n" not in line


def test_one_adamw_step_from_the_import_uses_the_moments(tmp_path, folder, source):
    """The checkpoint loads into a Bloom and the trainer's AdamW as a resume loads it; one step
    with given gradients equals the float64 AdamW step from the source tensors."""
    out = import_mds_checkpoint(folder, tmp_path / "dump")
    assert out == tmp_path / "dump" / "checkpoints" / f"step-{RUN.iteration}"
    reader = open_checkpoint(out)
    counters = {
        "train": {"step": torch.tensor(0)},
        "data": {"consumed_samples": 0},
        "lr_clock": {"applied_samples": torch.tensor(0)},
    }
    reading.load(counters, reader)
    assert int(counters["train"]["step"]) == RUN.iteration
    assert counters["data"]["consumed_samples"] == RUN.consumed
    assert int(counters["lr_clock"]["applied_samples"]) == RUN.lr_samples

    state = read_mds_state(folder)
    with torch.device("meta"):
        model = Bloom(state.args)
    model.to_empty(device="cpu")
    model.tie_weights()
    optimizer = build_optimizer([model], OptimizerConfig(implementation="for-loop"))
    components = {
        "model": ckpt.ModelState([model]),
        "optimizer": ckpt.OptimizerState([model], [optimizer]),
    }
    ckpt.load_components(reader, components, complete=("model", "optimizer"))
    lr = 1e-3
    gen = torch.Generator().manual_seed(1)
    params = {n: p for n, p in model.named_parameters() if n != "lm_head.weight"}
    for group in optimizer.param_groups:
        group["lr"] = lr
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2
    grads = {n: p.grad.clone() for n, p in params.items()}
    optimizer.step()
    for name, p in params.items():
        src = source[name]
        wd = WEIGHT_DECAY if p.ndim >= 2 else 0.0
        expected = adamw_float64(
            src["fp32"], src["exp_avg"], src["exp_avg_sq"], grads[name], lr, wd, RUN.step
        )
        torch.testing.assert_close(p.detach().double(), expected, rtol=0, atol=1e-6)
        fresh = adamw_float64(src["fp32"], 0 * src["fp32"], 0 * src["fp32"], grads[name], lr, wd, 0)
        assert (fresh - expected).abs().max() > 1e-4, name  # the moments change the step


def allocated_peak(fn) -> int:
    """The most bytes of CPU memory torch had allocated at once while `fn()` ran, above what
    was allocated before: every allocation and free the profiler records, in order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, acc_events=True) as prof:
        fn()
    alive = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        alive += event.self_cpu_memory_usage
        peak = max(peak, alive)
    return peak


def test_to_native_holds_one_whole_tensor_and_one_slice_at_a_time(tmp_path):
    """The import of a tp2 x pp2 x dp2 folder whose embedding is most of it: once the files
    are opened (mapped, read as the tensors are asked for), writing the checkpoint allocates at
    most the embedding's whole tensor and one of its TP slices at once, a third of what the
    checkpoint holds, and the import equals the source."""
    run = Run(hidden=16, padded_vocab=8192, vocab=8192)
    source = source_tensors(run)
    state = read_mds_state(write_checkpoint(tmp_path / "mds", run, source))
    dump = tmp_path / "dump"
    peak = allocated_peak(lambda: write_training_checkpoint(state, dump))
    embedding = source["word_embeddings.weight"]["fp32"].nbytes
    held = sum(t.nbytes for states in source.values() for t in states.values())
    assert peak <= embedding + embedding // run.tp + 4096, (peak, embedding)
    assert held > 3 * embedding
    imported = read_native_state(dump / "checkpoints" / f"step-{run.iteration}")
    for name, states in source.items():
        for s, tensor in states.items():
            assert torch.equal(imported.tensors[name][s], tensor), (name, s)


def _planted(path: Path, marker: Path) -> None:
    class Plant:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    torch.save({"args": Plant()}, path)


@pytest.mark.parametrize(
    "victim", ["mp_rank_00_model_states.pt", "bf16_zero_pp_rank_1_mp_rank_03_optim_states.pt"]
)
def test_a_planted_pickle_is_refused_without_running(tmp_path, folder, victim):
    copy = shutil.copytree(folder, tmp_path / folder.name)
    marker = tmp_path / "ran"
    _planted(copy / victim, marker)
    with pytest.raises(
        CheckpointFormatError, match=rf"{victim}: holds posix\.mkdir|{victim}: holds os\.mkdir"
    ):
        read_mds_state(copy)
    assert not marker.exists()


def test_bad_folders_are_one_line_and_exit_2(tmp_path, folder, capsys):
    def run(checkpoint: Path) -> str:
        code = convert_mds.main(
            ["to-native", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "out")]
        )
        assert code == 2
        return capsys.readouterr().err.strip()

    assert "is not a Megatron-DeepSpeed checkpoint folder" in run(tmp_path)
    missing = shutil.copytree(folder, tmp_path / "missing")
    (missing / "bf16_zero_pp_rank_1_mp_rank_02_optim_states.pt").unlink()
    line = run(missing)
    assert "missing rank file bf16_zero_pp_rank_1_mp_rank_02_optim_states.pt" in line
    assert "\n" not in line
    wrong = write_checkpoint(tmp_path / "wrong", Run(hidden=12, n_head=3), source_tensors(Run()))
    line = run(wrong)
    assert "the run's args (num_layers=2, hidden_size=12" in line
    assert "\n" not in line
    rotary = write_checkpoint(
        tmp_path / "rotary", Run(position_embedding="rotary"), source_tensors(Run())
    )
    assert "args.position_embedding_type is rotary; BLOOM's is alibi" in run(rotary)
    assert not (tmp_path / "out").exists()
    model_only = save_native_checkpoint(Bloom(read_mds_state(folder).args), tmp_path / "model")
    code = convert_mds.main(["to-mds", "--checkpoint", str(model_only), "--out", str(tmp_path)])
    assert code == 2
    line = capsys.readouterr().err.strip()
    assert f"{model_only}: holds no AdamW moments of word_embeddings.weight's shape" in line
    assert "\n" not in line


@pytest.mark.multiprocess
def test_run_train_sh_resumes_from_the_import(tmp_path, synthetic_corpus):
    """./run_train.sh --job.dump_folder=<the import's --out> continues the Megatron run: the
    step, the samples consumed and the schedule go on from the source's."""
    shape = Run(n_layer=4, hidden=32, n_head=4, padded_vocab=128, vocab=128)
    folder = write_checkpoint(tmp_path / "mds", shape, source_tensors(shape))
    dump = tmp_path / "dump"
    assert convert_mds.main(["to-native", "--checkpoint", str(folder), "--out", str(dump)]) == 0
    args = [*TINY_RUN, f"--data.blend={synthetic_corpus}", f"--job.dump_folder={dump}"]
    proc = run_train_sh([*args, f"--training.steps={shape.iteration + 1}"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = proc.stdout + proc.stderr
    assert f"resumed from {dump / 'checkpoints' / f'step-{shape.iteration}'}" in log
    assert f"step {shape.iteration + 1} |" in log
    assert f"consumed_samples {shape.consumed + 8} " in log  # TINY_RUN's global batch of 8
