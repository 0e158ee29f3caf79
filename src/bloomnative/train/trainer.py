"""The training loop: build (meta device -> parallelize -> materialise -> init or load), then
step: forward/backward over micro batches, clip, AdamW, log, evaluate, checkpoint."""

from __future__ import annotations

import contextlib
import math
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from bloomnative.adapters.lora import (
    adapter_shapes,
    apply_lora,
    describe_adapters,
    lora_initial_value,
    store_frozen_in,
)
from bloomnative.adapters.quantize import quantize_base_nf4
from bloomnative.checkpoint import checkpointer as ckpt
from bloomnative.checkpoint.reading import CheckpointReader, UnsafeCheckpointError
from bloomnative.checkpoint.resume import (
    Fresh,
    FromHF,
    ModelOnly,
    Resume,
    VerifiedCheck,
    plan_start,
)
from bloomnative.checkpoint.run_record import ARGS_FILE, BASE_FILE, DATA_FILE, model_fields
from bloomnative.config import Config
from bloomnative.data import build_loaders
from bloomnative.device import pick_device
from bloomnative.interop.hf_fingerprint import base_record
from bloomnative.log import get_logger
from bloomnative.model import Bloom
from bloomnative.model.state import load_model_state
from bloomnative.parallel import clip_grad_norm_, init_weights
from bloomnative.parallel.context_parallel import shard_sequence
from bloomnative.parallel.dropout_rng import seed_dropout_rng
from bloomnative.parallel.float8 import apply_float8, check_float8, precompute_float8_scales
from bloomnative.parallel.fsdp import OneRankAccumulation
from bloomnative.parallel.layout_check import pipeline_microbatches
from bloomnative.parallel.parallelize import parallelize_part
from bloomnative.parallel.pipeline import (
    Pipeline,
    PipelineStages,
    TiedWeightSync,
    build_pipeline,
    pipeline_forward_loss,
    split_for_pipeline,
)
from bloomnative.train.attention_choice import resolve_auto_attention
from bloomnative.train.distributed import init_distributed
from bloomnative.train.downstream import DownstreamEvaluator
from bloomnative.train.faults import StopRequest
from bloomnative.train.hang import HangRecorder, enable_flight_recorder
from bloomnative.train.input_files import (
    check_data_files,
    check_initial_hf,
    check_lora_base,
    check_quantize_base,
    init_adapter_state,
)
from bloomnative.train.loss import (
    LossFn,
    cross_entropy_sum,
    fused_head_cross_entropy_sum,
    global_loss_weight,
    loss_target,
    loss_weight,
    sum_over_ranks,
    weighted_mean,
)
from bloomnative.train.lr_schedule import LRClock, LRSchedule
from bloomnative.train.matmul_precision import apply_tf32
from bloomnative.train.metrics import (
    MetricsLogger,
    PeakMemory,
    ScalarSink,
    TensorBoardSink,
    Throughput,
    device_peak_tflops,
)
from bloomnative.train.nonfinite import NonFiniteGuard
from bloomnative.train.optimizer import build_optimizer, trains
from bloomnative.train.profiling import StepProfiler
from bloomnative.train.resolved import resolve_run
from bloomnative.train.resume_checks import data_settings, model_mismatch
from bloomnative.train.run_lock import lock_dump_folder
from bloomnative.train.spikes import (
    Rollback,
    RollbackLog,
    SpikeDetector,
    SpikeError,
    Trigger,
    recovers_spikes,
)
from bloomnative.train.tracking import WandbSink, check_wandb

_log = get_logger(__name__)


