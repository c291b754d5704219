#!/usr/bin/env bash
# Start a recipe on every host of a job; each host runs `python -m trainer.launch`, which reads
# its place in the job from the platform and starts torchrun with a static rendezvous
# (docs/launch.md). The code and the venv must be at the same path on every host.
#
#   scripts/launch_pod.sh tpu-vm NAME ZONE [PROJECT] -- --config configs/llama3_8b_v6e.toml [--k=v ...]
#       every worker of a TPU VM slice, over `gcloud compute tpus tpu-vm ssh --worker=all`
#   scripts/launch_pod.sh xpk CLUSTER WORKLOAD TPU_TYPE NUM_SLICES -- --config ...
#       a GKE workload through XPK (one pod per TPU host; GKE sets TPU_WORKER_HOSTNAMES/TPU_WORKER_ID)
#   scripts/launch_pod.sh slurm -- --config ...
#       inside an sbatch allocation: one launcher per node with srun, one process per GPU
#   scripts/launch_pod.sh local NHOSTS NPROC -- --config ...
#       simulate NHOSTS hosts on this machine (loopback, NPROC processes each)
# Set DRY_RUN=1 to print what would run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
platform="${1:?usage: scripts/launch_pod.sh tpu-vm|xpk|slurm|local ... -- TRAIN ARGS}"
shift
pre=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do pre+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ $# -gt 0 ] || { echo "error: launch_pod.sh: nothing to train; allowed: ... -- --config RECIPE.toml" >&2; exit 2; }
train_args=$(printf '%q ' "$@")
run() { if [ "${DRY_RUN:-0}" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi; }
remote="cd $(printf '%q' "$ROOT") && source scripts/env.sh tpu && python -m trainer.launch"

case "$platform" in
  tpu-vm)
    name="${pre[0]:?tpu-vm needs NAME ZONE}"; zone="${pre[1]:?tpu-vm needs NAME ZONE}"
    project=(); [ -n "${pre[2]:-}" ] && project=(--project "${pre[2]}")
    run gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" "${project[@]}" --worker=all \
      --command "$remote --platform tpu-vm -- $train_args" ;;
  xpk)
    cluster="${pre[0]:?xpk needs CLUSTER WORKLOAD TPU_TYPE NUM_SLICES}"; workload="${pre[1]:?}"
    tpu_type="${pre[2]:?}"; slices="${pre[3]:-1}"
    run xpk workload create --cluster "$cluster" --workload "$workload" --tpu-type "$tpu_type" \
      --num-slices "$slices" --command "$remote --platform gke -- $train_args" ;;
  slurm)
    run srun --ntasks-per-node=1 bash -c "cd $(printf '%q' "$ROOT") && source scripts/env.sh && python -m trainer.launch --platform slurm -- $train_args" ;;
  local)
    hosts="${pre[0]:?local needs NHOSTS NPROC}"; nproc="${pre[1]:?local needs NHOSTS NPROC}"
    port="${MASTER_PORT:-29511}"; pids=()
    for ((h = 0; h < hosts; h++)); do
      run python -m trainer.launch --platform manual --device cpu --nnodes "$hosts" --node-rank "$h" \
        --master-addr 127.0.0.1 --master-port "$port" --nproc-per-node "$nproc" -- "$@" &
      pids+=($!)
    done
    rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit "$rc" ;;
  *) echo "error: launch_pod.sh: platform $platform; allowed: tpu-vm, xpk, slurm, local" >&2; exit 2 ;;
esac
