"""Trust at the edges of a checkpoint folder (issue 26, items 0-2), driven as a user drives it:
the trainer's entry point on a dump folder someone has changed, the tools' command lines, and
./run_train.sh for what the launcher adds (exit codes, a second run in the same folder).

- Nothing in a checkpoint folder runs: a planted pickle that would create a marker file (in
  DCP's `.metadata`, with the checksum record rewritten to match, or in a non-tensor entry of a
  checkpoint whose every file is genuine) leaves no marker, whether the folder is resumed,
  sampled from (generate.py), exported (convert_hf.py to-hf) or verified.
- Nothing outside the folder is read: a record naming `..`, an absolute path, /dev/zero, a pipe
  or a symbolic link is a verification failure, at once (a reader that opened them would hang
  or read another file).
- Corrupt is told from foreign and from extra: a README beside the files is a warning; a
  checkpoint of another model shape is passed over with one line naming the difference; a
  folder none of whose checkpoints can be loaded stops the run with exit 2 unless
  checkpoint.load_step = 0 asks to start over.
- The last good checkpoint survives: no save from a non-finite state or a run of skipped steps
  (rotation then has nothing newer to keep it for), a changed data setting is refused on resume,
  a full disk is reported at the save that failed, naming the disk, metrics.jsonl keeps whole
  lines, and one run at a time uses a dump folder.

The runs share one world (one process, its scenarios one after the other: trust_scenario.py).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bloomnative.checkpoint import reading
from bloomnative.interop import save_native_checkpoint
from bloomnative.model import Bloom, BloomArgs
from harness.launching import SCENARIO_DIR, logged_rows, start, wait_for
from harness.shared_world import SharedWorld
from harness.training import (
    REPO,
    TINY_RUN,
    load_tool,
    metric_rows,
    run_train_sh,
    train_env,
    worker_exit_code,
    write_word_tokenizer,
)
from scenarios.trust_scenario import (
    Payload,
    plant_metadata_payload,
    plant_record_entry,
    rewrite_record,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SCENARIOS = SCENARIO_DIR / "trust_scenario.py"
RESUME = f"{SCENARIOS}:resume_after"
MARKER = "pwned"
"""The file a planted payload would create, in the scenario's dump folder."""


def run_args(dump: Path, corpus: str, tokenizer: Path, *more: str) -> list[str]:
    """The tiny run of these tests: a checkpoint every 2 steps, every one kept."""
    return [
        *TINY_RUN,
        f"--data.blend={corpus}",
        f"--data.tokenizer={tokenizer}",
        f"--job.dump_folder={dump}",
        "--training.steps=4",
        "--checkpoint.interval=2",
        "--checkpoint.keep_latest_k=0",
        "--validation.sample_tokens=0",
        *more,
    ]


class Runs:
    """The shared world's results: `result(name)`, `dump(name)` (its dump folder) and `argv`
    (the base run's arguments for a dump folder)."""

    def __init__(self, world: SharedWorld, root: Path, corpus: str, tokenizer: Path):
        self.world, self.root, self.corpus, self.tokenizer = world, root, corpus, tokenizer

    def result(self, name: str):
        return self.world.result(name)

    def dump(self, name: str) -> Path:
        return self.root / name

    def argv(self, name: str, *more: str) -> list[str]:
        return self.argv_for(self.dump(name), *more)

    def argv_for(self, dump: Path, *more: str) -> list[str]:
        return run_args(dump, self.corpus, self.tokenizer, *more)

    def copy(self, name: str, tmp_path: Path) -> Path:
        """A copy of `name`'s dump folder to change."""
        return Path(shutil.copytree(self.dump(name), tmp_path / name))


