#!/usr/bin/env bash
# Train from a TOML recipe (default: the Llama 3 debug recipe, CPU, offline).
#   scripts/train.sh [RECIPE.toml] [--section.key=value ...]
#   NPROC=4 scripts/train.sh configs/llama3_debug.toml --parallelism.data_parallel_shard_degree=4
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" ""
recipe="configs/llama3_debug.toml"
if [ $# -gt 0 ] && [[ "$1" == *.toml ]]; then recipe="$1"; shift; fi
if [ "${NPROC:-1}" -gt 1 ]; then
  exec torchrun --standalone --nproc_per_node="$NPROC" -m trainer.train --config "$recipe" "$@"
fi
exec python -m trainer.train --config "$recipe" "$@"
