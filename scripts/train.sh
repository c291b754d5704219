#!/usr/bin/env bash
# Train from a TOML recipe (default: the Llama 3 debug recipe, CPU, offline).
#   scripts/train.sh [RECIPE.toml] [--section.key=value ...]
#   NPROC=4 scripts/train.sh configs/llama3_debug.toml --parallelism.data_parallel_shard_degree=4
# The venv gets the [dev] extras, the same venv as scripts/test.sh: every shipped recipe runs in it
# (the FLUX debug recipe's text encoders and VAE need transformers and diffusers, `name = "hf"`
# needs transformers).
# NPROC > 1 runs through the launcher (python -m trainer.launch, one node, a free local port or
# MASTER_PORT): exit 75 when every rank was preempted, Ctrl-C stops every rank with one line each
# (exit 130). Exit codes: 0 done, 2 bad input (one `error:` line), 75 preempted, 130 interrupted.
set -euo pipefail
for arg in "$@"; do
  if [ "$arg" = "-h" ] || [ "$arg" = "--help" ]; then
    cat <<'USAGE'
usage: scripts/train.sh [RECIPE.toml] [--section.key=value ...]

Train from a TOML recipe (default: configs/llama3_debug.toml, the Llama 3 debug model on the CPU,
offline). Makes the environment (.venv, the [dev] extras) on first use.

  RECIPE.toml            a recipe, e.g. configs/qwen3_moe_debug.toml (see configs/)
  --section.key=value    override one recipe key, e.g. --training.steps=50 (docs/config.md)
  NPROC=N (environment)  N processes on this machine, through python -m trainer.launch

The trainer's options: python -m trainer.train --help. Exit codes: 0 done, 2 bad input,
75 preempted (relaunch to resume), 130 interrupted (Ctrl-C), 1 anything else.
USAGE
    exit 0
  fi
done
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" dev
recipe="configs/llama3_debug.toml"
if [ $# -gt 0 ] && [[ "$1" == *.toml ]]; then recipe="$1"; shift; fi
if [ "${NPROC:-1}" -gt 1 ]; then
  free_port='import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
  port="${MASTER_PORT:-$(python -c "$free_port")}"
  exec python -m trainer.launch --platform manual --nnodes 1 --node-rank 0 --master-addr 127.0.0.1 \
    --master-port "$port" --nproc-per-node "$NPROC" -- --config "$recipe" "$@"
fi
exec python -m trainer.train --config "$recipe" "$@"
