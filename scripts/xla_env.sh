#!/usr/bin/env bash
# Make (once) and print the path of one of the XLA tier's virtual environments.
#   scripts/xla_env.sh xla     torch 2.13.0 (CPU) + jax 0.10.2 + torchax 0.0.13: lowering to StableHLO,
#                              XLA:CPU runs, Pallas kernels in interpret mode
#   scripts/xla_env.sh tpuc    jax[tpu] 0.10.2 (libtpu 0.0.42.1): deviceless XLA:TPU compiles
#   scripts/xla_env.sh ttpu    torch 2.13.0 + torch-tpu 0.2.0 (cp311 only) + jax 0.10.2 + torchax:
#                              torch-tpu's own compile path up to its lowering call
#   scripts/xla_env.sh maxtext maxtext[tpu] 0.2.5 + jax[tpu] 0.11.1 (libtpu 0.0.46) on Python 3.12 (pyenv,
#                              python3.12 or uv): MaxText's own train step compiled deviceless, the
#                              calibration of docs/maxtext_calibration.md; never made by the default install
# These venvs are separate from .venv on purpose: torchax and torch-tpu change process globals,
# so nothing of them may load into the main test process. Versions are pinned exactly; ttpu also
# installs under constraints/tpu.txt (what a TPU VM gets; tests/xla/test_install_pins.py checks the
# venv against it; the stamp hashes only the list, so a pin change there needs rm -r .venv-ttpu).
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then  # this header, as the usage
  echo "usage: scripts/xla_env.sh xla|tpuc|ttpu|maxtext"
  sed -n '2,/^set -euo pipefail/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
  exit 0
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ $# -ne 1 ]; then
  echo "error: scripts/xla_env.sh: expected one environment name, got ${#}: ${*:-nothing}; allowed: xla, tpuc, ttpu, maxtext (--help)" >&2
  exit 2
fi
NAME="$1"
PIP_ARGS=()
case "$NAME" in
  xla)  PKGS=(torch==2.13.0 "jax[cpu]==0.10.2" jaxlib==0.10.2 torchax==0.0.13 flatbuffers numpy) ;;
  tpuc) PKGS=("jax[tpu]==0.10.2" flatbuffers numpy) ;;
  # tiktoken, safetensors: the trainer's start-up (tools/tpu_compile.py builds the job); gcsfs: the
  # [tpu] extra has it (constraints/tpu.txt pins it; tests/xla/test_install_pins.py checks it here)
  ttpu) PKGS=(torch==2.13.0 torch-tpu==0.2.0 jax==0.10.2 jaxlib==0.10.2 torchax==0.0.13 flatbuffers numpy
              tiktoken==0.14.0 safetensors==0.8.0 gcsfs==2026.10.1)
        PIP_ARGS=(-c "$ROOT/constraints/tpu.txt") ;;
  # MaxText's own pins: its install (setup.sh) resolves tpu-requirements.txt at the lowest versions,
  # which gives jax/jaxlib 0.11.1 and libtpu 0.0.46 (jax[tpu] 0.11.1 asks for 0.0.46.*)
  maxtext) PKGS=("maxtext[tpu]==0.2.5" "jax[tpu]==0.11.1" jaxlib==0.11.1 libtpu==0.0.46) ;;
  *) echo "error: scripts/xla_env.sh: unknown environment '$NAME'; allowed: xla, tpuc, ttpu, maxtext" >&2; exit 2 ;;
esac
VENV="${TITAN_XLA_VENV_ROOT:-$ROOT}/.venv-$NAME"
STAMP="$VENV/.titan-$(printf '%s\n' "${PKGS[@]}" | sha1sum | cut -c1-12)"
if [ ! -f "$STAMP" ]; then
  # Two callers (pytest-xdist workers, two checkouts sharing TITAN_XLA_VENV_ROOT) may ask for the
  # same venv at once: one makes it, the other waits on the lock and then finds the stamp.
  mkdir -p "$(dirname "$VENV")"
  exec 9>"$VENV.lock"
  flock 9
  if [ ! -f "$STAMP" ]; then
    echo "setting up $VENV (one time) ..." >&2
    PY=python3
    if [ "$NAME" = maxtext ]; then  # MaxText 0.2.5 needs Python >= 3.12
      PY=""
      for c in "$(pyenv root 2>/dev/null)"/versions/3.1[2-9]*/bin/python python3.12 python3.13; do
        if [ -x "$c" ] || command -v "$c" >/dev/null 2>&1; then PY="$c"; break; fi
      done
      if [ -z "$PY" ] && command -v uv >/dev/null 2>&1; then PY="$(uv python find 3.12 2>/dev/null || true)"; fi
      if [ -z "$PY" ]; then
        echo "error: scripts/xla_env.sh maxtext: no Python >= 3.12 found (pyenv install 3.12, python3.12 or uv)" >&2
        exit 2
      fi
    fi
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q ${PIP_ARGS[@]+"${PIP_ARGS[@]}"} "${PKGS[@]}" >&2
    touch "$STAMP"
  fi
  flock -u 9
fi
echo "$VENV"
