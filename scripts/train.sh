#!/usr/bin/env bash
# Train from a TOML recipe (default: the Llama 3 debug recipe, CPU, offline).
#   scripts/train.sh [RECIPE.toml] [--section.key=value ...]
#   NPROC=4 scripts/train.sh configs/llama3_debug.toml --parallelism.data_parallel_shard_degree=4
# The venv gets the [dev] extras, the same venv as scripts/test.sh: every shipped recipe runs in it
# (the FLUX debug recipe's text encoders and VAE need transformers and diffusers, `name = "hf"`
# needs transformers).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" dev
recipe="configs/llama3_debug.toml"
if [ $# -gt 0 ] && [[ "$1" == *.toml ]]; then recipe="$1"; shift; fi
if [ "${NPROC:-1}" -gt 1 ]; then
  exec torchrun --standalone --nproc_per_node="$NPROC" -m trainer.train --config "$recipe" "$@"
fi
exec python -m trainer.train --config "$recipe" "$@"