@pytest.fixture(scope="module")
def runs(synthetic_corpus, tmp_path_factory) -> Runs:
    """One world, one process: "base" saves step-2 and step-4 and "other" (hidden_size 64)
    step-2; each resume scenario copies "base", changes the copy (trust_scenarios.PLANTS) and
    resumes it to step 6; the fault scenarios train afresh with a fault injected."""
    root = tmp_path_factory.mktemp("trust")
    tokenizer = write_word_tokenizer(root / "tokenizer.json")
    world = SharedWorld(root / "world")
    r = Runs(world, root, synthetic_corpus, tokenizer)
    world.train("base", r.argv("base"))  # saves step-2 and step-4
    world.train("other", r.argv("other", "--model.hidden_size=64", "--training.steps=2"))
    base, other_step = str(r.dump("base")), str(r.dump("other") / "checkpoints" / "step-2")

    def resume(name: str, plant: str, *plant_args, more=(), expect: int = 0) -> None:
        argv = r.argv(name, "--training.steps=6", *more)
        world.add(name, RESUME, plant, base, str(r.dump(name)), argv, *plant_args, expect=expect)

    resume("metadata payload", "metadata payload", str(r.dump("metadata payload") / MARKER))
    resume("entry payload", "entry payload", str(r.dump("entry payload") / MARKER), expect=2)
    resume("device in the record", "device in the record")
    resume("readme", "readme")
    resume("foreign newest", "foreign newest", other_step)
    resume("only foreign", "only foreign", other_step, expect=2)
    resume("none verifies", "every checkpoint corrupt", expect=2)
    resume(
        "none verifies, load_step 0", "every checkpoint corrupt", more=["--checkpoint.load_step=0"]
    )
    # Another copy of the corpus and of the tokenizer: the same bytes under other names.
    blend = str(root / "copy_text_document")
    for suffix in (".bin", ".idx"):
        shutil.copy(synthetic_corpus + suffix, blend + suffix)
    other_tokenizer = shutil.copy(tokenizer, root / "tokenizer-copy.json")
    changed = [
        "--training.seq_len=16",
        f"--data.blend={blend}",
        f"--data.tokenizer={other_tokenizer}",
    ]
    resume("data changed", "nothing", more=changed, expect=2)
    resume("data change allowed", "nothing", more=[*changed, "--checkpoint.allow_data_change=true"])
    resume("torn metrics", "torn metrics")
    resume("stale lock", "stale lock")
    resume("live lock", "live lock", expect=2)
    resume("missing load_step", "nothing", more=["--checkpoint.load_step=8"], expect=2)
    world.train("config error", r.argv("config error", "--training.stepz=3"), expect=2)
    # Faults while training: a fresh run of 6 steps, logging only at its end (as the default
    # log_freq of 50 does), rotation keeping one checkpoint.
    faults = ["--training.steps=6", "--metrics.log_freq=50", "--checkpoint.keep_latest_k=1"]
    world.add(
        "nan state", f"{SCENARIOS}:train_poisoning_optimizer_state", 4, r.argv("nan state", *faults)
    )
    nan_injection = f"{SCENARIO_DIR / 'nan_scenario.py'}:train_with_nan_gradients"
    world.add("skip streak", nan_injection, [3, 4], r.argv("skip streak", *faults))
    stop = r.argv("nonfinite stop", "--training.max_nonfinite_steps=2")
    world.add("nonfinite stop", nan_injection, [1, 2, 3], stop, expect=2)
    for mode in ("disabled", "async"):
        argv = r.argv(f"full disk {mode}", *faults, f"--checkpoint.async_mode={mode}")
        world.add(f"full disk {mode}", f"{SCENARIOS}:train_with_full_disk", 4, argv, expect=1)
    world.train("disk check", r.argv("disk check", "--checkpoint.min_free_gib=1e9"), expect=2)
    world.add("crash", f"{SCENARIOS}:train_then_crash", 1, r.argv("crash"), expect=1)
    world.run()
    return r


def one_line(text: str, part: str) -> str:
    """The only line of `text` that contains `part`."""
    lines = [line for line in text.splitlines() if part in line]
    assert len(lines) == 1, text[-4000:]
    return lines[0]


def resumed_from(proc, dump: Path, step: int) -> bool:
    return f"resumed from {dump / 'checkpoints' / f'step-{step}'} at step {step}" in proc.stdout


