"""The one "run the Triton kernel or the torch reference?" decision, and what kernels share.

Dispatch rule, used by every public op in this package:

* a tensor on a CUDA (or ROCm) device runs the Triton kernel;
* a CPU tensor runs the Triton kernel only when ``TRITON_INTERPRET=1`` was set before
  ``bloomnative.kernels`` (and so Triton) was imported: Triton's interpreter then executes the
  kernel with numpy, which is how the tests exercise the kernels on machines without a GPU;
* everything else (CPU without the interpreter, MPS, Triton not installed, or
  ``BLOOMNATIVE_KERNELS=torch`` in the environment) runs the pure-torch reference that sits beside
  each kernel, so model code can call the ops unconditionally.

The environment is read once, at import, because Triton itself decides at decoration time whether
``@triton.jit`` builds a compiled or an interpreted kernel.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs without the `dev` extra: the torch references still work.
    HAS_TRITON = False

    def _identity_decorator(fn: Callable | None = None, **kwargs: Any) -> Any:
        return fn if fn is not None else (lambda f: f)

    # Just enough of the module for the kernel files to be imported: decorators keep the plain
    # Python function and configs are inert (dispatch never picks Triton without it).
    triton = SimpleNamespace(  # type: ignore[assignment]
        jit=_identity_decorator,
        autotune=lambda *args, **kwargs: _identity_decorator,
        Config=lambda *args, **kwargs: None,
        cdiv=lambda a, b: -(-a // b),
        next_power_of_2=lambda n: 1 << max(int(n) - 1, 0).bit_length(),
    )
    tl = SimpleNamespace(constexpr=object)  # type: ignore[assignment]

INTERPRET: bool = HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0") == "1"
"""True when Triton kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)."""


def _make_interpreter_match_gpu() -> None:
    """Make Triton's interpreter run the kernels as the GPU does where it falls short.

    * bf16: the interpreter stores bf16 as raw uint16 words (numpy has no bf16) and gets two
      things wrong with them: ``tl.dot`` hands the words straight to ``np.matmul`` (multiplying
      bit patterns as integers), and fp32 -> bf16 casts truncate instead of rounding to nearest
      even as the GPU's ``cvt.rn.bf16.f32`` does. Widen dot operands to fp32 (exact: a bf16 is
      the top half of an fp32; the tensor cores likewise accumulate bf16 products in fp32) and
      round casts to nearest even. Only bf16 is touched.
    * TMA reductions: ``desc.atomic_add`` (``tt.descriptor_reduce``, what sm_90 does with
      ``cp.reduce.async.bulk``) is missing. Emulate it as the hardware defines it: an atomic add
      of every element of the box, elements outside the tensor skipped. The attention backward's
      dQ accumulation then runs the same code under the interpreter as on an H100.
    """
    import numpy as np
    from triton.runtime import interpreter

    builder_cls = interpreter.InterpreterBuilder
    if getattr(builder_cls, "_bloomnative_matches_gpu", False):
        return
    original_create_dot = builder_cls.create_dot
    original_cast_impl = builder_cls.cast_impl
    ir = interpreter._ir

    def widen(handle: Any) -> Any:
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        words = np.asarray(handle.data).astype(np.uint32) << 16
        return interpreter.TensorHandle(words.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, *precision_args):  # type: ignore[no-untyped-def]
        return original_create_dot(self, widen(a), widen(b), d, *precision_args)

    def cast_impl(self, src, dst_type):  # type: ignore[no-untyped-def]
        if not (src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16):
            return original_cast_impl(self, src, dst_type)
        values = np.asarray(src.data, dtype=np.float32)
        bits = values.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round half to even
        quiet_nan = ((bits >> 16) & 0x8000) | 0x7FC0
        words = np.where(np.isnan(values), quiet_nan, rounded).astype(np.uint16)
        return interpreter.TensorHandle(words, tl.bfloat16)

    def create_descriptor_reduce(self, kind, desc, value, indices):  # type: ignore[no-untyped-def]
        if kind != ir.DESCRIPTOR_REDUCE_KIND.ADD:
            raise NotImplementedError(f"bloomnative emulates only TMA add reductions, not {kind}")
        ptrs, in_bounds = desc.materialize_pointers(indices)
        op = ir.ATOMIC_OP.FADD if value.dtype.scalar.is_floating() else ir.ATOMIC_OP.ADD
        self.create_atomic_rmw(
            op, ptrs, value, in_bounds, ir.MEM_SEMANTIC.RELAXED, ir.MEM_SYNC_SCOPE.GPU
        )

    builder_cls.create_dot = create_dot
    builder_cls.cast_impl = cast_impl
    builder_cls.create_descriptor_reduce = create_descriptor_reduce
    builder_cls._bloomnative_matches_gpu = True


if INTERPRET:
    _make_interpreter_match_gpu()

_KERNELS_ENV = os.environ.get("BLOOMNATIVE_KERNELS", "auto").strip().lower()
if _KERNELS_ENV not in ("auto", "torch"):
    raise ValueError(
        f"BLOOMNATIVE_KERNELS={_KERNELS_ENV!r} is not valid: use 'auto' (Triton on CUDA tensors, "
        "the torch reference elsewhere) or 'torch' (always the torch reference)"
    )
FORCE_REFERENCE: bool = _KERNELS_ENV == "torch"
"""True when ``BLOOMNATIVE_KERNELS=torch``: every op runs its pure-torch reference."""


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether an op whose main input is ``tensor`` runs its Triton kernel (module docstring)."""
    if FORCE_REFERENCE or not HAS_TRITON:
        return False
    return tensor.is_cuda or (INTERPRET and tensor.device.type == "cpu")


