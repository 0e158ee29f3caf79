"""A checkpoint saved under one parallel layout resumes under another (optimizer state and data
order included) and the losses continue as in the run that never stopped."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.local_tasks import TASKS, correct, loglikelihoods, responses, write_local_tasks
from harness.shared_world import SharedWorld
from harness.training import TINY_RUN, losses_by_step, write_word_tokenizer

STEPS, SAVED = 6, 3

LAYOUTS = {  # "single" runs in one process, the others on 2
    "single": [],
    "fsdp2": ["--parallelism.dp_shard=2"],
    "tp2": ["--parallelism.tp=2", "--parallelism.dp_shard=1"],
    "pp2": ["--parallelism.pp=2", "--parallelism.dp_shard=1"],
    "cp2": ["--parallelism.cp=2", "--parallelism.dp_shard=1"],
}


def args(dump: Path, corpus: str, steps: int, layout: str) -> list[str]:
    return [
        *TINY_RUN,
        f"--data.blend={corpus}",
        f"--job.dump_folder={dump}",
        f"--training.steps={steps}",
        f"--lr_scheduler.decay_steps={STEPS}",
        f"--checkpoint.interval={SAVED}",
        "--checkpoint.keep_latest_k=0",
        *LAYOUTS[layout],
    ]


PAIRS = [  # (source, target): saved under the one, resumed under the other
    ("fsdp2", "tp2"),
    ("fsdp2", "pp2"),
    ("fsdp2", "single"),
    ("single", "fsdp2"),
    ("tp2", "fsdp2"),
    ("pp2", "fsdp2"),
    ("pp2", "tp2"),
    ("fsdp2", "cp2"),
    ("cp2", "single"),
]
DAMAGED = "damaged"
AFRESH = "damaged-afresh"  # the same dump folder, started over


@dataclass(frozen=True)
class Runs:
    folder: Path
    """Each run's dump folder is folder/<its name>."""
    worlds: dict[str, SharedWorld]
    """The world each run is a scenario of."""

    def losses(self, name: str) -> dict[int, float]:
        """The losses of run `name`, which must have ended well."""
        self.worlds[name].result(name)
        return losses_by_step(self.folder / name)


@pytest.fixture(scope="module")
def runs(synthetic_corpus, tmp_path_factory) -> Runs:
    """Every run of the module, by name (each in a dump folder of that name beside the others):
    "reference" (uninterrupted, one process), "saved_<layout>" (stopped at the step-3
    checkpoint), "<source>-<target>" (a copy of saved_<source> resumed under <target>) and
    DAMAGED. Three shared worlds, as a resume needs the checkpoint of a run in another one:
    the 2-process saves; the single-process runs; the 2-process resumes."""
    out = tmp_path_factory.mktemp("resume_layouts")
    by_name: dict[str, SharedWorld] = {}

    def train(world: SharedWorld, name: str, layout: str, steps: int = STEPS) -> None:
        world.train(name, args(out / name, synthetic_corpus, steps, layout))
        by_name[name] = world

    def resume(world: SharedWorld, name: str, source: str, target: str) -> None:
        shutil.copytree(out / f"saved_{source}", out / name)
        train(world, name, target)

    saves = SharedWorld(out / "world_saves", 2)
    for layout in ("fsdp2", "tp2", "pp2", "cp2"):
        train(saves, f"saved_{layout}", layout, SAVED)
    saves.run()
    one = SharedWorld(out / "world_one_process", 0)
    train(one, "reference", "single")
    train(one, "saved_single", "single", SAVED)
    for source, target in PAIRS:
        if target == "single":
            resume(one, f"{source}-{target}", source, target)
    one.run()
    two = SharedWorld(out / "world_resumes", 2)
    for source, target in PAIRS:
        if target != "single":
            resume(two, f"{source}-{target}", source, target)
    # Rank 1's shard of the only checkpoint is truncated: the run stops (exit 2) on both ranks;
    # asked to start afresh (load_step = 0), it then reproduces the reference.
    shutil.copytree(out / "saved_fsdp2", out / DAMAGED)
    damaged_args = args(out / DAMAGED, synthetic_corpus, STEPS, "fsdp2")
    two.train(DAMAGED, damaged_args, expect=2)
    two.train(AFRESH, [*damaged_args, "--checkpoint.load_step=0"])
    by_name[DAMAGED] = by_name[AFRESH] = two
    shard = out / DAMAGED / "checkpoints" / f"step-{SAVED}" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    two.run()
    return Runs(out, by_name)


