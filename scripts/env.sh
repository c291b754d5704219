# Sourced by train.sh and test.sh: make .venv if it is missing or out of date, then activate it.
# On a machine without torch, the pinned torch goes in first so that hosts with a local CPU wheel
# take it (an unpinned torch would pull a multi-GB CUDA build). Override with TORCH_SPEC=...
# The rest installs under the lock constraints/dev.txt (exact versions of the [dev] tree).
#
# `source scripts/env.sh tpu` (TPU VMs; never on CPU CI): a separate venv, .venv-tpu, on Python
# 3.11 (torch-tpu 0.2.0 is a cp311 wheel): python3 when it is 3.11, else `uv venv --python 3.11`
# when uv is on PATH, else python3.11; torch 2.13.0 from the CPU wheel index (TORCH_INDEX), then
# the [tpu] extra under constraints/tpu.txt. It refuses with one `error:` line, exit 2, when no
# Python 3.11 can be had or torch-tpu did not install. TPU venvs load torch-tpu (autoload on).
#   source scripts/env.sh [EXTRAS]    EXTRAS: "" (no extras), dev, tpu, or a comma list of pyproject's
#                                     extras (e.g. dev,hf); --help prints this; an option is refused (exit 2)
case "${1:-}" in
  -h|--help)
    echo "usage: source scripts/env.sh [dev|tpu|EXTRA,...]"
    sed -n '1,/^case "\${1:-}" in/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
    return 0 2>/dev/null || exit 0 ;;
  -*)
    echo "error: scripts/env.sh: unknown option $1; allowed: source scripts/env.sh [dev|tpu|EXTRA,...] (--help)" >&2
    return 2 2>/dev/null || exit 2 ;;
esac
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${1:-}"
case ",$EXTRAS," in *,tpu,*) TPU=1 ;; *) TPU=0 ;; esac
if [ "$TPU" = 1 ]; then VENV="${TITAN_VENV:-$ROOT/.venv-tpu}"; else VENV="${TITAN_VENV:-$ROOT/.venv}"; fi
if [ "$TPU" = 1 ]; then LOCK="$ROOT/constraints/tpu.txt"; else LOCK="$ROOT/constraints/dev.txt"; fi
PINS="$(sha1sum < "$LOCK")"
STAMP="$VENV/.titan-installed-$( (cat "$ROOT/pyproject.toml"; printf '%s' "$PINS") | sha1sum | cut -c1-12)${EXTRAS:+-$EXTRAS}"
if [ ! -f "$STAMP" ] && [ -n "${TITAN_NO_INSTALL:-}" ]; then
  # TITAN_NO_INSTALL=1: use an existing venv as it is, never install into it (tests that run the
  # scripts on a clone with TITAN_VENV pointing at a shared venv).
  echo "error: scripts/env.sh: $VENV is not set up from this pyproject.toml${EXTRAS:+ with [$EXTRAS]} (no $(basename "$STAMP")) and TITAN_NO_INSTALL is set; allowed: a venv made by scripts/env.sh ${EXTRAS:-\"\"} from the same pyproject.toml, or TITAN_NO_INSTALL unset (installs)" >&2
  return 2 2>/dev/null || exit 2
fi
if [ ! -f "$STAMP" ]; then
  echo "setting up $VENV (one time) ..." >&2
  if [ "$TPU" = 1 ]; then
    _titan_is311() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' >/dev/null 2>&1; }
    if [ -x "$VENV/bin/python" ] && ! _titan_is311 "$VENV/bin/python"; then
      echo "error: scripts/env.sh tpu: $VENV is Python $("$VENV/bin/python" -c 'import platform; print(platform.python_version())'); allowed: Python 3.11 (torch-tpu 0.2.0 is cp311 only): remove $VENV or set TITAN_VENV to another folder" >&2
      return 2 2>/dev/null || exit 2
    elif [ ! -x "$VENV/bin/python" ]; then
      if command -v python3 >/dev/null && _titan_is311 python3; then
        _titan_make=(python3 -m venv "$VENV")
      elif command -v uv >/dev/null; then
        _titan_make=(uv venv --quiet --seed --python 3.11 "$VENV")
      elif command -v python3.11 >/dev/null && _titan_is311 python3.11; then
        _titan_make=(python3.11 -m venv "$VENV")
      else
        echo "error: scripts/env.sh tpu: no Python 3.11 here (python3 is $(python3 -c 'import platform; print(platform.python_version())' 2>/dev/null || echo missing)); allowed: Python 3.11 (torch-tpu 0.2.0 is cp311 only): install uv (pip install uv, or curl -LsSf https://astral.sh/uv/install.sh | sh) and rerun, it makes the venv with uv venv --python 3.11; or put a python3.11 on PATH (Ubuntu: apt-get install python3.11-venv from the deadsnakes PPA)" >&2
        return 2 2>/dev/null || exit 2
      fi
      # Each step checks its own status: `source env.sh tpu && ...` runs this file with set -e off.
      "${_titan_make[@]}" >&2 || { echo "error: scripts/env.sh tpu: '${_titan_make[*]}' failed; allowed: a Python 3.11 that can make venvs (see its messages above)" >&2; return 2 2>/dev/null || exit 2; }
    fi
    if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
      "$VENV/bin/python" -m pip install -q --index-url "${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" \
        -c "$ROOT/constraints/tpu.txt" "${TORCH_SPEC:-torch==2.13.0}" \
        || { echo "error: scripts/env.sh tpu: torch did not install from ${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}; allowed: that index reachable, or TORCH_INDEX set to one with torch 2.13.0 (CPU build)" >&2; return 2 2>/dev/null || exit 2; }
    fi
    "$VENV/bin/python" -m pip install -q -c "$ROOT/constraints/tpu.txt" -e "$ROOT[$EXTRAS]" \
      || { echo "error: scripts/env.sh tpu: pip install -c constraints/tpu.txt -e '.[$EXTRAS]' failed; allowed: Linux x86_64, Python 3.11, PyPI reachable (see pip's messages above)" >&2; return 2 2>/dev/null || exit 2; }
    if ! "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch_tpu') is None)"; then
      echo "error: scripts/env.sh tpu: torch-tpu did not install into $VENV; allowed: Linux x86_64 with Python 3.11 and the pins of constraints/tpu.txt (see pip's messages above)" >&2
      return 2 2>/dev/null || exit 2
    fi
  else
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
      "$VENV/bin/pip" install -q "${TORCH_SPEC:-torch==2.13.0}"
    fi
    "$VENV/bin/pip" install -q -c "$LOCK" -e "$ROOT${EXTRAS:+[$EXTRAS]}"
  fi
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
# torch-tpu's autoload changes torch globals on hosts without a TPU; only TPU venvs opt in.
export TORCH_DEVICE_BACKEND_AUTOLOAD="${TORCH_DEVICE_BACKEND_AUTOLOAD:-$TPU}"
cd "$ROOT"