def step_folders(dump: Path) -> list[str]:
    return sorted(p.name for p in (dump / "checkpoints").iterdir() if p.name.startswith("step-"))


# ---------------------------------------------------------------- nothing from a checkpoint runs


@pytest.mark.multiprocess
def test_a_planted_metadata_pickle_with_a_matching_record_runs_nothing_on_resume(runs):
    """The forged step-4 verifies against its rewritten record, but its metadata is read by the
    restricted unpickler: refused, set aside, and the run resumes from step-2."""
    name = "metadata payload"
    proc, dump = runs.result(name), runs.dump(name)
    assert not (dump / MARKER).exists()
    line = one_line(proc.stderr, "checkpoint step-4 is corrupt")
    assert "refers to posix.system, which checkpoint metadata never holds" in line
    assert "skipped, left as step-4.corrupt" in line
    assert resumed_from(proc, dump, 2)
    assert "step-4.corrupt" in step_folders(dump)


@pytest.mark.multiprocess
def test_a_planted_pickle_in_a_data_entry_runs_nothing_on_resume(runs):
    """Non-tensor entries are read as plain data (weights_only): a checkpoint whose every file
    and whose metadata are genuine, holding a payload as the loader's skipped windows, stops the
    resume with one line (exit 2)."""
    name = "entry payload"
    proc, dump = runs.result(name), runs.dump(name)
    assert not (dump / MARKER).exists()
    line = one_line(proc.stderr, "checkpoint error:")
    assert f"{dump / 'checkpoints' / 'step-4'}: entry 'data.skipped' is not plain data" in line
    assert "posix.system" in line
    assert "Traceback" not in proc.stderr


@pytest.fixture
def tools() -> Iterator[dict]:
    """The tools' `main(argv)`, as their command lines run them; an alarm fails a test whose
    tool hangs (reading a pipe or /dev/zero) instead of letting it wait forever."""

    def hung(signum, frame):
        raise TimeoutError("the tool hung")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)
    try:
        yield {
            name: load_tool(name).main for name in ("generate", "convert_hf", "verify_checkpoint")
        }
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def open_with(tools: dict, how: str, step: Path, out: Path) -> int:
    """Opens checkpoint folder `step` as a user would: `how` names the tool."""
    if how == "generate":
        argv = ["--checkpoint", str(step), "--prompt", "w1", "--max-new-tokens", "2"]
        return tools["generate"](argv)
    if how == "to-hf":
        return tools["convert_hf"](["to-hf", "--checkpoint", str(step), "--out", str(out)])
    return tools["verify_checkpoint"]([str(step)])


TOOLS = ["generate", "to-hf", "verify_checkpoint"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", TOOLS)
def test_a_planted_metadata_pickle_with_a_matching_record_runs_nothing_in_the_tools(
    runs, tools, tmp_path, capsys, how
):
    step = runs.copy("base", tmp_path) / "checkpoints" / "step-4"
    plant_metadata_payload(step, tmp_path / MARKER)
    code = open_with(tools, how, step, tmp_path / "hf")
    assert not (tmp_path / MARKER).exists()
    assert code != 0
    output = capsys.readouterr()
    assert (
        "refers to posix.system, which checkpoint metadata never holds" in output.out + output.err
    )
    assert not (tmp_path / "hf").exists()


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["generate", "to-hf"])
def test_a_changed_file_is_found_by_its_checksum_before_anything_is_unpickled(
    runs, tools, tmp_path, capsys, how
):
    """Without a matching record the tools stop at the checksum: the message is the record's,
    and the unpickler never saw the file."""
    step = runs.copy("base", tmp_path) / "checkpoints" / "step-4"
    (step / ".metadata").write_bytes(pickle.dumps(Payload(tmp_path / MARKER)))
    assert open_with(tools, how, step, tmp_path / "hf") != 0
    assert not (tmp_path / MARKER).exists()
    err = capsys.readouterr().err
    assert f"{step / '.metadata'}: " in err and "the record says" in err
    assert "does not match its checksums.json; nothing in it is read" in err
    assert "posix.system" not in err


