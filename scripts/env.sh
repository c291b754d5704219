# Sourced by train.sh and test.sh: make .venv if it is missing or out of date, then activate it.
# On a machine without torch, the pinned torch goes in first so that hosts with a local CPU wheel
# take it (an unpinned torch would pull a multi-GB CUDA build). Override with TORCH_SPEC=...
# TPU hosts: `pip install -e '.[tpu]'` in this venv (torch-tpu, libtpu, jax); never on CPU CI.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TITAN_VENV:-$ROOT/.venv}"
EXTRAS="${1:-}"
STAMP="$VENV/.titan-installed-$(cat "$ROOT/pyproject.toml" | sha1sum | cut -c1-12)${EXTRAS:+-$EXTRAS}"
if [ ! -f "$STAMP" ]; then
  echo "setting up $VENV (one time) ..." >&2
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    "$VENV/bin/pip" install -q "${TORCH_SPEC:-torch==2.13.0}"
  fi
  "$VENV/bin/pip" install -q -e "$ROOT${EXTRAS:+[$EXTRAS]}"
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
# torch-tpu's autoload changes torch globals on hosts without a TPU; only TPU hosts opt in.
export TORCH_DEVICE_BACKEND_AUTOLOAD="${TORCH_DEVICE_BACKEND_AUTOLOAD:-0}"
cd "$ROOT"
