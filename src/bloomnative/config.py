"""Run configuration: dataclasses with a docstring per field <- TOML file <- CLI overrides.

Each section of the TOML file is one dataclass below; each component is handed only its own
section. Unknown sections or keys, values of the wrong type and impossible combinations are
reported with the key's full name (and the nearest valid name) before any model is built.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import json
import math
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from bloomnative.model.attention import AttentionBackend, attention_for_planning

if TYPE_CHECKING:
    from bloomnative.model.args import BloomArgs

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "debug.toml"


class ConfigError(ValueError):
    """A configuration mistake, described for the person who made it."""


# The choices of the config, each listed once; the parser checks every Literal-typed field
# against its type, and the modules that act on a choice import its list from here.
PipelineSchedule = Literal[
    "GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"
]
RecomputeMode = Literal["none", "full", "selective"]
OptimizerImpl = Literal["fused", "foreach", "for-loop"]
OptimizerState = Literal["fp32", "bf16", "8bit"]
QuantizeBase = Literal["none", "nf4"]
QuantizeLinear = Literal["none", "float8_rowwise", "float8_tensorwise"]
LoRATarget = Literal["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]
"""The linear layers of a BLOOM block an adapter may target, by their Hugging Face names."""


@dataclass
class JobConfig:
    name: str = "bloomnative"
    """Run name, shown in logs."""
    dump_folder: str = "outputs/debug"
    """Folder for metrics.jsonl, tb/ and checkpoints/ (relative paths are relative to the
    current directory)."""
    seed: int = 42
    """Seed of the weight init, the data order and the dropout masks; same seed, same run."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """"auto" (CUDA when present, else CPU), "cuda" or "cpu"."""
    collective_timeout_s: int = 600
    """Seconds a collective may wait before the run fails loudly instead of hanging."""


@dataclass
class ModelConfig:
    preset: str = "debug"
    """Shape preset: debug, bloom-560m, bloom-1b1, bloom-1b7, bloom-3b, bloom-7b1, bloom-176b.
    With checkpoint.initial_hf the folder's config.json is the shape instead: the keys below
    left at 0 are taken from it, and those set must agree with it."""
    n_layer: int = 0
    """Override the preset's number of blocks (0 keeps the preset)."""
    hidden_size: int = 0
    """Override the preset's hidden size (0 keeps the preset)."""
    n_head: int = 0
    """Override the preset's head count (0 keeps the preset)."""
    vocab_size: int = 0
    """Override the preset's vocabulary size (0 keeps the preset); must cover the tokenizer."""
    attention: Literal[AttentionBackend, "auto"] = "sdpa"
    """Attention backend: "sdpa" (portable), "flex" (GPU, FlexAttention), "triton" or "auto" (on a
    GPU the fastest of the three, timed once on the run's shapes and cached in the dump folder;
    "sdpa" on CPU)."""
    fused_kernels: bool = False
    """Use the Triton LayerNorm and bias-GeLU kernels."""
    fused_loss: bool = False
    """Compute the lm head and cross-entropy chunk by chunk (kernels.linear_cross_entropy), so the
    full fp32 logits are never in memory."""
    hidden_dropout: float = 0.0
    """Dropout probability on the embedding output and on the attention and MLP outputs before
    each residual add (Megatron's --hidden-dropout; BLOOM trained with 0.1). Training only."""
    attention_dropout: float = 0.0
    """Dropout probability on the attention probabilities (Megatron's --attention-dropout; BLOOM
    trained with 0.1). Training only; "sdpa" and "triton" backends."""


@dataclass
class TrainingConfig:
    steps: int = 200
    """Optimizer steps to train for."""
    seq_len: int = 256
    """Tokens per sample."""
    global_batch_size: int = 16
    """Samples per optimizer step, over all data-parallel ranks and micro batches."""
    micro_batch_size: int = 8
    """Samples per forward/backward on one rank; the rest is gradient accumulation."""
    rampup_batch_size: list[int] = field(default_factory=list)
    """[start, increment, samples]: start at `start` samples per step and grow by `increment`
    evenly over `samples` consumed samples (Megatron's rampup). Empty: no rampup."""
    dtype: Literal["bf16", "fp32"] = "bf16"
    """"bf16" (bf16 compute, fp32 master weights, fp32 gradient reduction) or "fp32"."""
    tf32: bool = True
    """On CUDA, fp32 matmuls and convolutions use TF32 tensor cores: several times faster, their
    inputs rounded to 10 mantissa bits (relative error up to 2^-11, fp32's is 2^-24), sums kept
    in fp32. false: full fp32. bf16 compute does not change; no effect on CPU."""
    max_norm: float = 1.0
    """Clip gradients to this global L2 norm (0 disables)."""
    max_nonfinite_steps: int = 5
    """Stop with an error after this many consecutive steps with a non-finite loss or gradient
    norm (each such step is skipped, not applied). Checked at log steps (metrics.log_freq) and
    before each checkpoint, so the step loop never waits for the device on other steps."""