def link_to_device(step: Path) -> None:
    (step / "__0_0.distcp").unlink()
    (step / "__0_0.distcp").symlink_to("/dev/zero")


def pipe_in_place(step: Path) -> None:
    (step / "__0_0.distcp").unlink()
    os.mkfifo(step / "__0_0.distcp")


OUTSIDE = "which is not a file of this folder"
RECORD_PLANTS = {  # how the folder is changed -> what verification says
    "parent path": (lambda s: plant_record_entry(s, "../../../../etc/passwd"), OUTSIDE),
    "absolute path": (lambda s: plant_record_entry(s, "/etc/passwd"), OUTSIDE),
    "device": (lambda s: plant_record_entry(s, "/dev/zero"), OUTSIDE),
    "link to a device": (link_to_device, "a symbolic link, not a file"),
    "pipe": (pipe_in_place, "not a regular file (a folder, device or pipe)"),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("plant", list(RECORD_PLANTS))
def test_a_record_naming_anything_but_a_file_of_its_folder_fails_verification_at_once(
    runs, tools, tmp_path, capsys, plant
):
    """verify_checkpoint.py says BAD (exit 1) and generate.py refuses with one line (exit 2);
    neither opens the thing named (the alarm of `tools` would fail a reader that hung)."""
    step = runs.copy("base", tmp_path) / "checkpoints" / "step-4"
    make, expected = RECORD_PLANTS[plant]
    make(step)
    assert tools["verify_checkpoint"]([str(step)]) == 1
    out = capsys.readouterr().out
    assert expected in out
    assert out.splitlines()[-1].startswith(f"{step}: BAD")
    assert "root:" not in out  # nothing of /etc/passwd
    assert open_with(tools, "generate", step, tmp_path) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("generate.py: error: ") and expected in line


@pytest.mark.multiprocess
def test_resume_passes_over_a_record_naming_a_device(runs):
    name = "device in the record"
    proc, dump = runs.result(name), runs.dump(name)
    line = one_line(proc.stderr, "checkpoint step-4 is corrupt")
    assert f"names '/dev/zero', {OUTSIDE}" in line
    assert resumed_from(proc, dump, 2)


def test_the_metadata_unpickler_admits_what_checkpoints_hold_and_nothing_else(tmp_path):
    """Model-only checkpoints in bf16 and fp32 read through it (training checkpoints of every
    layout do in test_resume_layouts.py and parallel/test_layouts.py, which resume through it);
    a pickle naming any other global is refused before that global is even imported."""
    model = Bloom(BloomArgs(n_layer=1, hidden_size=32, n_head=4, vocab_size=64))
    for dtype in (torch.float32, torch.bfloat16):
        out = save_native_checkpoint(model.to(dtype), tmp_path / str(dtype), overwrite=True)
        assert reading.verified_reader(out).shapes()["model.word_embeddings.weight"] == (64, 32)
    for payload in (Payload(tmp_path / MARKER), print, eval, shutil.rmtree):
        (out / ".metadata").write_bytes(pickle.dumps(payload))
        rewrite_record(out)
        with pytest.raises(reading.UnsafeCheckpointError, match="never holds"):
            reading.verified_reader(out)
    assert not (tmp_path / MARKER).exists()


# ---------------------------------------------------------------- corrupt, foreign, extra


@pytest.mark.multiprocess
def test_an_extra_file_is_a_warning_and_the_checkpoint_is_resumed(runs, tools, capsys):
    name = "readme"
    proc, dump = runs.result(name), runs.dump(name)
    line = one_line(proc.stderr, "README.txt not listed in its checksums.json")
    assert "WARNING" in line and "ignored" in line
    assert resumed_from(proc, dump, 4)
    assert tools["verify_checkpoint"]([str(dump / "checkpoints" / "step-4")]) == 0
    assert "extra    README.txt  not in the record: ignored" in capsys.readouterr().out


@pytest.mark.multiprocess
def test_a_checkpoint_of_another_model_is_passed_over_naming_the_difference(runs):
    """The newest checkpoint, copied in from a model with hidden_size 64, is set aside with one
    line and the newest one of this model is resumed."""
    name = "foreign newest"
    proc, dump = runs.result(name), runs.dump(name)
    line = one_line(proc.stderr, "checkpoint step-6 does not fit this run")
    assert "hidden_size is 64 in the checkpoint, 32 here" in line
    assert "skipped, left as step-6.foreign" in line
    assert resumed_from(proc, dump, 4)
    assert "Size mismatch" not in proc.stderr


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["generate", "to-hf"])
def test_the_tools_refuse_a_step_folder_of_another_model_than_its_run(
    runs, tools, tmp_path, capsys, how
):
    """A step folder copied into another run's dump folder: its bloom_args.json and the run's
    config.toml disagree, so neither tool guesses (they used the run's head count before)."""
    dump = runs.copy("base", tmp_path)
    step = Path(
        shutil.copytree(
            runs.dump("other") / "checkpoints" / "step-2", dump / "checkpoints" / "step-6"
        )
    )
    assert open_with(tools, how, step, tmp_path / "hf") != 0
    err = capsys.readouterr().err
    assert "hidden_size is 64 in its bloom_args.json, 32 in" in err
    assert not (tmp_path / "hf").exists()


