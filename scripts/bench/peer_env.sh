#!/usr/bin/env bash
# Build the peer venv for scripts/bench/reference_torchtitan.py: TorchTitan 0.3.0 with the same torch as ours.
#
#   bash scripts/bench/peer_env.sh            # makes .venv-peer/ in the repository root
#   PEER_VENV=/tmp/ttv bash scripts/bench/peer_env.sh
#
# The peer lives in its own venv because TorchTitan pins its own dependencies (tyro, torchdata,
# tokenizers, ...); it must never be installed into the project's .venv. torch is pinned to the
# version ours uses so both sides run the same kernels; on a machine without CUDA the pin resolves to
# the CPU wheel (the +cpu build from the local wheel cache when there is one). Set PEER_TORCH to pin
# another build, e.g. PEER_TORCH="torch==2.13.0" with PIP_INDEX_URL pointing at a CUDA index on a GPU host.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv="${PEER_VENV:-.venv-peer}"
torch_spec="${PEER_TORCH:-torch==2.13.0}"
python="${PYTHON:-python3}"

if [[ ! -x "$venv/bin/python" ]]; then
    "$python" -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --upgrade pip
# torch first, alone, so the torchtitan resolve below sees it satisfied and pulls no other build.
"$venv/bin/pip" install --quiet "$torch_spec" numpy
# triton: torchtitan 0.3.0 imports it unconditionally (its MoE token dispatcher kernels), even on the CPU.
"$venv/bin/pip" install --quiet "torchtitan==0.3.0" triton "$torch_spec"
"$venv/bin/python" - <<'PY'
import importlib.metadata as md
import torch
print(f"peer venv ready: torch {torch.__version__}, torchtitan {md.version('torchtitan')}, "
      f"cuda {'yes' if torch.cuda.is_available() else 'no'}")
PY
