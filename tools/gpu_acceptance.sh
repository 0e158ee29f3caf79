#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md, phase by phase, on one CUDA GPU (H100 or H200), from a
# source tree (no install needed: PYTHONPATH=src:.). Each phase is one process under a time
# limit and writes its log and JSON into $OUT (default outputs/gpu); run the phases in separate
# calls when a call is limited to 10 minutes.
#
#   OUT=outputs/gpu tools/gpu_acceptance.sh env kernels-test        # ~3 min
#   OUT=outputs/gpu tools/gpu_acceptance.sh kernels-bench            # ~5 min
#   OUT=outputs/gpu tools/gpu_acceptance.sh train-560m               # ~5 min
#   OUT=outputs/gpu tools/gpu_acceptance.sh train-1b7                # ~6 min
#   OUT=outputs/gpu tools/gpu_acceptance.sh host-syncs               # ~2 min
#
# Phases:
#   env            nvidia-smi, Python/torch/Triton/transformers versions
#   kernels-test   the kernel tests compiled on the GPU (BLOOMNATIVE_TEST_DEVICE=cuda), torch.compile
#                  capture of the triton_ops included
#   kernels-bench  tools/bench_kernels.py: flash_alibi vs SDPA+bias / Flex / SDPA flash causal
#                  (fwd, bwd, fwd+bwd; seq 2048/4096; head_dim 64/80/96/128), LayerNorm and
#                  bias-GeLU bandwidth, the fused loss's memory and time
#   train-560m     tools/bench_train.py, BLOOM-560m, seq 2048, bf16, Triton attention, regional
#   train-1b7      compile, planner-chosen recompute, against HF (eager, compiled) and, when
#                  torchtitan imports, torchtitan's Llama 3 at the same width and depth
#   host-syncs     tools/bench_train.py --sync-debug, BLOOM-560m, the same settings at seq 1024:
#                  the host synchronisations CUDA sees in train steps after the first (expect 0)
# A .whl/ folder (tools/fetch_gpu_wheels.sh) is installed into /tmp/bloomnative-site first.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-outputs/gpu}"
mkdir -p "$OUT"
export PYTHONPATH="src:.${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PYTHON="${PYTHON:-python3}"

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/bloomnative-site .whl/*.whl || exit 1
  export PYTHONPATH="$PYTHONPATH:/tmp/bloomnative-site"
fi

baselines() {
  if "$PYTHON" -c "import torchtitan.models.llama3" 2>/dev/null; then
    echo "hf,torchtitan"
  else
    echo "hf"
  fi
}

bench_train() {  # name preset micro_batch global_batch
  local name="$1" preset="$2" micro="$3" global="$4"
  timeout 560 "$PYTHON" tools/bench_train.py --config "configs/$preset.toml" \
    --training.seq_len=2048 --training.micro_batch_size="$micro" \
    --training.global_batch_size="$global" --training.rampup_batch_size= \
    --model.attention=triton --compile.enable=true \
    --activation_checkpoint.mode=auto --warmup 5 --steps 20 --cold-compile \
    --baseline "$(baselines)" --baseline-modes eager,compile \
    --json "$OUT/bench_train_$name.json" 2>&1 | tee "$OUT/bench_train_$name.log"
}

status=0
for phase in "$@"; do
  echo "=== $phase ($(date -u +%FT%TZ))"
  case "$phase" in
    env)
      { nvidia-smi; "$PYTHON" -c "import platform, torch, triton, transformers; print('python',
platform.python_version(), 'torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())"; } 2>&1 \
        | tee "$OUT/env.log"
      ;;
    kernels-test)
      # The first config of each autotuned kernel only: the tests check numerics, and timing
      # every config for every test shape is what made this phase take over 6 minutes.
      BLOOMNATIVE_TEST_DEVICE=cuda BLOOMNATIVE_AUTOTUNE=first timeout 560 "$PYTHON" -m pytest \
        -q -p no:cacheprovider --durations=15 tests/kernels 2>&1 | tee "$OUT/kernels_test.log"
      ;;
    kernels-bench)
      timeout 560 "$PYTHON" tools/bench_kernels.py --out "$OUT/bench_kernels.json" 2>&1 \
        | tee "$OUT/bench_kernels.log"
      ;;
    train-560m) bench_train 560m bloom-560m 8 32 ;;
    train-1b7) bench_train 1b7 bloom-1b7 4 16 ;;
    host-syncs)
      timeout 560 "$PYTHON" tools/bench_train.py --config configs/bloom-560m.toml \
        --training.seq_len=1024 --training.micro_batch_size=4 --training.global_batch_size=8 \
        --training.rampup_batch_size= \
        --model.attention=triton --compile.enable=true --activation_checkpoint.mode=auto \
        --warmup 2 --steps 3 --sync-debug --json "$OUT/host_syncs.json" 2>&1 \
        | tee "$OUT/host_syncs.log"
      ;;
    *)
      echo "unknown phase '$phase'; valid: env kernels-test kernels-bench train-560m train-1b7 host-syncs" >&2
      exit 2
      ;;
  esac
  rc=$?
  echo "=== $phase exit $rc"
  [ "$rc" -eq 0 ] || status=$rc
done
exit "$status"