@pytest.mark.multiprocess
def test_a_folder_of_another_models_checkpoints_only_stops_the_run(runs):
    name = "only foreign"
    proc, dump = runs.result(name), runs.dump(name)
    line = one_line(proc.stderr, "checkpoint error:")
    assert "holds 1 checkpoint and none can be loaded" in line
    assert "checkpoint step-4 does not fit this run: hidden_size is 64 in the checkpoint" in line
    assert step_folders(dump) == ["step-4"]  # nothing renamed
    before = (runs.dump("base") / "metrics.jsonl").read_text()
    assert (dump / "metrics.jsonl").read_text() == before  # it trained no step


@pytest.mark.multiprocess
def test_when_no_checkpoint_verifies_the_run_stops_and_load_step_0_starts_over(runs):
    proc, dump = runs.result("none verifies"), runs.dump("none verifies")
    line = one_line(proc.stderr, "checkpoint error:")
    assert "holds 2 checkpoints and none can be loaded" in line
    assert "checkpoint step-4 is corrupt" in line and "checkpoint step-2 is corrupt" in line
    assert "set checkpoint.load_step = 0 to start afresh" in line
    assert step_folders(dump) == ["step-2", "step-4"]
    before = (runs.dump("base") / "metrics.jsonl").read_text()
    assert (dump / "metrics.jsonl").read_text() == before  # it trained no step

    proc, dump = runs.result("none verifies, load_step 0"), runs.dump("none verifies, load_step 0")
    assert "resumed from" not in proc.stdout
    assert step_folders(dump) == [
        "step-2",
        "step-2.replaced",
        "step-4",
        "step-4.replaced",
        "step-6",
    ]
    new_rows = metric_rows(dump)[len(before.splitlines()) :]
    assert [row["step"] for row in new_rows if "loss" in row] == [1, 2, 3, 4, 5, 6]


# ---------------------------------------------------------------- the last good state survives


@pytest.mark.multiprocess
def test_no_checkpoint_is_saved_from_a_non_finite_state(runs):
    """A NaN in AdamW's state at step 4 (the weights still finite): step-4 is not saved, nor
    step-6 (by then the weights are NaN and the step skipped), and with keep_latest_k = 1 the
    last healthy checkpoint, step-2, is what remains."""
    name = "nan state"
    proc, dump = runs.result(name), runs.dump(name)
    line = one_line(proc.stderr, "not saving checkpoint step-4")
    assert "weights or optimizer state hold NaN or infinite values (" in line
    assert "exp_avg" in line
    assert "not saving checkpoint step-6" in proc.stderr
    assert step_folders(dump) == ["step-2"]


