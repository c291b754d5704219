#!/usr/bin/env bash
# First run on a TPU VM (one host): make the Python 3.11 TPU venv, train the debug recipes on the
# CPU (the reference) and on the TPU (eager, compile, graph + scan, AC full, fused loss, splash,
# Qwen 3 MoE at EP 1 and 2, save + resume, context parallel 2 with and without the document mask,
# DeepSeek V3's MLA at EP 2, and a short run launched twice on one compile cache), each under a
# timeout, and pack one report with the logs into a tarball to send back:
#   scripts/tpu_smoke.sh [STEPS] [--timeout S] [--run-timeout RUN=S] [--runs A,B] [--out DIR]
#                        [--set RUN:--section.key=value] [--shim]
# STEPS defaults to 20; the report is DIR/report.md, DIR defaults to outputs/tpu_smoke/<UTC time>,
# the tarball DIR.tar.gz (both paths printed at the end). The runs and the report are
# tools/tpu_smoke.py (`python -m tools.tpu_smoke --help`); docs/tpu.md, "First run".
# --shim (or TITAN_SMOKE_SHIM=1): no TPU and no install; the "TPU" runs train on the CPU in the
# current Python, for CI (tests/e2e/test_tpu_smoke.py).
#   scripts/tpu_smoke.sh --multislice [--zone Z] [--accelerator v6e-8] [--slices 2] [--project P] ...
# prints, and runs nothing, the plan of a first multislice run for the owner of two slices (2 x v6e-8
# by default: create them, every process's launch view, a short run, delete; docs/launch.md "Several
# slices"): what no CPU can check is which rank torch-tpu indexes its per-slice address list with.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SHIM="${TITAN_SMOKE_SHIM:-0}"
for arg in "$@"; do
  if [ "$arg" = --multislice ]; then  # a plan, printed: no venv, no TPU
    rest=(); for a in "$@"; do [ "$a" = --multislice ] || rest+=("$a"); done
    exec "${PYTHON:-python3}" -m tools.tpu_smoke multislice ${rest[@]+"${rest[@]}"}
  fi
done
expect_value=""
for arg in "$@"; do  # flags checked before the TPU venv is made (a typo must not install anything)
  if [ -n "$expect_value" ]; then expect_value=""; continue; fi
  case "$arg" in
    --shim) SHIM=1 ;;
    -h|--help) exec "${PYTHON:-python3}" -m tools.tpu_smoke run --help ;;   # no venv needed
    --timeout|--run-timeout|--runs|--out|--set) expect_value=1 ;;
    --timeout=*|--run-timeout=*|--runs=*|--out=*|--set=*) ;;
    -*) echo "error: tpu_smoke.sh: unknown option $arg; allowed: [STEPS] --timeout S, --run-timeout RUN=S, --runs A,B, --out DIR, --set RUN:--k=v, --shim, --multislice, --help" >&2; exit 2 ;;
  esac
done
if [ "$SHIM" = 1 ]; then
  PY="${PYTHON:-python}"
  exec "$PY" -m tools.tpu_smoke run --shim "$@"
fi
# The TPU venv (Python 3.11, torch-tpu, pinned torch/jax/libtpu); it refuses with one line where it
# cannot make one. tools.tpu_smoke checks the Python and torch-tpu again before any run.
source "$ROOT/scripts/env.sh" tpu
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"   # the CPU reference; a TPU VM host has many cores
exec python -m tools.tpu_smoke run "$@"
