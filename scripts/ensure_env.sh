# Sourced by run_train.sh and run_tests.sh (BLOOMNATIVE_EXTRAS=dev for the test extras): picks the Python to use and installs what is missing.
# Uses the current Python when it already has torch >= 2.11 (as on a GPU machine); otherwise
# creates .venv next to this repo and installs torch==2.13.0 (the CPU build here) and the package.
# Idempotent: a stamp file records what was installed, so a second run installs nothing.

_bn_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_bn_extras="${BLOOMNATIVE_EXTRAS:-}"

_bn_has_torch() {
  "$1" - <<'PY' 2>/dev/null
import sys
try:
    import torch
except Exception:
    sys.exit(1)
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 11) else 1)
PY
}

if [ -z "${BLOOMNATIVE_PYTHON:-}" ]; then
  _bn_sys_python="$(command -v python3 || command -v python)"
  if [ -n "$_bn_sys_python" ] && _bn_has_torch "$_bn_sys_python"; then
    BLOOMNATIVE_PYTHON="$_bn_sys_python"
    # A machine that already has torch (a GPU box) runs from the source tree, installing nothing.
    export PYTHONPATH="$_bn_root/src${PYTHONPATH:+:$PYTHONPATH}"
  else
    if [ ! -x "$_bn_root/.venv/bin/python" ]; then
      echo "[setup] creating $_bn_root/.venv" >&2
      "$_bn_sys_python" -m venv "$_bn_root/.venv" || return 1
    fi
    BLOOMNATIVE_PYTHON="$_bn_root/.venv/bin/python"
    _bn_stamp="$_bn_root/.venv/.bloomnative-installed${_bn_extras:+-$_bn_extras}"
    _bn_want="$(cat "$_bn_root/pyproject.toml" | sha1sum | cut -c1-16)"
    if [ ! -f "$_bn_stamp" ] || [ "$(cat "$_bn_stamp")" != "$_bn_want" ]; then
      echo "[setup] installing torch==2.13.0 and bloomnative${_bn_extras:+[$_bn_extras]} into .venv" >&2
      "$BLOOMNATIVE_PYTHON" -m pip install -q --upgrade pip >&2 || return 1
      "$BLOOMNATIVE_PYTHON" -m pip install -q "torch==2.13.0" >&2 || return 1
      "$BLOOMNATIVE_PYTHON" -m pip install -q -e "$_bn_root${_bn_extras:+[$_bn_extras]}" >&2 || return 1
      echo "$_bn_want" > "$_bn_stamp"
    fi
  fi
fi
export BLOOMNATIVE_PYTHON
