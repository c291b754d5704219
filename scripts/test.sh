#!/usr/bin/env bash
# Run the test suite on the CPU (makes .venv with the [dev] extras on first use).
#   scripts/test.sh [pytest args]      e.g. scripts/test.sh -m "not slow" -x
# Tests run on TITAN_TEST_WORKERS pytest-xdist workers (default 2; tests/conftest.py groups the
# ones that share an expensive fixture); `scripts/test.sh -n 0 ...` runs them in this process.
# The XLA tier (tests/xla, marker `xla`) is part of the suite: its probes run in their own venvs,
# made on first use by scripts/xla_env.sh under TITAN_XLA_VENV_ROOT (default: the checkout);
# deselect it with -m "not xla". See docs/tpu.md.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" dev
# One thread per process: on small shared CPUs torch's default thread count can make a step
# 10-400x slower; multi-process tests also get one thread per rank.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec python -m pytest -q -p no:cacheprovider --durations=40 -n "${TITAN_TEST_WORKERS:-2}" --dist loadgroup "$@"