@pytest.mark.multiprocess
@pytest.mark.parametrize("source,target", PAIRS)
def test_resume_under_another_layout_continues_the_losses(runs, source, target):
    reference, resumed = runs.losses("reference"), runs.losses(f"{source}-{target}")
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        expected = reference[step]
        assert abs(resumed[step] - expected) / expected < 1e-5, (step, resumed[step], expected)


@pytest.mark.multiprocess
def test_ranks_agree_on_a_shard_damaged_on_one_of_them(runs):
    """Rank 1's shard of the only checkpoint is truncated: the ranks split the verification and
    agree that it is bad, so both stop with the same line (exit 2) and nothing is renamed;
    with checkpoint.load_step = 0 the run starts afresh and reproduces the reference run."""
    stopped = runs.worlds[DAMAGED].result(DAMAGED)
    for rank in stopped.ranks:
        assert rank.returncode == 2
        assert "holds 1 checkpoint and none can be loaded" in rank.stderr, rank.stderr
        assert f"step-{SAVED} is corrupt" in rank.stderr and "__1_0.distcp" in rank.stderr
    runs.worlds[AFRESH].result(AFRESH)
    replaced = runs.folder / DAMAGED / "checkpoints" / f"step-{SAVED}.replaced"
    assert (replaced / "__1_0.distcp").stat().st_size == 100
    reference, resumed = runs.losses("reference"), losses_by_step(runs.folder / DAMAGED)
    for step in range(1, STEPS + 1):
        assert abs(resumed[step] - reference[step]) / reference[step] < 1e-5, step


@pytest.mark.multiprocess
def test_the_step_3_save_of_each_layout_scores_as_the_one_process_save(runs, tmp_path):
    """lm-evaluation-harness's model (bloomnative.evaluation) reads a checkpoint saved under
    tensor, pipeline or data parallelism whole: on local tasks, the step-3 checkpoints of the
    same training under tp2 and pp2 give the one-process save's answers and
    log-likelihoods (the layouts' weights agree to fp32 rounding, as their losses do)."""
    lm_eval = pytest.importorskip("lm_eval", reason="the eval extra (lm_eval) is not installed")
    from bloomnative.evaluation import BloomnativeLM
    from bloomnative.evaluation.task_names import task_manager

    tokenizer = write_word_tokenizer(tmp_path / "tokenizer.json")
    manager = task_manager(TASKS, write_local_tasks(tmp_path))

    def scores(layout: str) -> dict:
        runs.worlds[f"saved_{layout}"].result(f"saved_{layout}")
        checkpoint = runs.folder / f"saved_{layout}" / "checkpoints" / f"step-{SAVED}"
        model = BloomnativeLM(checkpoint, tokenizer=tokenizer, batch_size=4, device="cpu")
        return lm_eval.simple_evaluate(
            model=model, tasks=TASKS, limit=3, task_manager=manager, log_samples=True
        )

    single = scores("single")
    for layout in ("tp2", "pp2"):
        saved = scores(layout)
        assert correct(saved, "local_choice", "acc") == correct(single, "local_choice", "acc")
        assert responses(saved, "local_qa") == responses(single, "local_qa")
        for task in ("local_choice", "local_text"):
            expected = loglikelihoods(single, task)
            assert loglikelihoods(saved, task) == pytest.approx(expected, abs=1e-4), layout
