# Sourced by run_train.sh and run_tests.sh (BLOOMNATIVE_EXTRAS=dev for the test extras): sets
# BLOOMNATIVE_PYTHON, the Python to use, and installs what is missing.
# - BLOOMNATIVE_PYTHON already set: that Python, used as it is; without torch >= 2.11 it is an
#   error, never silently replaced by another environment.
# - BLOOMNATIVE_STACK=gpu: .venv-gpu, made with python3.11, holding the versions of the lent GPU
#   machines pinned by scripts/gpu_stack_constraints.txt (torch 2.11.0's CUDA build, which runs
#   on CPU too, triton 3.6.0, transformers 5.17.0): pyproject's lower bounds, CI's second pass.
# - Otherwise (BLOOMNATIVE_STACK unset or "cpu"): the current Python when it already has
#   torch >= 2.11 (as on a GPU machine); else .venv with torch==2.13.0 (the CPU build here).
# Idempotent: a stamp file in the environment records what was installed, so a second run
# installs nothing.

_bn_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_bn_extras="${BLOOMNATIVE_EXTRAS:-}"

# Reads the installed version without importing torch (seconds on every launch otherwise).
_bn_has_torch() {
  "$1" - <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
major, minor = (int(x) for x in version("torch").split("+")[0].split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 11) else 1)
PY
}

# _bn_venv DIR PYTHON: makes DIR with PYTHON if it is missing; BLOOMNATIVE_PYTHON is its Python.
_bn_venv() {
  if [ ! -x "$1/bin/python" ]; then
    echo "[setup] creating $1" >&2
    "$2" -m venv "$1" || return 1
  fi
  BLOOMNATIVE_PYTHON="$1/bin/python"
  _bn_stamp_file="$1/.bloomnative-installed${_bn_extras:+-$_bn_extras}"
}

# _bn_installed FILE...: whether the environment's stamp says it holds what the FILEs
# (pyproject.toml, any constraints and this script) ask for; if not, `_bn_pip` installs and
# `_bn_stamp` records it.
_bn_installed() {
  _bn_stamp_want="$(cat "$@" | sha1sum | cut -c1-16)"
  [ -f "$_bn_stamp_file" ] && [ "$(cat "$_bn_stamp_file")" = "$_bn_stamp_want" ]
}

_bn_pip() {
  echo "[setup] pip install $*" >&2
  "$BLOOMNATIVE_PYTHON" -m pip install -q "$@" >&2
}

_bn_stamp() {
  echo "$_bn_stamp_want" > "$_bn_stamp_file"
}

# With the dev extras, DeepSpeed too: the reference reader of the Megatron-DeepSpeed checkpoint
# tests (tests/interop/test_megatron_deepspeed.py). Its release is a source archive whose build
# imports torch, so it is built against the environment's own (no build isolation), without its
# CUDA ops, and without its requirements (torch among them): the three it imports are named.
_bn_reference_packages() {
  [ "$_bn_extras" = dev ] || return 0
  DS_BUILD_OPS=0 _bn_pip --no-deps --no-build-isolation \
    "deepspeed==0.19.8" "hjson>=3.1" "py-cpuinfo>=9" "msgpack>=1.0"
}

_bn_package=(-e "$_bn_root${_bn_extras:+[$_bn_extras]}")
_bn_constraints="$_bn_root/scripts/gpu_stack_constraints.txt"
if [ -n "${BLOOMNATIVE_PYTHON:-}" ]; then
  if ! _bn_has_torch "$BLOOMNATIVE_PYTHON"; then
    echo "BLOOMNATIVE_PYTHON=$BLOOMNATIVE_PYTHON has no torch >= 2.11: point it at a Python" \
      "that has, or unset it to let scripts/ensure_env.sh make one" >&2
    return 1
  fi
else
  case "${BLOOMNATIVE_STACK:-cpu}" in
    gpu)
      _bn_python="$(command -v python3.11)" || {
        echo "BLOOMNATIVE_STACK=gpu needs python3.11 on PATH (the Python CI tests it on)" >&2
        return 1
      }
      _bn_venv "$_bn_root/.venv-gpu" "$_bn_python" || return 1
      if ! _bn_installed "$_bn_root/pyproject.toml" "$_bn_constraints" "${BASH_SOURCE[0]}"; then
        _bn_pip --upgrade pip || return 1
        _bn_pip -c "$_bn_constraints" "${_bn_package[@]}" || return 1
        _bn_reference_packages || return 1
        _bn_stamp
      fi
      ;;
    cpu)
      _bn_python="$(command -v python3 || command -v python)"
      if [ -n "$_bn_python" ] && _bn_has_torch "$_bn_python"; then
        BLOOMNATIVE_PYTHON="$_bn_python"
        # A machine that already has torch (a GPU box) runs from the source tree, installing
        # nothing.
        export PYTHONPATH="$_bn_root/src${PYTHONPATH:+:$PYTHONPATH}"
      else
        _bn_venv "$_bn_root/.venv" "$_bn_python" || return 1
        if ! _bn_installed "$_bn_root/pyproject.toml" "${BASH_SOURCE[0]}"; then
          _bn_pip --upgrade pip || return 1
          _bn_pip "torch==2.13.0" || return 1
          _bn_pip "${_bn_package[@]}" || return 1
          _bn_reference_packages || return 1
          _bn_stamp
        fi
      fi
      ;;
    *)
      echo "BLOOMNATIVE_STACK=${BLOOMNATIVE_STACK}: expected cpu (the default) or gpu" >&2
      return 1
      ;;
  esac
fi
export BLOOMNATIVE_PYTHON
