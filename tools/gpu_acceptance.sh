#!/usr/bin/env bash
# On a 15-minute lease, run one command first: every figure that matters within 555 s, each
# step's JSON written the moment it ends (tools/first_contact.py; docs/performance.md):
#
#   OUT=outputs/gpu tools/gpu_acceptance.sh first-contact [--tiny]
#
# What a lent GPU (H100 or H200) is for, phase by phase, from a source tree (no install needed:
# PYTHONPATH=src:.). Correctness first: run `smoke` before anything that times. Each phase is one
# process under a 9-minute limit and writes its log and a JSON under $OUT (default outputs/gpu);
# run the phases in separate calls when a call is limited to 10 minutes. The listed order fits
# in 28 minutes of device time.
#
#   OUT=outputs/gpu tools/gpu_acceptance.sh smoke            # ~5 min: is it correct here?
#   OUT=outputs/gpu tools/gpu_acceptance.sh train-560m       # ~5 min
#   OUT=outputs/gpu tools/gpu_acceptance.sh train-1b7        # ~6 min
#   OUT=outputs/gpu tools/gpu_acceptance.sh kernels-bench    # ~5 min
#   OUT=outputs/gpu tools/gpu_acceptance.sh kernels-test host-syncs   # when time is left
#
# Phases:
#   smoke          tools/gpu_smoke.py: versions; every kernel eagerly against float64 (the
#                  TMA-reduced dQ included); compiled attention and LayerNorm equal to eager; 20
#                  eager and 20 compiled training steps at BLOOM-560m width with Triton attention
#                  and fused kernels, a save and a resume (smoke.json)
#   train-560m     tools/bench_train.py, BLOOM-560m, seq 2048, bf16, Triton attention, regional
#   train-1b7      compile, planner-chosen recompute, against HF (eager, compiled) and, when
#                  torchtitan imports, torchtitan's Llama 3 at the same width and depth
#   kernels-bench  tools/bench_kernels.py: flash_alibi vs SDPA+bias / Flex / SDPA flash causal
#                  (fwd, bwd, fwd+bwd; seq 2048/4096; head_dim 64/80/96/128), LayerNorm and
#                  bias-GeLU bandwidth, the fused loss's memory and time
#   kernels-test   the kernel tests with the kernels compiled on the GPU
#                  (BLOOMNATIVE_TEST_DEVICE=cuda), torch.compile capture of the triton_ops included
#   host-syncs     tools/bench_train.py --sync-debug, BLOOM-560m, the same settings at seq 1024:
#                  the host synchronisations CUDA sees in train steps after the first (expect 0)
#   env            nvidia-smi and the versions (smoke reports them too)
# A .whl/ folder (tools/fetch_gpu_wheels.sh) is installed into /tmp/bloomnative-site first.
set -uo pipefail
# first-contact's deadline counts from here: the wheel install below is part of it.
export BLOOMNATIVE_FIRST_CONTACT_T0="${BLOOMNATIVE_FIRST_CONTACT_T0:-$(date +%s.%N)}"
cd "$(dirname "$0")/.."

OUT="${OUT:-outputs/gpu}"
mkdir -p "$OUT"
export PYTHONPATH="src:.${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export MAX_RESTARTS=0  # a failure here is a finding: report it, do not retry it
PYTHON="${PYTHON:-python3}"
LIMIT_S=540  # per phase: under 9 minutes

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
  timeout "$LIMIT_S" "$PYTHON" tools/bench_train.py --config "configs/$preset.toml" \
    --training.seq_len=2048 --training.micro_batch_size="$micro" \
    --training.global_batch_size="$global" --training.rampup_batch_size= \
    --model.attention=triton --compile.enable=true \
    --activation_checkpoint.mode=auto --warmup 5 --steps 20 --cold-compile \
    --baseline "$(baselines)" --baseline-modes eager,compile \
    --json "$OUT/bench_train_$name.json" 2>&1 | tee "$OUT/bench_train_$name.log"
}

if [ "${1:-}" = first-contact ]; then
  shift
  exec "$PYTHON" tools/first_contact.py --out "$OUT" "$@"
fi

status=0
for phase in "$@"; do
  echo "=== $phase ($(date -u +%FT%TZ))"
  case "$phase" in
    smoke)
      timeout "$LIMIT_S" "$PYTHON" tools/gpu_smoke.py --out "$OUT" 2>&1 | tee "$OUT/smoke.log"
      ;;
    env)
      { nvidia-smi; "$PYTHON" -c "import json, platform, torch, triton, transformers; print(
json.dumps({'python': platform.python_version(), 'torch': torch.__version__, 'triton':
triton.__version__, 'transformers': transformers.__version__, 'device':
torch.cuda.get_device_name()}))" | tee "$OUT/env.json"; } 2>&1 | tee "$OUT/env.log"
      ;;
    kernels-test)
      # The first config of each autotuned kernel only: the tests check numerics, and timing
      # every config for every test shape is what made this phase take over 6 minutes.
      BLOOMNATIVE_TEST_DEVICE=cuda BLOOMNATIVE_AUTOTUNE=first timeout "$LIMIT_S" "$PYTHON" \
        -m pytest -q -p no:cacheprovider --durations=15 --junitxml="$OUT/kernels_test.xml" \
        tests/kernels 2>&1 | tee "$OUT/kernels_test.log"
      tests_rc=$?
      "$PYTHON" - "$OUT/kernels_test.xml" > "$OUT/kernels_test.json" <<'PY'
import json, sys, xml.etree.ElementTree as ET
suite = ET.parse(sys.argv[1]).getroot()
suite = suite if suite.tag == "testsuite" else suite[0]
print(json.dumps({k: suite.get(k) for k in ("tests", "failures", "errors", "skipped", "time")}))
PY
      (exit "$tests_rc")
      ;;
    kernels-bench)
      timeout "$LIMIT_S" "$PYTHON" tools/bench_kernels.py --out "$OUT/bench_kernels.json" 2>&1 \
        | tee "$OUT/bench_kernels.log"
      ;;
    train-560m) bench_train 560m bloom-560m 8 32 ;;
    train-1b7) bench_train 1b7 bloom-1b7 4 16 ;;
    host-syncs)
      timeout "$LIMIT_S" "$PYTHON" tools/bench_train.py --config configs/bloom-560m.toml \
        --training.seq_len=1024 --training.micro_batch_size=4 --training.global_batch_size=8 \
        --training.rampup_batch_size= \
        --model.attention=triton --compile.enable=true --activation_checkpoint.mode=auto \
        --warmup 2 --steps 3 --sync-debug --json "$OUT/host_syncs.json" 2>&1 \
        | tee "$OUT/host_syncs.log"
      ;;
    *)
      echo "unknown phase '$phase'; valid: first-contact [--tiny] (alone), smoke train-560m train-1b7 kernels-bench kernels-test host-syncs env" >&2
      exit 2
      ;;
  esac
  rc=$?
  echo "=== $phase exit $rc"
  [ "$rc" -eq 0 ] || status=$rc
done
exit "$status"