@pytest.mark.multiprocess
def test_no_checkpoint_is_saved_from_a_run_of_skipped_steps(runs):
    """NaN gradients at steps 3 and 4: step-4 ends a run of skipped steps and is not saved;
    step 6, healthy again, is (and only then does rotation remove step-2)."""
    name = "skip streak"
    proc, dump = runs.result(name), runs.dump(name)
    line = one_line(proc.stderr, "not saving checkpoint step-4")
    assert "it ends a run of 2 skipped steps" in line
    assert step_folders(dump) == ["step-6"]


@pytest.mark.multiprocess
def test_a_resume_with_other_data_settings_is_refused_naming_each(runs):
    proc, dump = runs.result("data changed"), runs.dump("data changed")
    line = one_line(proc.stderr, "checkpoint error:")
    assert "training.seq_len: 32 in the checkpoint, 16 now" in line
    assert f"data.blend: ['{runs.corpus}'] in the checkpoint" in line
    assert f"data.tokenizer: '{runs.tokenizer}' in the checkpoint" in line
    assert "checkpoint.allow_data_change = true" in line
    assert step_folders(dump) == ["step-2", "step-4"]

    proc, dump = runs.result("data change allowed"), runs.dump("data change allowed")
    assert "(checkpoint.allow_data_change = true)" in one_line(proc.stderr, "other data settings")
    assert resumed_from(proc, dump, 4)


@pytest.mark.multiprocess
def test_a_torn_last_line_of_metrics_jsonl_is_removed_on_resume(runs):
    proc, dump = runs.result("torn metrics"), runs.dump("torn metrics")
    assert "removed a torn last line (15 bytes" in one_line(proc.stderr, "metrics.jsonl")
    rows = metric_rows(dump)  # every line parses
    assert [row["step"] for row in rows if "loss" in row][-2:] == [5, 6]


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_full_disk_is_reported_at_the_save_naming_the_disk(runs, mode):
    """ENOSPC from every write of the step-4 checkpoint: one line naming the save, the cause,
    the file system and its free space, and the checkpoint that is intact; the run stops
    before step 7 with exit 1, its metrics.jsonl whole, the failed save's partial folder
    removed (tests/checkpoint/test_disk_full.py fills a real file system)."""
    name = f"full disk {mode}"
    proc, dump = runs.result(name), runs.dump(name)
    line = one_line(proc.stderr, "checkpoint error:")
    assert (
        f"writing checkpoint step-4 into {dump / 'checkpoints' / 'step-4.partial'} failed" in line
    )
    assert "No space left on device (ENOSPC)" in line
    assert "; the file system mounted at " in line and " free of " in line
    assert "the newest complete checkpoint, step-2, is intact" in line
    assert "Traceback" not in proc.stderr
    assert max(row["step"] for row in metric_rows(dump)) <= 6
    assert "step-2" in step_folders(dump) and "step-4" not in step_folders(dump)
    assert "step-4.partial" not in step_folders(dump)
    assert "its partial folder (" in line


# ---------------------------------------------------------------- one run per dump folder


@pytest.mark.multiprocess
def test_a_stale_lock_is_taken_over(runs):
    proc, dump = runs.result("stale lock"), runs.dump("stale lock")
    line = one_line(proc.stdout, "taking over the lock of pid")  # an info line
    assert f"on host {socket.gethostname()}" in line and "which is gone" in line
    assert resumed_from(proc, dump, 4)
    assert not (dump / "run.lock").exists()  # released at the end


@pytest.mark.multiprocess
def test_a_lock_held_by_a_live_process_refuses_the_run(runs):
    """The lock names this test process (the world's parent), alive and as it started."""
    proc, dump = runs.result("live lock"), runs.dump("live lock")
    line = one_line(proc.stderr, "is in use by another run")
    assert f"pid {os.getpid()} on host {socket.gethostname()} (started earlier)" in line
    assert "stop that run or choose another job.dump_folder" in line
    assert json.loads((dump / "run.lock").read_text())["pid"] == os.getpid()  # left as it was