def kernel_op(name: str, mutates_args: Sequence[str] = ()) -> Callable[[Callable], Any]:
    """Register a function that launches Triton kernels as the torch.library op ``name``.

    With a real Triton backend this is ``torch.library.triton_op``: torch.compile traces through
    the op into its kernels (launched with ``wrap_triton``), so Inductor schedules them itself.
    Under the interpreter (or without Triton) it is ``torch.library.custom_op``: interpreted
    kernels cannot be captured by ``wrap_triton``, so the op stays opaque to the compiler and
    runs eagerly inside a compiled graph. Either way the caller registers an explicit fake
    (shape-only) implementation and the autograd formula.
    """
    if HAS_TRITON and not INTERPRET:
        return torch.library.triton_op(name, mutates_args=tuple(mutates_args))
    return torch.library.custom_op(name, mutates_args=tuple(mutates_args))


def launch(kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> None:
    """Launch ``kernel[grid](*args, **kwargs)``, through ``wrap_triton`` on a GPU so that
    torch.compile can capture it inside a ``triton_op``. Interpreted kernels are launched
    directly: their ops are opaque ``custom_op``s, and ``wrap_triton`` accepts only compiled
    kernels in some torch/Triton pairs (torch 2.11 with Triton 3.6)."""
    if INTERPRET:
        kernel[grid](*args, **kwargs)
    else:
        torch.library.wrap_triton(kernel)[grid](*args, **kwargs)


class _ProcessWideAllocator:
    """Stands in for the ContextVar in which Triton keeps its scratch allocator.

    Kernels that build TMA descriptors on the device need a little global scratch per program,
    which Triton's launcher requests from ``triton.set_allocator``'s allocator. Triton keeps that
    allocator in a ContextVar, and a thread starts with its own empty context: torch's autograd
    engine runs backward passes on its own threads, so a kernel launched there (always the case
    for a compiled backward, whose launches never pass through code of ours) finds no allocator
    and fails. This holder has the ContextVar's ``get``/``set`` but one value for the whole
    process, so ``triton.set_allocator`` keeps working for every thread.
    """

    def __init__(self, allocator: Callable[..., Any]) -> None:
        self._allocator = allocator

    def get(self) -> Callable[..., Any]:
        return self._allocator

    def set(self, allocator: Callable[..., Any]) -> None:
        self._allocator = allocator


def _cuda_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def install_tma_allocator() -> None:
    """Give Triton a scratch allocator that every thread sees (``_ProcessWideAllocator``):
    CUDA memory from torch's caching allocator. Idempotent; an allocator set before with
    ``triton.set_allocator`` in this thread is kept. Called by ops whose kernels build TMA
    descriptors, eagerly and while torch.compile traces them (before compiled code runs)."""
    from triton.runtime import _allocation

    holder = _allocation._allocator
    if isinstance(holder, _ProcessWideAllocator):
        return
    current = holder.get()
    keep = current if not isinstance(current, _allocation.NullAllocator) else _cuda_scratch
    _allocation._allocator = _ProcessWideAllocator(keep)


@triton.jit
def declare_written(ptr):
    """Name ``ptr`` as written by the calling kernel to torch.compile, for writes its analysis
    cannot see.

    torch.compile learns what a user kernel writes from the ``tt.store`` and ``tt.atomic_*`` ops
    of its Triton IR; it does not know TMA reductions (``tt.descriptor_reduce``). A kernel that
    writes a tensor only through them would look read-only, and compiled code could then read the
    tensor before the kernel ran. This store is never executed (a program id is never negative)
    but it is in the IR, so the analysis sees the write."""
    if tl.program_id(0) < 0:
        tl.store(ptr, tl.load(ptr))


def autotune(
    configs: list[Any],
    interpreter_config: Any,
    key: list[str],
    reset_to_zero: list[str] | None = None,
) -> Callable[[Callable], Any]:
    """``triton.autotune`` over ``configs`` on a GPU; the one small ``interpreter_config`` under
    the interpreter (an autotuner with a single config launches it without benchmarking).
    ``reset_to_zero`` names the buffers a kernel accumulates into, zeroed before each timed run.

    ``BLOOMNATIVE_AUTOTUNE=first`` in the environment keeps only the first config of each list
    (no timing runs): the GPU test suite uses it, since it checks numerics, not speed, and
    would otherwise compile and time every config for every test shape."""
    if INTERPRET:
        return triton.autotune(configs=[interpreter_config], key=[])
    if _AUTOTUNE_FIRST_ONLY:
        return triton.autotune(configs=configs[:1], key=[])
    return triton.autotune(configs=configs, key=key, reset_to_zero=reset_to_zero)


_AUTOTUNE_ENV = os.environ.get("BLOOMNATIVE_AUTOTUNE", "all").strip().lower()
if _AUTOTUNE_ENV not in ("all", "first"):
    raise ValueError(
        f"BLOOMNATIVE_AUTOTUNE={_AUTOTUNE_ENV!r} is not valid: use 'all' (time every config, the "
        "default) or 'first' (the first config of each kernel, no timing)"
    )
_AUTOTUNE_FIRST_ONLY = _AUTOTUNE_ENV == "first"

_poison_outputs = os.environ.get("BLOOMNATIVE_KERNELS_POISON", "0") == "1"


@contextlib.contextmanager
def poison_outputs(enabled: bool = True) -> Iterator[None]:
    """Fill every buffer a kernel is meant to overwrite with NaN before the launch.

    A debugging aid (also on with ``BLOOMNATIVE_KERNELS_POISON=1``): an element a kernel forgets
    to write then shows up as NaN instead of as stale memory that happens to look plausible.
    """
    global _poison_outputs
    previous, _poison_outputs = _poison_outputs, enabled
    try:
        yield
    finally:
        _poison_outputs = previous


def empty_like(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.empty_like`` (same memory layout) for kernel outputs, NaN-filled when poisoning."""
    out = torch.empty_like(tensor, dtype=dtype)
    return out.fill_(float("nan")) if _poison_outputs else out


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` for kernel outputs, NaN-filled when poisoning."""
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    return out.fill_(float("nan")) if _poison_outputs else out


def num_programs_for_device(device: torch.device, per_sm: int = 2) -> int:
    """How many persistent programs a grid-stride kernel should launch on ``device``."""
    if device.type == "cuda":
        return per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: few programs, each looping over several rows


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: IEEE fp32 products for fp32 inputs (no silent TF32, as torch's
    default), the native tensor-core path for 16-bit inputs (where the argument is moot)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_float_dtype(name: str, tensor: torch.Tensor) -> None:
    """Raise a readable error unless ``tensor`` is fp32, bf16 or fp16."""
    if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {tensor.dtype}")


__all__ = [
    "FORCE_REFERENCE",
    "HAS_TRITON",
    "INTERPRET",
    "autotune",
    "check_float_dtype",
    "dot_precision",
    "empty",
    "declare_written",
    "empty_like",
    "install_tma_allocator",
    "kernel_op",
    "launch",
    "num_programs_for_device",
    "poison_outputs",
    "tl",
    "triton",
    "use_triton",
]