class Trainer:
    """Trains the run a config describes, on this process's share of the layout.

    A checkpoint is the composition of its components' states (`_checkpointed`): the model,
    the optimizers, the trainer's own step (`state_dict`), the data loader, the learning-rate
    clock, the non-finite guard, the spike detector and the RNG.

    Its extension points, which a subclass may override (calling the trainer's own), and which
    the scenarios of tests/scenarios/ use to inject faults and probes: `train_step` (one
    optimizer step), `loss_sum` (the loss of a micro batch, in training and evaluation),
    `log_step` (the metrics row of a log step, where the host reads the device's metrics) and
    `roll_back` (a loss-spike rollback). `bloomnative.launch.worker.main` runs a subclass given
    as its `trainer_class`.
    """

    def __init__(self, config: Config):
        job = config.job
        self.device = pick_device(job.device)
        apply_tf32(config.training.tf32, self.device)
        enable_flight_recorder(Path(job.dump_folder), self.device.type)
        self.rank, self.world_size = init_distributed(self.device, job.collective_timeout_s)
        # Taken before anything is written to the dump folder; released by `run`, or here when
        # the set-up fails.
        self.run_lock = lock_dump_folder(Path(job.dump_folder))
        try:
            self._set_up(config)
        except BaseException:
            self.run_lock.release()
            raise

    def _set_up(self, config: Config) -> None:
        job = config.job
        self.hang = HangRecorder(
            Path(job.dump_folder), self.rank, self.world_size, job.collective_timeout_s
        )
        self.progress = self.hang.progress  # what this rank is doing, for a hang's record
        self.resolved = resolve_run(
            config,
            self.world_size,
            self.device,
            choose_attention=partial(
                resolve_auto_attention,
                device=self.device,
                dump_folder=Path(job.dump_folder),
                rank=self.rank,
                world_size=self.world_size,
                collective_timeout_s=job.collective_timeout_s,
                log=_log.info,
            ),
            device_memory=lambda: _smallest_device_memory(self.device),
            log=_log.info,
        )
        check_lora_base(config)
        check_quantize_base(
            self.resolved.config, self.resolved.model_args, self.resolved.dims.fsdp_shards
        )
        check_float8(
            config.quantize,
            config.compile.enable,
            self.device,
            _log.warning if self.rank == 0 else lambda line: None,
            fsdp=self.resolved.fsdp,
        )
        check_data_files(config)
        check_wandb(config.metrics)
        # The run as resolved ("auto" settings replaced by their choice), and its layout.
        self.config, self.dims = self.resolved.config, self.resolved.dims
        train_cfg, par = self.config.training, self.config.parallelism
        lora = self.config.lora
        # The whole model's adapter parameters by name and shape (LoRA), else None.
        self.adapters = (
            adapter_shapes(self.resolved.model_args, lora.rank, lora.target_modules)
            if lora.rank
            else None
        )
        self.dump = Path(job.dump_folder)
        self.mesh, self.dp_mesh = self.dims.build_mesh(self.device.type)
        self.pp_mesh = self.mesh["pp"]  # sliced once: slicing a mesh is host work on every call
        self.loss_mesh = self.dims.loss_mesh(self.mesh)
        # The ranks holding different tokens of a batch (data and context parallel): the loss's
        # token count and the loss itself are summed over these groups (train/loss.py).
        self.batch_groups = [self.loss_mesh.get_group()] if self.dims.dp * self.dims.cp > 1 else []
        self.pp_group = self.pp_mesh.get_group() if self.dims.pp > 1 else None

        seed_dropout_rng(job.seed, self.mesh, self.loss_mesh, par.sequence_parallel)
        self.bf16 = train_cfg.dtype == "bf16"
        self._build_model()
        self.loss_context = (
            loss_parallel if (self.dims.tp > 1 and par.loss_parallel) else contextlib.nullcontext
        )

        # A LoRA pipeline stage may hold no adapters (only the embedding, say): no optimizer.
        self.trained_parts = [p for p in self.model_parts if trains(p)]
        self.optimizers = [build_optimizer([p], self.config.optimizer) for p in self.trained_parts]
        self.params = [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]]
        self.nonfinite = NonFiniteGuard(self.optimizers, self.device, train_cfg.max_nonfinite_steps)
        schedule = LRSchedule.from_config(
            self.config.lr_scheduler, self.config.optimizer, train_cfg.steps,
            train_cfg.global_batch_size,
        )  # fmt: skip
        self.lr_clock = LRClock(schedule, self.device)
        self.interval_losses: list[torch.Tensor] = []  # per step, since the last log row

        self._build_data()
        self.step = 0
        ckpt_cfg = self.config.checkpoint
        self.ckpt_folder = self.dump / ckpt_cfg.folder
        self.checkpointer = ckpt.Checkpointer(
            self.ckpt_folder,
            ckpt_cfg.keep_latest_k,
            ckpt_cfg.async_mode == "async",
            ckpt_cfg.min_free_gib,
        )
        # Kept whether spike detection is on or not: earlier rollbacks' windows apply to every
        # resume.
        self.rollback_log = RollbackLog(self.ckpt_folder / "rollbacks.json", self.rank == 0)
        self.spike_detector = None
        if recovers_spikes(self.config.spikes, ckpt_cfg):
            self.spike_detector = SpikeDetector(self.config.spikes, self.device)
        elif self.config.spikes.enable:
            _log.info("spikes.enable is ignored: checkpoint.enable = false")
        self._start()

        sinks = self._scalar_sinks() if self.rank == 0 else []
        self.metrics = MetricsLogger(self.dump, sinks, self.rank == 0)
        # [downstream]: rank 0 scores checkpoints in a process of its own.
        self.downstream = DownstreamEvaluator(
            self.config.downstream, self.ckpt_folder, self.dump, self.metrics, self.rank == 0
        )
        self.peak_memory = PeakMemory(self.device)
        peak = device_peak_tflops(self.device, self.config.metrics.peak_tflops)
        args = self.resolved.model_args
        adapter_params = sum(shape.numel() for shape in (self.adapters or {}).values())
        flops = args.flops_per_token(train_cfg.seq_len, adapter_params)
        self.throughput = Throughput(flops, peak, self.world_size)
        if self.rank == 0:
            self._write_resolved_config()
            _log.info(
                f"{job.name}: {args.num_params() / 1e6:.1f}M parameters, layout "
                f"{self.dims.summary}, device {self.device}, dtype {train_cfg.dtype}, "
                f"starting at step {self.step}"
            )

    # ------------------------------------------------------------------ set-up helpers

    def _build_model(self) -> None:
        """Meta model -> pipeline split -> FP8 linears -> adapters -> TP / AC / compile / FSDP ->
        materialise -> init."""
        cfg, par = self.config, self.config.parallelism
        with torch.device("meta"):
            model = Bloom(self.resolved.model_args)
        self.pp_rank = self.pp_mesh.get_local_rank()
        placement = split_for_pipeline(
            model,
            self.pp_mesh,
            schedule=par.pp_schedule,
            stages_per_rank=par.pp_stages_per_rank,
            layers_per_stage=par.pp_layers_per_stage or None,
            embedding_as_layer=par.pp_embedding_as_layer,
        )
        parts = placement.parts
        param_dtype = torch.bfloat16 if self.bf16 else torch.float32
        lora = cfg.lora
        quantised = lora.quantize_base == "nf4"
        for part in parts:
            if cfg.quantize.linear != "none":  # before the adapters, which keep its matmuls
                apply_float8(
                    part,
                    cfg.quantize.linear.removeprefix("float8_"),
                    cfg.quantize.emulate,
                    _log.info if self.rank == 0 else None,
                    fsdp_all_gather=cfg.quantize.fsdp_float8_all_gather,
                )
            if lora.rank:
                apply_lora(part, lora.rank, lora.alpha, lora.dropout, lora.target_modules)
                if self.bf16:  # no fp32 master weights for the frozen base
                    store_frozen_in(part, torch.bfloat16)
            if quantised:
                self._materialise_quantised(part)
            parallelize_part(
                part,
                self.mesh,
                self.dims,
                par,
                cfg.activation_checkpoint,
                cfg.compile.enable,
                param_dtype,
            )
            if not quantised:
                self._materialise(part)
            part.train()
        self.model_parts = parts
        self.one_rank_accumulation = (
            OneRankAccumulation(parts, par.zero_stage) if self.dims.dp * self.dims.cp == 1 else None
        )
        if lora.rank and self.rank == 0:
            _log.info(describe_adapters(parts))
        # With the fused loss, the part holding the head returns hidden states and the loss
        # applies the head.
        self.head: nn.Linear | None = None  # on this rank, and applied by the loss
        if cfg.model.fused_loss:
            self.head = next((p.lm_head for p in parts if p.lm_head is not None), None)
            for part in parts:
                part.head_in_loss = True
        # Compiled, the cross-entropy reads the logits in their dtype and keeps them for a
        # one-pass backward, instead of two fp32 [tokens, vocab] copies
        # (planner.loss_transient).
        self._cross_entropy_sum = (
            torch.compile(cross_entropy_sum) if self.resolved.compile_loss else cross_entropy_sum
        )
        self._pipeline: Pipeline | None = None
        self.pipeline_stages: PipelineStages | None = None
        self.tied_sync = None
        self.untied_copies: list = []
        if self.dims.pp > 1:
            self.pipeline_stages = placement
            self.tied_sync = TiedWeightSync(self.pipeline_stages, self.mesh)
            self.untied_copies = [
                p.lm_head.weight
                for p in parts
                if p.lm_head is not None and p.word_embeddings is None
            ]

    def _materialise(self, part: Bloom) -> None:
        """Allocates `part`'s parameters on this device and gives them their initial values
        (the adapters PEFT's), whatever their layout."""
        part.to_empty(device=self.device)
        lora = self.config.lora
        adapters = lora_initial_value(part.initial_value) if lora.rank else None
        init_weights(part, self.config.job.seed, adapters)

    def _materialise_quantised(self, part: Bloom) -> None:
        """QLoRA (`lora.quantize_base = "nf4"`): `part` whole on this device, its base from
        `checkpoint.initial_hf` and its frozen block linears stored in NF4, before it is
        sharded. FSDP2 shards and gathers an NF4 tensor it is given (torchao's
        `fsdp_pre_all_gather`), but cannot have a sharded weight replaced by one. Every start,
        fresh or resumed, quantises the same bf16 weights the same way, so the checkpoints need
        not hold the base (`_load_initial_hf` has nothing left to do)."""
        from bloomnative.interop.hf import hf_model_state

        self._materialise(part)
        hf_dir = self.config.checkpoint.initial_hf
        check_initial_hf(hf_dir, self.resolved.model_args)
        load_model_state([part], hf_model_state(hf_dir), full=True)
        layers = quantize_base_nf4(part)
        _log.info(f"base from Hugging Face folder {hf_dir}: {len(layers)} linear layers in NF4")

    def pipeline(self, n_microbatches: int) -> Pipeline:
        """The training schedule for this many micro batches (rampup changes the count). Only
        the current one is kept: each holds a forward and a gradient receive buffer per micro
        batch, so keeping one per count would grow through the whole rampup."""
        if self._pipeline is None or self._pipeline.n_microbatches != n_microbatches:
            self._pipeline = None  # freed before the next one is allocated
            assert self.pipeline_stages is not None  # pp > 1
            self._pipeline = build_pipeline(self.pipeline_stages, n_microbatches, self.device)
            self.hang.watch_pipeline(self._pipeline.stages)
        return self._pipeline

    def loss_sum(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Weighted token-summed cross-entropy (train/loss.py) of the last stage's output:
        logits, or with `model.fused_loss` the final hidden states, to which the loss applies
        the head. `target`: `loss_target` of the micro batch."""
        if self.head is None:
            return self._cross_entropy_sum(output, target)
        return fused_head_cross_entropy_sum(output, self.head.weight, target)

    def _build_data(self) -> None:
        """This rank's training loader and validation loader makers (`bloomnative.data`)."""
        shard = None
        if self.dims.cp > 1:  # this rank's load-balanced chunks of every sequence
            cp_rank = self.mesh["cp"].get_local_rank()
            shard = partial(shard_sequence, cp_rank=cp_rank, cp=self.dims.cp)
        loaders = build_loaders(
            self.config.data,
            self.resolved.data,
            seed=self.config.job.seed,
            dp_rank=self.dp_mesh.get_local_rank(),
            dp_size=self.dims.dp,
            device=self.device,
            sequence_shard=shard,
        )
        self.train_loader = loaders.train
        self.make_valid_loader, self.valid_long = loaders.valid, loaders.valid_long

    def _scalar_sinks(self) -> list[ScalarSink]:
        """What [metrics] asks the logged scalars to be written to besides metrics.jsonl."""
        metrics = self.config.metrics
        sinks: list[ScalarSink] = []
        if metrics.tensorboard:
            sinks.append(TensorBoardSink(self.dump / "tb"))
        if metrics.wandb:
            self.dump.mkdir(parents=True, exist_ok=True)
            config = self.config.to_dict()
            sinks.append(WandbSink(metrics, self.config.job.name, self.dump, config))
        return sinks

    def _write_resolved_config(self) -> None:
        self.dump.mkdir(parents=True, exist_ok=True)
        (self.dump / "config.toml").write_text(self.config.to_toml())

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trainer's own part of a checkpoint: the step reached."""
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])

    def _checkpointed(self) -> dict[str, Stateful]:
        """What a checkpoint holds, by the key prefix of its entries (docs/checkpointing.md)."""
        components: dict[str, Stateful] = {
            # A LoRA run saves its adapters; its frozen base comes from checkpoint.initial_hf.
            "model": ckpt.ModelState(self.model_parts, frozen=not self.config.lora.rank),
            "optimizer": ckpt.OptimizerState(self.trained_parts, self.optimizers),
            "train": self,
            "data": self.train_loader,
            "lr_clock": self.lr_clock,
            "nonfinite": self.nonfinite,
            "rng": ckpt.RNGState(),
        }
        if self.spike_detector is not None:
            components["spikes"] = self.spike_detector
        return components

    def _start(self) -> None:
        """Starts as `plan_start` decides (checkpoint/resume.py): the checkpoints it passed over
        are set aside, then the weights, or every component's state, are loaded. Raises
        BadCheckpointError when the run cannot start as configured."""
        cfg = self.config.checkpoint
        # A LoRA run's frozen base, which its checkpoints record instead of holding it.
        self.base = base_record(cfg.initial_hf) if self.config.lora.rank else None
        check = VerifiedCheck(self.checkpointer, self._fits, data_settings(self.config), self.base)
        plan = plan_start(
            self.ckpt_folder,
            check,
            enabled=cfg.enable,
            load_step=cfg.load_step,
            initial_hf=cfg.initial_hf,
            allow_data_change=cfg.allow_data_change,
        )
        if plan.replaces_checkpoints:
            self.checkpointer.set_aside_after(0, "replaced")
        for rejection in plan.passed_over:
            self.checkpointer.set_aside(rejection)
        try:
            match plan.start:
                case FromHF(path):
                    self._load_initial_hf(path)
                case ModelOnly(step):
                    reader = self.checkpointer.reader(step)
                    model = {"model": ckpt.ModelState(self.model_parts)}
                    ckpt.load_components(reader, model, complete=("model",))
                    _log.info(f"initial weights from model-only checkpoint {reader.folder}")
                case Resume(step, base):
                    reader = self.checkpointer.reader(step)
                    if base:  # a LoRA run's checkpoint holds the adapters only
                        self._load_initial_hf(base)
                    self.load_training_state(reader)
                    _log.info(f"resumed from {reader.folder} at step {self.step}")
        except UnsafeCheckpointError as e:
            raise ckpt.BadCheckpointError(str(e)) from None
        if self.config.lora.init_adapter and isinstance(plan.start, Fresh | FromHF):
            self._load_init_adapter()

    def _fits(self, reader: CheckpointReader) -> str | None:
        """Why a verified checkpoint holds another model than this run's, or None."""
        return model_mismatch(reader, self.resolved.model_args, self.adapters)

    def load_training_state(self, reader: CheckpointReader) -> None:
        """Every component of a verified checkpoint (`_checkpointed`). The loader skips the data
        windows the checkpoint saved and those rollbacks.json lists (a rollback is recorded
        there before any checkpoint holds it)."""
        components = self._checkpointed()
        ckpt.load_components(reader, components, complete=("model", "optimizer", "train"))
        for window in self.rollback_log.windows():
            self.train_loader.skip(*window)

    def _load_initial_hf(self, hf_dir: str) -> None:
        """Continued pretraining, or a LoRA run's frozen base (at every start): every rank reads
        the Hugging Face folder and keeps its shard. A QLoRA run's base is already in place
        (`_materialise_quantised`)."""
        from bloomnative.interop.hf import hf_model_state

        if self.config.lora.quantize_base == "nf4":
            return
        check_initial_hf(hf_dir, self.resolved.model_args)
        load_model_state(self.model_parts, hf_model_state(hf_dir), full=True)
        _log.info(f"weights from Hugging Face folder {hf_dir}")

    def _load_init_adapter(self) -> None:
        """Fine-tuning on from a PEFT adapter: every rank reads the folder and keeps its shard."""
        folder = self.config.lora.init_adapter
        state = init_adapter_state(self.config.lora, self.resolved.model_args)
        load_model_state(self.model_parts, state, full=True)
        _log.info(f"initial adapters from PEFT folder {folder}")

    def save_checkpoint(self) -> None:
        """Saves this step's checkpoint, unless the state is not healthy (a run of skipped
        steps, NaN or infinite values): then the newest checkpoint stays the newest healthy
        one, and a warning says why. Raises NonFiniteError once too many steps in a row were
        skipped, before saving."""
        start = time.perf_counter()
        self.nonfinite.check(self.step)
        state = {name: c.state_dict() for name, c in self._checkpointed().items()}
        why = self.nonfinite.reason_not_to_save({**state["model"], **state["optimizer"]})
        if why is not None:
            _log.warning(
                f"not saving checkpoint step-{self.step}: {why}; the newest checkpoint in "
                f"{self.ckpt_folder} stays the last one saved from a healthy state"
            )
            return
        files = {
            ARGS_FILE: model_fields(self.resolved.model_args),
            DATA_FILE: data_settings(self.config),
        }
        if self.base is not None:
            files[BASE_FILE] = self.base
        self.checkpointer.save(self.step, state, files)
        mode = "started" if self.checkpointer.async_mode else "saved"
        _log.info(
            f"{mode} checkpoint step-{self.step} in {self.ckpt_folder} "
            f"({time.perf_counter() - start:.2f}s blocking)"
        )

    # ------------------------------------------------------------------ the step

    def global_batch_size(self) -> int:
        """The next step's global batch size (batch-size rampup follows the samples consumed)."""
        return self.resolved.batch_size(self.train_loader.consumed_samples)

    def forward_backward(self, micro_batches) -> torch.Tensor:
        """Accumulates the gradients of the global batch's mean token loss over this rank's
        micro batches and returns this rank's share of that mean (a 0-d tensor, no host sync;
        0 on pipeline ranks without the last stage): the shares of all ranks sum to the mean,
        as FSDP sums their gradients (over data- and context-parallel ranks)."""
        total_weight = global_loss_weight(micro_batches, self.batch_groups)
        return self._run_micro_batches(
            micro_batches, weighted_mean(self.loss_sum, total_weight), True
        )

    def _run_micro_batches(self, micro_batches, loss_fn: LossFn, train: bool) -> torch.Tensor:
        """The one micro-batch loop of training and evaluation: the sum of `loss_fn` over this
        rank's micro batches, with gradients accumulated when `train`. Under pipeline
        parallelism training runs the schedule and evaluation a forward-only pass through the
        stages (`pipeline_forward_loss`), which works for every schedule and sequence length."""
        if self.config.quantize.fsdp_float8_all_gather:  # scales of the weights as they are now
            precompute_float8_scales(self.model_parts)
        with self.loss_context():
            if self.dims.pp > 1 and train:
                return self._pipeline_forward_backward(micro_batches, loss_fn)
            if self.dims.pp > 1:
                stage_inputs = [(m.input_ids, loss_target(m), m.segments) for m in micro_batches]
                assert self.pipeline_stages is not None
                return pipeline_forward_loss(
                    self.pipeline_stages, stage_inputs, loss_fn, self.device
                )
            model = self.model_parts[0]
            total = torch.zeros((), device=self.device)
            for index, micro in enumerate(micro_batches):
                self.progress.micro_batch = index
                # The output is not kept in a variable, so the [b, s, vocab] logits are freed
                # as soon as the loss (and its backward) has used them.
                loss = loss_fn(model(micro.input_ids, segments=micro.segments), loss_target(micro))
                if train:
                    if self.one_rank_accumulation is not None:
                        self.one_rank_accumulation.before_backward(index == len(micro_batches) - 1)
                    loss.backward()
                total += _local(loss.detach())
            self.progress.micro_batch = None
            return total

    def _pipeline_forward_backward(self, micro_batches, loss_fn: LossFn) -> torch.Tensor:
        samples = sum(len(inputs) for inputs, _ in micro_batches)
        n = pipeline_microbatches(
            self.config.parallelism.pp_microbatches, samples, self.config.training.micro_batch_size
        )
        inputs = torch.cat([m.input_ids for m in micro_batches])
        target = torch.cat([loss_target(m) for m in micro_batches])
        segments = None
        if micro_batches[0].segments is not None:
            starts, ends = zip(*(m.segments for m in micro_batches), strict=True)
            segments = (torch.cat(starts), torch.cat(ends))
        losses = self.pipeline(n).step(inputs, target, loss_fn, segments)
        if self.tied_sync is not None:
            self.tied_sync()
        total = torch.zeros((), device=self.device)
        for loss in losses:
            total += _local(loss.detach())
        return total

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """One optimizer step; returns its loss, gradient norm and learning rate (0-d tensors on
        the device, not read back) and its global batch size."""
        gbs = self.global_batch_size()
        lr = self.lr_clock.lr()
        self.progress.step, self.progress.phase = self.step + 1, "forward-backward"
        micro_batches = self.train_loader.next_batch(gbs)
        loss = self.forward_backward(micro_batches)
        self.progress.phase = "optimizer"
        grad_norm = clip_grad_norm_(
            self.params,
            self.config.training.max_norm,
            pp_group=self.pp_group,
            not_counted=self.untied_copies,
            device=self.device,
        )
        applied = self.nonfinite.step(loss, grad_norm, lr)  # skips the update on NaN/inf
        self.lr_clock.advance(applied, gbs)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self.step += 1
        return loss, grad_norm, lr, gbs

    def _global_loss(self, value: torch.Tensor) -> torch.Tensor:
        """The loss (or a tensor of losses) every rank agrees on, left on the device: this
        rank's shares summed over the pipeline ranks (only the last stage holds one) and the
        ranks of `batch_groups` (each share is already divided by the global token count)."""
        pp_group = [self.pp_group] if self.pp_group is not None else []
        return sum_over_ranks(value.detach().clone(), pp_group + self.batch_groups)

    def _max_over_ranks(self, value: float) -> float:
        """The largest value any rank has (memory: the rank that limits the layout)."""
        if self.world_size == 1:
            return value
        t = torch.tensor(value, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    @torch.no_grad()
    def evaluate(self, make_loader) -> float:
        """Mean token loss over `validation.steps` global batches of a validation loader: their
        summed (weighted) token losses over their total weight (train/loss.py)."""
        loader = make_loader()
        for part in self.model_parts:
            part.eval()
        summed = torch.zeros((), device=self.device)
        total_weight = torch.zeros((), device=self.device)
        for _ in range(self.config.validation.steps):
            batch = loader.next_batch(self.config.training.global_batch_size)
            summed += self._run_micro_batches(batch, self.loss_sum, train=False)
            total_weight += loss_weight(batch)
        for part in self.model_parts:
            part.train()
        total_weight = sum_over_ranks(total_weight, self.batch_groups)
        total_weight = torch.where(total_weight > 0, total_weight, torch.ones_like(total_weight))
        return self._global_loss(summed / total_weight).item()

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        """`train`, then release the process group. After a failure the process group is left
        as it is: destroying it waits for peers that may be gone (`main` exits at once); a
        collective's failure leaves this rank's record in <dump_folder>/hang/ (train/hang.py).
        The dump folder's lock is released either way."""
        try:
            self.train()
        except Exception as e:
            self.hang.record(e)
            raise
        finally:
            self.run_lock.release()
        if dist.is_initialized():
            dist.destroy_process_group()

    def train(self) -> None:
        """Trains to `training.steps`, or until asked to stop (SIGTERM, SIGUSR1 or a STOP file
        in the dump folder), saving a checkpoint at the step where it stops."""
        t, v = self.config.training, self.config.validation
        ckpt_cfg = self.config.checkpoint
        stop = StopRequest(self.dump / "STOP")
        self.throughput.read_and_reset()
        self.peak_memory.reset()  # the first row's peak: the steps', not the set-up's
        profiler = StepProfiler(self.config.profiling, self.dump, self.rank, self.device)
        try:
            if self.step >= t.steps:  # resumed at or past the end: nothing trained or saved
                _log.info(
                    f"nothing to train: the run is at step {self.step} and training.steps = "
                    f"{t.steps}; its checkpoints are left as they are (raise training.steps to "
                    "train on)"
                )
            profiler.start(self.step, t.steps)
            while self.step < t.steps:
                loss, grad_norm, lr, gbs = self.train_step()
                self.checkpointer.poll(self.step)  # an async save's failed write, at once
                self.downstream.poll()
                profiler.after_step(self.step)
                self.interval_losses.append(loss)
                self.throughput.add_tokens(gbs * t.seq_len)
                logs_now = self._is_log_step()
                checkpoint_step = ckpt_cfg.enable and (
                    self.step % ckpt_cfg.interval == 0 or self.step == t.steps
                )
                if self.spike_detector and self._rolled_back(
                    loss, grad_norm, read_now=logs_now or checkpoint_step
                ):
                    self.interval_losses = []  # steps that were undone are not logged
                    continue
                if logs_now:
                    self.progress.phase = "log"
                    self.nonfinite.check(self.step)
                    self.log_step(grad_norm, lr, gbs)
                if v.freq and self.make_valid_loader and self.step % v.freq == 0:
                    self.progress.phase = "evaluate"
                    self._log_eval()
                self.progress.phase = "stop-check"
                stopping = stop.should_stop()
                if checkpoint_step or (ckpt_cfg.enable and stopping):
                    self.progress.phase = "checkpoint"
                    self.save_checkpoint()
                    self.downstream.checkpoint_saved(self.step)
                if stopping:
                    _log.info(f"stopping at step {self.step}: {stop.reason}")
                    break
            self.checkpointer.wait()
            self.downstream.finish()
        finally:
            self.downstream.close()
            profiler.close()
            stop.restore()
            self.metrics.close()

    # ------------------------------------------------------------------ loss spikes

    def _rolled_back(self, loss: torch.Tensor, grad_norm: torch.Tensor, read_now: bool) -> bool:
        """Feeds the step's global loss and gradient norm to the spike detector; when `read_now`
        (log and checkpoint steps, where the host reads the device anyway) rolls back if it
        fired."""
        assert self.spike_detector is not None  # called only with spike detection on
        self.spike_detector.observe(self.step, self._global_loss(loss), grad_norm)
        if not read_now:
            return False
        trigger = self.spike_detector.fired()
        if trigger is None:
            return False
        self.roll_back(trigger)
        return True

    def roll_back(self, trigger: Trigger) -> None:
        """Restores the newest verified checkpoint from before the spike and skips the data
        trained on since it, plus spikes.skip_steps batches; records the rollback
        (train/spikes.py)."""
        cfg, done = self.config.spikes, self.rollback_log.rollbacks
        what = f"loss spike detected at step {self.step} ({trigger.describe(cfg)})"
        if len(done) >= cfg.max_rollbacks:
            raise SpikeError(
                f"{what}, but spikes.max_rollbacks = {cfg.max_rollbacks} rollbacks have been "
                f"made already (at steps {[r.step for r in done]}); giving up: lower the "
                "learning rate, inspect the data, or raise spikes.max_rollbacks"
            )
        self.checkpointer.wait()
        restored, _ = self.checkpointer.newest_usable(self._fits, before=trigger.first_step)
        if restored is None:
            raise SpikeError(
                f"{what}, but no checkpoint from before step {trigger.first_step} verifies in "
                f"{self.ckpt_folder}, so there is nothing to roll back to"
            )
        self.checkpointer.set_aside_after(restored, "rolled-back")
        detected_step = self.step
        loader = self.train_loader
        spike_end = loader.position(loader.consumed_samples)
        skip = cfg.skip_steps * self.global_batch_size()
        self.load_training_state(self.checkpointer.reader(restored))
        window = (loader.position(loader.consumed_samples), spike_end + skip)
        loader.skip(*window)
        self._check_data_left(what)
        self.rollback_log.add(Rollback(detected_step, trigger.first_step, restored, what, window))
        self.metrics.log(
            {
                "step": detected_step,
                "rollback": len(self.rollback_log.rollbacks),
                "rollback_to_step": restored,
                "rollback_trigger": what,
                "skipped_samples": list(window),
                "skipped_sample_count": window[1] - window[0],
            }
        )
        _log.info(
            f"{what}: rolled back to step {restored}, skipping samples "
            f"[{window[0]}, {window[1]}) of the training order"
        )

    def _check_data_left(self, what: str) -> None:
        """After a skip: the training split must still hold the data of every remaining step."""
        loader, t = self.train_loader, self.config.training
        remaining = t.steps - self.step
        last = loader.position(loader.consumed_samples + remaining * t.global_batch_size - 1)
        if last >= len(loader.dataset):
            raise SpikeError(
                f"{what}: after skipping {loader.skipped} the remaining {remaining} steps need "
                f"the training order up to position {last}, but it has {len(loader.dataset)} "
                "samples; lower spikes.skip_steps or restart (the index is sized for "
                "spikes.max_rollbacks windows)"
            )

    def _is_log_step(self) -> bool:
        steps = self.config.training.steps
        return self.step % self.config.metrics.log_freq == 0 or self.step in (1, steps)

    def log_step(self, grad_norm: torch.Tensor, lr: torch.Tensor, gbs: int) -> None:
        """One row for the steps since the last: `loss` is their mean (Megatron's logged loss),
        over the steps whose loss is finite; each step's own goes to TensorBoard as loss_step."""
        losses = self._global_loss(torch.stack(self.interval_losses)).tolist()
        self.interval_losses = []
        finite = [x for x in losses if math.isfinite(x)]
        row = {
            "step": self.step,
            "loss": sum(finite) / len(finite) if finite else float("nan"),
            "lr": lr.item(),
            "grad_norm": grad_norm.item(),
            "global_batch_size": gbs,
            "consumed_samples": self.train_loader.consumed_samples,
            **self.throughput.read_and_reset(),
            "mem_peak_gib": self._max_over_ranks(self.peak_memory.interval_peak_gib()),
            "nonfinite_skipped": self.nonfinite.skipped,
        }
        self.metrics.log(row)
        self.metrics.log_series("loss_step", self.step - len(losses) + 1, losses)

    def _log_eval(self) -> None:
        start = time.perf_counter()
        row: dict[str, float] = {"step": self.step}
        row["eval_loss"] = self.evaluate(self.make_valid_loader)
        row["eval_ppl"] = math.exp(min(row["eval_loss"], 50.0))
        if self.valid_long is not None:
            row["eval_loss_long"] = self.evaluate(self.valid_long)
        row["eval_seconds"] = time.perf_counter() - start
        self.metrics.log(row)
        self.throughput.read_and_reset()  # evaluation time is not training throughput


def _smallest_device_memory(device: torch.device) -> int:
    """Total memory of the smallest CUDA device over all ranks, so every rank plans alike."""
    total = torch.tensor(torch.cuda.get_device_properties(device).total_memory, device=device)
    if dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.MIN)
    return int(total.item())


def _local(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (the loss under loss parallelism) as a plain tensor."""
    return t.to_local() if isinstance(t, DTensor) else t