@pytest.mark.multiprocess
def test_a_second_run_in_the_same_dump_folder_is_refused(runs, tmp_path):
    """./run_train.sh twice on one dump folder: the second stops with one line naming the first
    (its pid and host), exit 2, and the first trains on; a STOP file then ends it cleanly and
    it removes its lock."""
    dump = tmp_path / "run"
    argv = runs.argv_for(dump, "--training.steps=1000", "--checkpoint.interval=1000")
    log = tmp_path / "first.log"
    with log.open("w") as output:
        first = start(
            [str(REPO / "run_train.sh"), *argv],
            env=train_env({"MAX_RESTARTS": "0"}),
            stdout=output,
            stderr=output,
            start_new_session=True,
        )
    try:
        wait_for(
            lambda: logged_rows(dump) >= 1,
            first,
            timeout=180,
            what="the first run's first step",
            output=log.read_text,
        )
        holder = json.loads((dump / "run.lock").read_text())
        second = run_train_sh(argv, timeout=180)
        assert worker_exit_code(second) == 2, second.stderr[-3000:]
        line = one_line(second.stderr, "is in use by another run")
        assert f"pid {holder['pid']} on host {socket.gethostname()}" in line
        assert first.poll() is None
        rows = logged_rows(dump)
        wait_for(
            lambda: logged_rows(dump) > rows,
            first,
            timeout=60,
            what="the first run's next step",
            output=log.read_text,
        )
        (dump / "STOP").touch()
        assert first.wait(timeout=120) == 0
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert not (dump / "run.lock").exists()


@pytest.mark.multiprocess
def test_run_train_sh_exits_2_when_no_checkpoint_can_be_loaded(runs, tmp_path):
    """What a user sees: the worker's one line, and its exit code 2 (torchrun still reports the
    failed worker in its own words and exit code 1: issue 26 item 3 turns that into the
    launcher's exit 2)."""
    dump = runs.copy("none verifies", tmp_path)
    proc = run_train_sh(runs.argv_for(dump), timeout=300)
    assert worker_exit_code(proc) == 2, proc.stderr[-3000:]
    assert "holds 2 checkpoints and none can be loaded" in one_line(
        proc.stderr, "checkpoint error:"
    )


# ---------------------------------------------------------------- the exit codes docs list

EXIT_CODE_ROWS = {  # a phrase of a row of the table -> a run of the world that ends that way
    "trained to `training.steps`": "base",
    "a checkpoint could not be written": "full disk disabled",
    "any other failure": "crash",
    "a configuration or data error": "config error",
    "`checkpoint.load_step` names a checkpoint": "missing load_step",
    "none can be loaded": "none verifies",
    "other data settings": "data changed",
    "not plain data": "entry payload",
    "in use by another run": "live lock",
    "not enough free disk space": "disk check",
    "training cannot go on": "nonfinite stop",
}


def documented_exit_codes() -> list[tuple[int, str]]:
    """(code, when) of each row of docs/checkpointing.md's "Exit codes" table."""
    text = (REPO / "docs" / "checkpointing.md").read_text()
    section = text.split("\n## Exit codes\n", 1)[1].split("\n## ", 1)[0]
    return [(int(m[1]), m[2]) for m in re.finditer(r"^\| (\d+) \| (.+) \|$", section, re.M)]


@pytest.mark.multiprocess
def test_the_documented_exit_codes_are_those_the_runs_end_with(runs):
    rows = documented_exit_codes()
    assert len(rows) == len(EXIT_CODE_ROWS), rows
    for code, when in rows:
        [scenario] = [name for phrase, name in EXIT_CODE_ROWS.items() if phrase in when]
        assert runs.result(scenario).returncode == code, (code, when)
    stopped = runs.result("nonfinite stop").stderr
    assert "training error: step 2: loss or gradient norm has been non-finite for 2" in stopped
    assert "Traceback" not in stopped  # every exit 2 is one line
    refused = runs.result("disk check").stderr
    assert "checkpoint error: not enough disk space to save a checkpoint" in refused
    assert "Traceback" not in refused
    assert "RuntimeError: planted crash after step 1" in runs.result("crash").stderr
    assert (
        "checkpoint.load_step = 8: no complete checkpoint"
        in runs.result("missing load_step").stderr
    )
