#!/usr/bin/env bash
# Run the test suite on the CPU (makes .venv with the [dev] extras on first use).
#   scripts/test.sh [--smoke | --all] [--record] [pytest args]
#     (no flag)  the default tier: what CI runs on every submission, under 20 minutes on 2 vCPUs
#     --smoke    the fast loop, about a minute in one process: training end to end, the step plan,
#                the layout, the config (tests/support/tiers.py SMOKE); run it before every commit
#     --all      every tier: the default one plus the scheduled tier (tests/support/tiers.py:
#                the exhaustive matrix points, README blocks on a clone, the whole TPU-program
#                table; .ci/scheduled runs this)
#     --record   write each test's duration to tests/support/durations.json (the tier budget
#                test, tests/unit/test_tiers.py, reads it; record with --all so every test has one)
#   e.g. scripts/test.sh -m "not slow" -x;  scripts/test.sh -n 0 tests/unit/test_config.py -k recipe
# Tests run on TITAN_TEST_WORKERS pytest-xdist workers (default 2; tests/conftest.py groups the
# ones that share an expensive fixture); `scripts/test.sh -n 0 ...` runs them in this process.
# The XLA tier (tests/xla, marker `xla`) runs its probes in their own venvs, made on first use by
# scripts/xla_env.sh under TITAN_XLA_VENV_ROOT (default: the checkout); deselect it with
# -m "not xla". docs/testing.md. Exit codes: pytest's, except a bad flag or path: 2 (pytest's 4).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --all) export TITAN_TEST_TIER=all; shift ;;
    --smoke) export TITAN_TEST_TIER=smoke TITAN_TEST_WORKERS="${TITAN_TEST_WORKERS:-0}"; shift ;;
    --record) export TITAN_RECORD_DURATIONS="$ROOT/tests/support/durations.json"; shift ;;
    -h|--help)  # this header, as the usage
      echo "usage: scripts/test.sh [--smoke | --all] [--record] [pytest args]"
      sed -n '2,/^set -euo pipefail/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) break ;;
  esac
done
source "$ROOT/scripts/env.sh" dev
# One thread per process: on small shared CPUs torch's default thread count can make a step
# 10-400x slower; multi-process tests also get one thread per rank.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# pytest's usage errors (an unknown flag, a path that is not there) are its exit 4: bad input, so 2
# here as in every other command; the rest of its codes unchanged. exec: signals reach pytest.
exec python -c 'import sys, pytest; rc = int(pytest.main(sys.argv[1:])); sys.exit(2 if rc == 4 else rc)' \
  -q -p no:cacheprovider --durations=40 -n "${TITAN_TEST_WORKERS:-2}" --dist loadgroup "$@"