@dataclass
class OptimizerConfig:
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of the decay (and after it)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (never on biases or LayerNorm weights)."""
    implementation: Literal[OptimizerImpl, "auto"] = "auto"
    """AdamW kernel: "auto" (fused on CUDA, foreach elsewhere), "fused", "foreach" or "for-loop"."""
    state_dtype: OptimizerState = "fp32"
    """How AdamW keeps its two moments: "fp32" (torch.optim.AdamW, 8 bytes per trained
    parameter), "bf16" (train/bf16_adamw.py: bf16 moments written with stochastic rounding, 4
    bytes per parameter; the update itself in fp32) or "8bit" (torchao.optim.AdamW8bit:
    block-wise quantized moments, 1 byte per element each plus one fp32 scale per 256 elements,
    for tensors of at least 4096 elements whose size 256 divides; smaller ones stay fp32; about 2
    bytes per parameter). The weights stay fp32 master weights in every case. "8bit" needs torchao
    (pip install 'bloomnative[lowbit]'); "bf16" and "8bit" ignore `implementation`."""

    def kernel(self, device_type: str) -> OptimizerImpl:
        """The AdamW kernel `implementation` stands for on `device_type`: "auto" is the fused
        one on CUDA (no temporaries, and it skips a non-finite step on the device:
        train/nonfinite.py) and the foreach one elsewhere."""
        if self.implementation != "auto":
            return self.implementation
        return "fused" if device_type == "cuda" else "foreach"


@dataclass
class LRSchedulerConfig:
    """Megatron's schedule, counted in samples of applied (not skipped) steps. Give it in steps
    (warmup_steps, decay_steps: converted at training.global_batch_size samples per step) or in
    samples (warmup_samples, decay_samples), not both."""

    warmup_steps: int = 0
    """Linear warm-up from 0 to lr over this many steps."""
    decay_steps: int = 0
    """Steps (counted from step 0) at which the decay reaches min_lr; 0 means training.steps."""
    decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    """"cosine", "linear" or "constant" (stay at lr after warm-up)."""
    warmup_samples: int = 0
    """Warm up over this many samples (Megatron's --lr-warmup-samples): the sample-based
    schedule, the one that follows a batch-size rampup exactly."""
    decay_samples: int = 0
    """Samples at which the decay reaches min_lr (Megatron's --lr-decay-samples); required by
    the sample-based schedule."""


@dataclass
class DataConfig:
    blend: list[str] = field(default_factory=lambda: ["assets/pydocs/pydocs_text_document"])
    """Megatron-style blend: dataset prefixes, each optionally preceded by its weight, e.g.
    ["0.3", "data/a_text_document", "0.7", "data/b_text_document"]."""
    split: str = "969,30,1"
    """train,valid,test proportions of each dataset's documents."""
    format: Literal["gpt", "mtf"] = "gpt"
    """"gpt": pretraining, each prefix one dataset of documents laid end to end. "mtf":
    multitask fine-tuning as BLOOMZ was made (Megatron-DeepSpeed's finetune_t0.py): each prefix
    names the pair <prefix>_inputs_document + <prefix>_targets_document, whole pairs are packed
    into each sample and only target tokens count in the loss (docs/data.md)."""
    tokenizer: str = "assets/pydocs/tokenizer.json"
    """Path to a Hugging Face tokenizers tokenizer.json (its EOD token, sample output)."""
    eod_token: str = ""
    """The end-of-document token; empty: the tokenizer's, resolved as tools/preprocess_data.py
    resolves it (its --eod-token)."""
    eod_mask_loss: bool = False
    """No loss at positions whose input token is the EOD, i.e. on predicting the first token of
    the next document (Megatron's --eod-mask-loss)."""
    pad_token: int | str = ""
    """With format = "mtf": the token that fills a sample after its last pair. An integer is a
    token id (pad_token = 3, --data.pad_token=3: BLOOM's <pad>); a string is a token's text,
    looked up in data.tokenizer (pad_token = "<pad>"; on the command line text that is not an
    integer, or a TOML string in double quotes: --data.pad_token='"3"' is the token whose text
    is 3). An id must be one of data.tokenizer's and below model.vocab_size. Empty: the
    tokenizer's pad (its padding settings, else the first of <pad>, <|pad|>, [PAD], <|padding|>
    it has). Padding counts in no loss by its place (after the last pair), not by its id: a
    target token with the pad's id counts (docs/data.md). The dump folder's config.toml
    records the id used."""
    norm_target_loss: bool = False
    """With format = "mtf": every target sequence weighs the same in the loss, each of its
    tokens 1 / its length (Megatron-DeepSpeed's --norm-target-loss), instead of every token."""
    reset_attention_mask: bool = False
    """With format = "gpt": each document of a sample is attended to alone, the sample cut
    into segments after every EOD (data.eod_token; Megatron's --reset-attention-mask). ALiBi
    is relative, so positions need no reset. (Packed pairs always stay inside their pair.)"""
    cache_dir: str = ""
    """Where the sample-index arrays are cached; empty: <dump_folder>/data_cache."""
    prefetch: bool = True
    """Prepare the next batch in a background thread."""

    @property
    def segmented(self) -> bool:
        """Whether each sample's attention stays inside segments of it: packed pairs (format =
        "mtf") or documents cut at the EOD (reset_attention_mask)."""
        return self.format == "mtf" or self.reset_attention_mask


@dataclass
class ParallelismConfig:
    dp_replicate: int = 1
    """Data-parallel replicas (DDP-like; with dp_shard > 1 this is HSDP)."""
    dp_shard: int = -1
    """FSDP shard group size; -1 takes what is left of the world size."""
    cp: int = 1
    """Context-parallel degree: each sequence is split over this many ranks, which attend to
    each other's keys through ring attention (docs/parallelism.md). training.seq_len and
    validation.seq_len must be multiples of 2 * cp. FSDP shards over dp_shard x cp."""
    tp: int = 1
    """Tensor-parallel degree (whole heads per rank)."""
    pp: int = 1
    """Pipeline stages (over ranks)."""
    pp_schedule: PipelineSchedule = "1F1B"
    """GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble or ZBVZeroBubble."""
    pp_microbatches: int = 0
    """Micro batches per pipeline step; 0: the number of micro batches of the batch."""
    pp_stages_per_rank: int = 1
    """Virtual stages per pipeline rank (> 1 for interleaved schedules; 2 for ZBV)."""
    pp_layers_per_stage: list[int] = field(default_factory=list)
    """Explicit number of blocks per stage (overrides the automatic balance)."""
    pp_embedding_as_layer: bool = True
    """Count the embedding and the head as one layer each when balancing stages (as BLOOM did)."""
    sequence_parallel: bool = True
    """With tp > 1: shard LayerNorm/dropout regions along the sequence."""
    loss_parallel: bool = True
    """With tp > 1: keep the lm head output sharded over the vocabulary in the loss."""
    zero_stage: int = 3
    """3: reshard parameters after forward (ZeRO-3); 2: keep them gathered until backward
    (ZeRO-2). Optimizer state and gradients are always sharded."""
    cpu_offload: bool = False
    """Keep FSDP-sharded parameters, gradients and optimizer state in CPU memory."""


@dataclass
class CheckpointConfig:
    enable: bool = True
    """Save checkpoints (every `interval` steps and at the end) and resume from them."""
    folder: str = "checkpoints"
    """Sub-folder of the dump folder that holds step-<N>/ checkpoints."""
    interval: int = 100
    """Save every this many steps."""
    keep_latest_k: int = 2
    """Keep only the newest k complete checkpoints (0 keeps all)."""
    async_mode: Literal["disabled", "async"] = "disabled"
    """"disabled" or "async" (the step loop waits only for the device-to-host copy)."""
    load_step: int = -1
    """Step to resume from; -1: the newest checkpoint that verifies and holds this model (a
    folder whose checkpoints none can be loaded stops the run, exit 2); 0: step-0 if it exists
    (a model-only checkpoint), else start afresh, renaming the folder's checkpoints
    step-<N>.replaced. Every start with it set (torchrun's restarts too) goes back to it."""
    initial_hf: str = ""
    """Hugging Face BLOOM folder to start from when no checkpoint exists (continued
    pretraining)."""
    allow_data_change: bool = False
    """Resume even when training.seq_len, data.blend, data.split, data.tokenizer or data.format
    differ from the checkpoint's (refused otherwise: the data order after the resume would not
    continue the checkpoint's)."""
    min_free_gib: float = 1.0
    """Refuse to save (with an error) when the disk has less free space than the checkpoint
    plus this margin."""


@dataclass
class SpikesConfig:
    enable: bool = False
    """Recover from loss spikes automatically, as PaLM's authors did by hand: after
    `consecutive_steps` spike steps, restore the newest verified checkpoint from before the
    spike, skip the data that led to it and continue (docs/checkpointing.md). Off while
    checkpoint.enable = false (nothing to roll back to)."""
    loss_factor: float = 1.2
    """A step is a spike step if its loss exceeds this multiple of the mean loss of the last
    `window` healthy steps (0 disables the loss test)."""
    grad_norm_factor: float = 5.0
    """... or if its gradient norm (before clipping) exceeds this multiple of their median
    gradient norm (0 disables the gradient-norm test). Non-finite steps are spike steps too."""
    consecutive_steps: int = 3
    """Spike steps in a row that trigger a rollback."""
    window: int = 100
    """Healthy steps behind the running mean loss and median gradient norm; detection starts
    once this many have been seen."""
    skip_steps: int = 100
    """Global batches of data skipped beyond the step that triggered the rollback; all the data
    between the restored checkpoint and that step is skipped as well."""
    max_rollbacks: int = 5
    """Stop with an error at a spike once this many rollbacks have been made (over the whole
    run, restarts included)."""


@dataclass
class LoRAConfig:
    """Low-rank adapters (bloomnative.adapters): the base model is frozen and only the adapters
    train. Their names and initialisation are Hugging Face PEFT's, so an adapter trained here
    loads in PEFT (`tools/convert_hf.py to-peft`) and one PEFT wrote trains on here."""

    rank: int = 0
    """Rank r of each adapter; 0: no adapters (every weight trains)."""
    alpha: float = 16.0
    """Scale of the adapters' output is alpha / rank (PEFT's `lora_alpha`)."""
    dropout: float = 0.0
    """Dropout on each adapter's input (PEFT's `lora_dropout`); 0 under tensor parallelism."""
    target_modules: list[LoRATarget] = field(default_factory=lambda: ["query_key_value"])
    """The linear layers of every block that get an adapter, by their Hugging Face names:
    query_key_value, dense, dense_h_to_4h, dense_4h_to_h (PEFT's default for BLOOM: QKV)."""
    init_adapter: str = ""
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) to start the
    adapters from at a fresh start, instead of PEFT's initialisation; its rank, targets and
    alpha / rank must be these."""
    quantize_base: QuantizeBase = "none"
    """"none": the frozen base in the run's dtype; "nf4": in 4-bit NormalFloat (QLoRA)."""


@dataclass
class ActivationCheckpointConfig:
    mode: Literal[RecomputeMode, "auto"] = "none"
    """"none", "full" (recompute every block), "selective" (every `every`-th block) or "auto"
    (the least recomputation that the memory planner predicts fits the device)."""
    every: int = 2
    """With mode = "selective": recompute one block out of this many."""
    memory_budget_gib: float = 0.0
    """With mode = "auto": the memory per device to plan against; 0 takes the smallest CUDA
    device's total memory (on CPU, 0 makes "auto" mean "none")."""
    offload: bool = False
    """Keep the tensors each block saves for its backward in host memory (pinned, copied on a
    side CUDA stream during the forward) instead of on the device, for the blocks that are not
    recomputed; parameters, recomputed blocks' inputs, the embedding, head and loss stay
    (parallel/activation_offload.py). Costs host memory and PCIe traffic, not compute. Not with
    mode = "full" (nothing left to offload) or compile.enable."""


@dataclass
class QuantizeConfig:
    linear: QuantizeLinear = "none"
    """"none": the block linears compute in the run's dtype; "float8_rowwise" or
    "float8_tensorwise": the four linears of each block (QKV, attention output, both MLP
    matmuls) compute in FP8 through torchao's float8 training recipe of that name ("rowwise":
    one scale per row, "tensorwise": one per tensor), their weights stored in the run's dtype
    (parallel/float8.py). The embedding, the tied head and the loss stay in the run's dtype.
    Needs an sm_89+ CUDA GPU, or `emulate`."""
    emulate: bool = False
    """With linear = "float8_*": torchao's emulation of the FP8 matmul (quantised operands,
    dequantised and multiplied in fp32) on any device: the numerics of FP8, not its speed (CPU
    tests, GPUs below sm_89)."""
    fsdp_float8_all_gather: bool = False
    """With linear = "float8_tensorwise": FSDP2 casts each block linear's weight shard to FP8
    before its all-gather and gathers one byte per element instead of the run's dtype (torchao's
    `enable_fsdp_float8_all_gather`; its scales, one per weight, are computed for all weights in
    one all-reduce before each step). Needs FSDP2 (data parallelism, or bf16). Checkpoints still
    hold the weights in the run's dtype. Not with the rowwise recipe, whose weight scales differ
    between the forward's and the backward's casts."""


@dataclass
class CompileConfig:
    enable: bool = False
    """torch.compile each block (regional compilation), and the loss unless model.fused_loss
    or tp > 1."""


@dataclass
class MetricsConfig:
    log_freq: int = 10
    """Log every this many steps (and the first and last step)."""
    tensorboard: bool = True
    """Write TensorBoard event files to <dump_folder>/tb."""
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s of one device for MFU; 0: look the device up (null MFU on CPU)."""
    wandb: bool = False
    """Also log the scalars TensorBoard gets, and the resolved config, to Weights & Biases (the
    optional extra: pip install 'bloomnative[wandb]'). One dump folder is one W&B run, continued
    after a restart (its id is kept in <dump_folder>/wandb_run_id); with WANDB_MODE=offline it is
    written under <dump_folder>/wandb/ for a later `wandb sync`."""
    wandb_project: str = "bloomnative"
    """W&B project of the run."""
    wandb_entity: str = ""
    """W&B entity (user or team) of the run; empty: the account's default entity."""
    wandb_run_name: str = ""
    """Display name of the W&B run; empty: job.name."""
    wandb_tags: list[str] = field(default_factory=list)
    """Tags of the W&B run."""


@dataclass
class ValidationConfig:
    freq: int = 0
    """Evaluate every this many steps (0 disables)."""
    steps: int = 4
    """Batches of the validation split per evaluation."""
    seq_len: int = 0
    """If > 0, also evaluate at this (longer) sequence length: ALiBi's extrapolation."""
    sample_tokens: int = 0
    """If > 0, rank 0 prints a sample of up to this many tokens from the final checkpoint when
    training ends (as tools/generate.py would, temperature 0.8, top-k 40, seeded by job.seed)."""
    sample_prompt: str = ""
    """The text the end-of-training sample continues (empty: a new document). A run with
    data.format = "mtf" continues the first input of its training split instead."""


@dataclass
class ProfilingConfig:
    enable: bool = False
    """Record a torch.profiler trace per rank of the steps below, written as Chrome trace JSON
    under <dump_folder>/profile/ (Perfetto, TensorBoard). On CUDA the run also records the
    allocator's history and dumps a memory snapshot after those steps and on out-of-memory."""
    start_step: int = 5
    """First profiled step (1-based); the step before it warms the profiler up."""
    steps: int = 3
    """Number of profiled steps."""


@dataclass
class DownstreamConfig:
    tasks: list[str] = field(default_factory=list)
    """lm-evaluation-harness tasks, groups or tags to score checkpoints on during training: the
    harness's registry (tasks on the Hugging Face Hub need the network) or `include_path`'s
    (docs/evaluation.md). Preflight checks that each one resolves."""
    freq: int = 0
    """Score the checkpoint saved every this many steps, a multiple of checkpoint.interval (0:
    never). Rank 0 starts a separate process on it (one at a time) and training goes on."""
    include_path: str = ""
    """A folder of task YAMLs (local tasks, e.g. reading JSONL files), as tools/evaluate.py's
    --include-path; empty: the harness's registry only."""
    limit: int | None = None
    """Score the first `limit` items of each task (at least 1); unset: every item."""
    num_fewshot: int | None = None
    """Examples in each prompt; unset: each task's own default."""
    batch_size: int = 8
    """Sequences per forward of the evaluation."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the evaluation process runs: "cpu" takes no device memory from training (and
    shares the CPU cores with it), "cuda" holds a second copy of the model on the first visible
    GPU (rank 0's on one node), beside training's."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The evaluation's dtype: "bfloat16" halves the copy's memory."""
    wait_s: int = 600
    """At the end of training, wait at most this many seconds for the evaluations still running
    or queued (their rows then land in metrics.jsonl); an evaluation left then is stopped."""


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    spikes: SpikesConfig = field(default_factory=SpikesConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(
        default_factory=ActivationCheckpointConfig
    )
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    downstream: DownstreamConfig = field(default_factory=DownstreamConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """The whole configuration as TOML that `load_toml` reads back into an equal Config.
        A key whose value is None is left out: TOML has no null, and None is its default."""
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]
            lines.append("")
        return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return _toml_string(value)
    return json.dumps(value)  # bool, int and float are spelled alike in JSON and TOML


def _toml_string(text: str) -> str:
    """A TOML basic string of ASCII characters only, so the file reads back the same whatever
    encoding it was written in: every character outside printable ASCII is a \\u or \\U escape
    of its code point (JSON's surrogate pairs for characters beyond U+FFFF are not valid TOML)."""
    out = []
    for char in text:
        code = ord(char)
        if char in '"\\':
            out.append("\\" + char)
        elif 0x20 <= code < 0x7F:
            out.append(char)
        else:
            out.append(f"\\u{code:04X}" if code <= 0xFFFF else f"\\U{code:08X}")
    return '"' + "".join(out) + '"'


def model_args_from_config(cfg: ModelConfig) -> BloomArgs:
    """The preset's shape with the non-zero overrides of the [model] section applied.

    ``attention = "auto"`` is described with the backend it stands for before anything is timed
    (`attention_for_planning`); train/resolved.py's `resolve_run` replaces it by what "auto"
    stands for on the run."""
    from bloomnative.model.args import BloomArgs

    overrides = {k: getattr(cfg, k) for k in BloomArgs.SHAPE_FIELDS}
    overrides = {k: v for k, v in overrides.items() if v}
    return BloomArgs.from_preset(
        cfg.preset,
        attention=attention_for_planning(cfg.attention),
        fused_kernels=cfg.fused_kernels,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        **overrides,
    )


# ---------------------------------------------------------------- loading and overriding


def _nearest(name: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    hint = f"did you mean {match[0]!r}? " if match else ""
    return f"{hint}valid: {', '.join(sorted(valid))}"


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(key: str, value: Any, tp: Any, from_cli: bool) -> Any:
    """Checks (TOML) or converts (CLI strings) `value` to the field type `tp`."""
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        (item_tp,) = typing.get_args(tp)[:1]
        if from_cli and isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    value = ast.literal_eval(text)
                except (ValueError, SyntaxError) as e:
                    raise ConfigError(f"{key}: cannot parse {value!r} as a list ({e})") from None
            else:
                value = [v.strip() for v in text.split(",") if v.strip()]
        elif isinstance(value, str) and item_tp is str:
            value = [value]  # a single blend prefix may be given as a string
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list of {_type_name(item_tp)}, got {value!r}")
        return [_coerce(f"{key}[{i}]", v, item_tp, from_cli) for i, v in enumerate(value)]
    if tp is bool:
        if from_cli and isinstance(value, str):
            low = value.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp == int | None:  # unset is the default: TOML has no null
        return _coerce(key, value, int, from_cli)
    if tp is int:
        if from_cli and isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if from_cli and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp == int | str:
        return _id_or_text(key, value, from_cli)
    if tp is str or origin is Literal:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # bytes of a command line that are not UTF-8
            raise ConfigError(f"{key}: {value!r} is not valid UTF-8 text") from None
        return value  # a Literal's choices are checked by validate, also for configs in code
    raise AssertionError(f"{key}: unsupported field type {tp}")


def _id_or_text(key: str, value: Any, from_cli: bool) -> int | str:
    """A token given by its id (a TOML integer) or its text (a TOML string). On the command line
    an integer is an id, text in double quotes a TOML string (so '"3"' is the text 3), and any
    other text is the text itself."""
    if from_cli and isinstance(value, str):
        if _INTEGER.fullmatch(value):
            return int(value)
        if len(value) >= 2 and value[0] == value[-1] == '"' and "\n" not in value:
            try:
                value = tomllib.loads(f"text = {value}")["text"]
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"{key}: {value} is not a TOML string ({e})") from None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # bytes of a command line that are not UTF-8
            raise ConfigError(f"{key}: {value!r} is not valid UTF-8 text") from None
        return value
    raise ConfigError(
        f"{key}: expected a token id (an integer) or a token's text (a string), got {value!r}"
    )


_INTEGER = re.compile(r"[+-]?[0-9]+")


def _set(config: Config, section: str, key: str, value: Any, from_cli: bool, where: str) -> None:
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if section not in sections:
        raise ConfigError(
            f"{where}: unknown section [{section}]; {_nearest(section, list(sections))}"
        )
    obj = getattr(config, section)
    types_ = _field_types(type(obj))
    if key not in types_:
        names = [f"{section}.{k}" for k in types_]
        raise ConfigError(
            f"{where}: unknown key '{section}.{key}'; {_nearest(f'{section}.{key}', names)}"
        )
    try:
        setattr(obj, key, _coerce(f"{section}.{key}", value, types_[key], from_cli))
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def load_toml(config: Config, path: str | Path) -> None:
    """Applies a TOML file to `config`."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; give the path of a .toml file")
    if not path.is_file():
        where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
        raise ConfigError(f"config file {path} does not exist{where}")
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); TOML "
            "files are UTF-8"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    for section, values in data.items():
        if not isinstance(values, dict):
            sections = [f.name for f in dataclasses.fields(Config)]
            raise ConfigError(
                f"{path}: top-level key {section!r} must be a [section]; "
                f"{_nearest(section, sections)}"
            )
        for key, value in values.items():
            _set(config, section, key, value, from_cli=False, where=str(path))


def parse_args(argv: list[str]) -> Config:
    """`--config FILE` (default configs/debug.toml) then `--section.key=value` overrides (also
    `--section.key value`), applied in order."""
    config_path: str | None = None
    overrides: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(
                f"unexpected argument {arg!r}; use --config FILE or --section.key=value"
            )
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError(f"{arg} needs a value: {arg}=VALUE")
            value = argv[i + 1]
            i += 1
        i += 1
        if name == "config":
            config_path = value
        else:
            overrides.append((name, value))
    config = Config()
    load_toml(config, config_path or DEFAULT_CONFIG)
    for name, value in overrides:
        section, dot, key = name.partition(".")
        if not dot:
            raise ConfigError(
                f"--{name}: overrides are --section.key=value (e.g. --training.steps=10)"
            )
        _set(config, section, key, value, from_cli=True, where="command line")
    validate(config)
    return config


# ---------------------------------------------------------------- validation


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _one_of(key: str, value: str, valid: tuple[str, ...]) -> None:
    _check(value in valid, f"{key} = {value!r} is not valid; choose one of {', '.join(valid)}")


def _check_choices(config: Config) -> None:
    """Every Literal-typed field holds one of its type's values."""
    for section in dataclasses.fields(Config):
        values = getattr(config, section.name)
        for name, tp in _field_types(type(values)).items():
            if typing.get_origin(tp) is Literal:
                _one_of(f"{section.name}.{name}", getattr(values, name), typing.get_args(tp))


def _check_finite(config: Config) -> None:
    """Every float field holds a number: NaN and infinity mean nothing in any of them."""
    for section in dataclasses.fields(Config):
        values = getattr(config, section.name)
        for name, tp in _field_types(type(values)).items():
            value = getattr(values, name)
            if tp is float and not math.isfinite(value):
                raise ConfigError(f"{section.name}.{name} = {value}: must be a finite number")


# Seeds feed numpy's RandomState (the data order), which takes 32-bit unsigned seeds.
_MAX_SEED = 2**32 - 1


def validate(config: Config) -> None:
    """Checks that do not need the world size; `parallel.ParallelDims` checks the layout."""
    from bloomnative.model.args import PRESETS, BloomArgs

    m, t, o, s = config.model, config.training, config.optimizer, config.lr_scheduler
    _one_of("model.preset", m.preset, tuple(PRESETS))
    _check_choices(config)
    _check_finite(config)
    _check(
        0 <= config.job.seed <= _MAX_SEED,
        f"job.seed = {config.job.seed}: must be in [0, {_MAX_SEED}]",
    )
    _check(
        config.job.collective_timeout_s > 0,
        f"job.collective_timeout_s must be positive, got {config.job.collective_timeout_s}",
    )
    for key in BloomArgs.SHAPE_FIELDS:
        _check(getattr(m, key) >= 0, f"model.{key} must be >= 0 (0 keeps the preset)")
    _validate_dropout(config)
    _validate_lora(config)
    for key in ("steps", "seq_len", "global_batch_size", "micro_batch_size"):
        _check(getattr(t, key) > 0, f"training.{key} must be positive, got {getattr(t, key)}")
    _check(
        t.global_batch_size % t.micro_batch_size == 0,
        f"training.global_batch_size = {t.global_batch_size} is not divisible by "
        f"training.micro_batch_size = {t.micro_batch_size}",
    )
    if t.rampup_batch_size:
        _check(
            len(t.rampup_batch_size) == 3,
            f"training.rampup_batch_size must be [start, increment, samples], "
            f"got {t.rampup_batch_size}",
        )
        start, inc, samples = t.rampup_batch_size
        _check(
            start > 0 and inc > 0 and samples > 0,
            f"training.rampup_batch_size values must be positive, got {t.rampup_batch_size}",
        )
        _check(
            (t.global_batch_size - start) % inc == 0 and start <= t.global_batch_size,
            f"training.rampup_batch_size: global_batch_size {t.global_batch_size} - start "
            f"{start} must be a non-negative multiple of increment {inc}",
        )
        _check(
            start % t.micro_batch_size == 0 and inc % t.micro_batch_size == 0,
            f"training.rampup_batch_size: start {start} and increment {inc} must be "
            f"multiples of training.micro_batch_size {t.micro_batch_size}",
        )
    _check(t.max_norm >= 0, "training.max_norm must be >= 0")
    _check(
        t.max_nonfinite_steps > 0,
        f"training.max_nonfinite_steps must be positive, got {t.max_nonfinite_steps}",
    )
    _check(
        0 < o.lr and 0 <= o.min_lr <= o.lr,
        f"optimizer: need 0 < lr and 0 <= min_lr <= lr (lr={o.lr}, min_lr={o.min_lr})",
    )
    _check(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optimizer.beta1 and beta2 must be in [0, 1)")
    _check(o.eps > 0, f"optimizer.eps must be positive, got {o.eps}")
    _check(o.weight_decay >= 0, f"optimizer.weight_decay must be >= 0, got {o.weight_decay}")
    _validate_lr_schedule(s)
    _check(len(config.data.blend) > 0, "data.blend is empty: give at least one dataset prefix")
    _validate_data_format(config.data)
    _check(config.metrics.log_freq > 0, "metrics.log_freq must be positive")
    _check(
        bool(config.metrics.wandb_project.strip()),
        'metrics.wandb_project is empty: name the W&B project (default "bloomnative")',
    )
    _check(
        config.activation_checkpoint.memory_budget_gib >= 0,
        "activation_checkpoint.memory_budget_gib must be >= 0 (0: the device's total memory)",
    )
    _validate_checkpoint(config.checkpoint)
    ac = config.activation_checkpoint
    _check(ac.every > 0, f"activation_checkpoint.every must be positive, got {ac.every}")
    _validate_offload(ac, config.compile)
    _check(
        config.metrics.peak_tflops >= 0,
        f"metrics.peak_tflops must be >= 0 (0: look the device up), got "
        f"{config.metrics.peak_tflops}",
    )
    _validate_spikes(config.spikes, config.checkpoint)
    _check(
        config.validation.freq >= 0 and config.validation.steps > 0,
        "validation.freq must be >= 0 and validation.steps positive",
    )
    _check(config.validation.sample_tokens >= 0, "validation.sample_tokens must be >= 0")
    _check(
        config.validation.seq_len >= 0,
        f"validation.seq_len must be >= 0 (0: no second length), got {config.validation.seq_len}",
    )
    _validate_downstream(config.downstream, config.checkpoint)
    _validate_quantize(config)
    prof = config.profiling
    _check(
        prof.start_step >= 1 and prof.steps >= 1,
        f"profiling.start_step (1-based) and profiling.steps must be positive, got "
        f"{prof.start_step} and {prof.steps}",
    )
    _check(
        not prof.enable or prof.start_step <= t.steps,
        f"profiling.start_step = {prof.start_step} is after the last step (training.steps = "
        f"{t.steps}): nothing would be profiled",
    )


def _validate_checkpoint(c: CheckpointConfig) -> None:
    _check(c.interval > 0, "checkpoint.interval must be positive")
    _check(c.keep_latest_k >= 0, f"checkpoint.keep_latest_k must be >= 0, got {c.keep_latest_k}")
    _check(
        c.load_step >= -1,
        f"checkpoint.load_step must be a step >= 0, or -1 for the newest, got {c.load_step}",
    )
    _check(c.min_free_gib >= 0, f"checkpoint.min_free_gib must be >= 0, got {c.min_free_gib}")


def _validate_downstream(d: DownstreamConfig, c: CheckpointConfig) -> None:
    """The values of [downstream]; which tasks exist is preflight's check (it needs the harness's
    task index)."""
    _check(d.freq >= 0, f"downstream.freq must be >= 0 (0: never), got {d.freq}")
    _check(d.limit is None or d.limit >= 1, f"downstream.limit must be >= 1, got {d.limit}")
    _check(
        d.num_fewshot is None or d.num_fewshot >= 0,
        f"downstream.num_fewshot must be >= 0, got {d.num_fewshot}",
    )
    _check(d.batch_size >= 1, f"downstream.batch_size must be >= 1, got {d.batch_size}")
    _check(d.wait_s >= 0, f"downstream.wait_s must be >= 0, got {d.wait_s}")
    if not d.freq:
        return
    _check(bool(d.tasks), "downstream.freq is set but downstream.tasks is empty: name the tasks")
    _check(
        c.enable,
        "downstream.freq scores saved checkpoints, but checkpoint.enable = false saves none",
    )
    _check(
        d.freq % c.interval == 0,
        f"downstream.freq = {d.freq} must be a multiple of checkpoint.interval = {c.interval}: "
        "it scores the checkpoint saved at that step",
    )


def _validate_offload(ac: ActivationCheckpointConfig, compile_cfg: CompileConfig) -> None:
    if not ac.offload:
        return
    _check(
        ac.mode != "full",
        'activation_checkpoint.offload = true with mode = "full": every block is recomputed, '
        'so no block saves activations to offload; set mode = "none", "selective" or "auto"',
    )
    _check(
        not compile_cfg.enable,
        "activation_checkpoint.offload = true with compile.enable = true: the offload's "
        "saved-tensor hooks run around each block, which a compiled block cannot hold; turn "
        "one of them off",
    )


def _validate_data_format(data: DataConfig) -> None:
    if data.format == "mtf":
        _check(
            not data.reset_attention_mask,
            'data.reset_attention_mask applies to format = "gpt"; packed pairs (format = '
            '"mtf") are always attended to one pair at a time: leave it unset',
        )
        return
    for key, value in (("norm_target_loss", data.norm_target_loss), ("pad_token", data.pad_token)):
        _check(
            value is False or value == "",  # pad_token = 0 is an id: set
            f'data.{key} = {value!r} applies only to packed pairs; set data.format = "mtf" '
            f"or leave data.{key} unset",
        )


def _validate_dropout(config: Config) -> None:
    from bloomnative.model.args import BloomArgs

    m, par = config.model, config.parallelism
    try:  # the model's own checks: probabilities in [0, 1), a backend that has dropout
        BloomArgs(
            # "auto" never resolves to a backend without dropout when there is dropout
            attention=attention_for_planning(m.attention),
            hidden_dropout=m.hidden_dropout,
            attention_dropout=m.attention_dropout,
        )
    except ValueError as e:
        raise ConfigError(f"model.{e}") from None
    _check(
        not (
            m.attention_dropout
            and par.tp > 1
            and not par.sequence_parallel
            and config.compile.enable
        ),
        "model.attention_dropout > 0 with parallelism.tp > 1 and sequence_parallel = false forks "
        "a per-rank random stream around each attention call, which compile.enable (fullgraph) "
        "cannot trace; set parallelism.sequence_parallel = true or compile.enable = false",
    )


def _validate_quantize(config: Config) -> None:
    linear = config.quantize.linear
    _check(
        linear == "float8_tensorwise" or not config.quantize.fsdp_float8_all_gather,
        f'quantize.fsdp_float8_all_gather = true with quantize.linear = "{linear}": torchao '
        "gathers FP8 weights only with one scale per weight; set quantize.linear = "
        '"float8_tensorwise" or quantize.fsdp_float8_all_gather = false',
    )
    if linear == "none":
        return
    # torchao's FP8 cast scales a weight by its amax, which its NF4 tensor does not compute;
    # dequantising NF4 to cast it again would round the base twice, for no memory saved.
    _check(
        config.lora.quantize_base == "none",
        f'quantize.linear = "{linear}" with lora.quantize_base = '
        f'"{config.lora.quantize_base}": an NF4 base cannot be cast to FP8 (torchao scales a '
        "weight by its amax, which its NF4 tensor does not compute); set "
        'lora.quantize_base = "none" (LoRA on an FP8-computed base) or quantize.linear = "none"',
    )


def _validate_lora(config: Config) -> None:
    lora, par = config.lora, config.parallelism
    _check(lora.rank >= 0, f"lora.rank must be >= 0 (0: no adapters), got {lora.rank}")
    if lora.rank == 0:
        _check(
            not lora.init_adapter and lora.quantize_base == "none",
            "lora.init_adapter and lora.quantize_base need adapters: set lora.rank >= 1",
        )
        return
    _check(lora.alpha > 0, f"lora.alpha must be positive, got {lora.alpha}")
    _check(0 <= lora.dropout < 1, f"lora.dropout must be in [0, 1), got {lora.dropout}")
    targets = typing.get_args(LoRATarget)
    _check(bool(lora.target_modules), f"lora.target_modules is empty: choose from {targets}")
    for target in lora.target_modules:
        _check(
            target in targets,
            f"lora.target_modules: unknown module {target!r}; BLOOM's linear layers are "
            f"{', '.join(targets)}",
        )
    _check(
        len(set(lora.target_modules)) == len(lora.target_modules),
        f"lora.target_modules lists a module twice: {lora.target_modules}",
    )
    # Under tensor parallelism an adapter's input is whole on every tp rank beside a
    # column-parallel layer (where a mask must be the same on each) and sharded over them beside a
    # row-parallel one (where it must differ), in streams that parallel/dropout_rng.py shares or
    # splits for the whole rank, not per layer.
    _check(
        lora.dropout == 0 or par.tp == 1,
        f"lora.dropout = {lora.dropout} with parallelism.tp = {par.tp}: adapter dropout trains "
        "without tensor parallelism only; set lora.dropout = 0 or parallelism.tp = 1",
    )


def _validate_lr_schedule(s: LRSchedulerConfig) -> None:
    for key in ("warmup_steps", "decay_steps", "warmup_samples", "decay_samples"):
        _check(getattr(s, key) >= 0, f"lr_scheduler.{key} must be >= 0, got {getattr(s, key)}")
    if s.warmup_samples or s.decay_samples:
        _check(
            not (s.warmup_steps or s.decay_steps),
            f"lr_scheduler: warmup_steps = {s.warmup_steps} / decay_steps = {s.decay_steps} "
            f"cannot be combined with warmup_samples = {s.warmup_samples} / decay_samples = "
            f"{s.decay_samples}; give the schedule in steps or in samples (set the others to 0)",
        )
        _check(
            s.decay_samples > 0,
            "lr_scheduler.warmup_samples needs lr_scheduler.decay_samples (the sample at which "
            "the decay reaches min_lr)",
        )
        _check(
            s.warmup_samples < s.decay_samples,
            f"lr_scheduler.warmup_samples = {s.warmup_samples} must be smaller than "
            f"decay_samples = {s.decay_samples}",
        )
    elif s.decay_steps:
        # decay_steps = 0 (decay over the run) is not checked: a run shortened below its
        # warm-up (--training.steps=3) just ends during the warm-up.
        _check(
            s.warmup_steps < s.decay_steps,
            f"lr_scheduler.warmup_steps = {s.warmup_steps} must be smaller than decay_steps = "
            f"{s.decay_steps}",
        )


def _validate_spikes(spikes: SpikesConfig, checkpoint: CheckpointConfig) -> None:
    if not (spikes.enable and checkpoint.enable):
        return
    _check(
        checkpoint.keep_latest_k != 1,
        "spikes.enable = true needs checkpoint.keep_latest_k = 0 or >= 2: a checkpoint saved "
        "during a spike must not rotate away the one from before it",
    )
    for key in ("loss_factor", "grad_norm_factor"):
        value = getattr(spikes, key)
        _check(value == 0 or value > 1, f"spikes.{key} must be > 1 (or 0 to disable), got {value}")
    _check(
        spikes.loss_factor > 0 or spikes.grad_norm_factor > 0,
        "spikes: loss_factor and grad_norm_factor are both 0, so nothing can detect a spike",
    )
    for key in ("consecutive_steps", "window"):
        _check(
            getattr(spikes, key) > 0, f"spikes.{key} must be positive, got {getattr(spikes, key)}"
        )
    for key in ("skip_steps", "max_rollbacks"):
        _check(getattr(spikes, key) >= 0, f"spikes.{key} must be >= 0, got {getattr(spikes, key)}")
