#!/usr/bin/env bash
# Start a recipe on every host of a job; each host runs `python -m trainer.launch`, which reads
# its place in the job from the platform and starts torchrun with a static rendezvous
# (docs/launch.md). The code and the venv must be at the same path on every host.
#
#   scripts/launch_pod.sh tpu-vm NAME ZONE [PROJECT] -- --config configs/llama3_8b_v6e.toml [--k=v ...]
#       every worker of a TPU VM slice, over `gcloud compute tpus tpu-vm ssh --worker=all`
#   scripts/launch_pod.sh xpk CLUSTER WORKLOAD TPU_TYPE NUM_SLICES -- --config ...
#       a GKE workload through XPK (one pod per TPU host; GKE sets TPU_WORKER_HOSTNAMES/TPU_WORKER_ID,
#       and with NUM_SLICES > 1 the MEGASCALE_* variables the launcher derives the job's ranks from)
#   scripts/launch_pod.sh qr QUEUED_RESOURCE ZONE [PROJECT] -- --config ...
#       every worker of every slice (node) of a TPU VM queued resource, over
#       `gcloud compute tpus queued-resources ssh --node=all --worker=all`; a multislice one has the
#       MEGASCALE_* variables in each VM's tpu-env metadata (docs/launch.md, "Several slices")
#   scripts/launch_pod.sh slurm -- --config ...
#       inside an sbatch allocation: one launcher per node with srun, one process per GPU
#   scripts/launch_pod.sh local NHOSTS NPROC -- --config ...
#       simulate NHOSTS hosts on this machine (loopback, NPROC processes each)
#   scripts/launch_pod.sh host ENV [LAUNCHER OPTIONS] -- --config ...
#       what the platforms above run on each host: `source scripts/env.sh ENV` (tpu; base: no
#       extras; none: the python on PATH as it is), then the launcher, with SIGTERM/SIGINT passed
#       on to it. LAUNCH_POD_HOST_ENV overrides the ENV the platforms pass (tpu; slurm: base).
# Set DRY_RUN=1 to print what would run.
#
# Exit codes (docs/launch.md): 0 every host succeeded; 75 every host's launcher exited 75
# (preempted, checkpoints written: relaunch resumes); 2 bad input; else non-zero, never 75.
# SIGTERM/SIGINT to this script is passed to the launchers it started (local), to srun (which
# passes it to its tasks) or to gcloud's ssh sessions. Each host prints
# `launch_pod.sh: host NAME exit CODE`. With xpk this script ends when the workload is submitted;
# the pods' exit codes are the launchers' (75 on preemption), for the workload's restart policy.
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then  # this header, as the usage
  echo "usage: scripts/launch_pod.sh tpu-vm|qr|xpk|slurm|local|host ... -- --config RECIPE.toml [--section.key=value ...]"
  sed -n '2,/^set -euo pipefail/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
  exit 0
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
platform="${1:?usage: scripts/launch_pod.sh tpu-vm|qr|xpk|slurm|local|host ... -- TRAIN ARGS}"
shift
pre=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do pre+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
refuse() {  # refuse WHAT ALLOWED: one `error:` line, exit 2 (nothing started)
  echo "error: launch_pod.sh: $platform: $1; allowed: $2 (scripts/launch_pod.sh --help)" >&2; exit 2
}
words() {  # words MIN MAX USAGE: the platform's own arguments before --, none of them an option
  local w
  for w in ${pre[@]+"${pre[@]}"}; do
    case "$w" in -*) refuse "unknown option $w" "$3; options of the run go after --" ;; esac
  done
  if [ ${#pre[@]} -lt "$1" ] || [ ${#pre[@]} -gt "$2" ]; then
    refuse "${#pre[@]} arguments before -- (${pre[*]:-none})" "$3"
  fi
}
case "$platform" in
  host) [ ${#pre[@]} -ge 1 ] && [[ "${pre[0]}" != -* ]] || refuse "no ENV before the launcher options (${pre[*]:-none})" \
          "host ENV [LAUNCHER OPTIONS] -- ... with ENV tpu, base or none" ;;
  tpu-vm|qr) words 2 3 "$platform NAME ZONE [PROJECT] -- ..." ;;
  xpk) words 3 4 "xpk CLUSTER WORKLOAD TPU_TYPE [NUM_SLICES] -- ..."
       [[ "${pre[3]:-1}" =~ ^[1-9][0-9]*$ ]] || refuse "NUM_SLICES ${pre[3]}" "a slice count >= 1" ;;
  slurm) words 0 0 "slurm -- ... (inside an sbatch allocation)" ;;
  local) words 2 2 "local NHOSTS NPROC -- ..."
         [[ "${pre[0]}" =~ ^[1-9][0-9]*$ && "${pre[1]}" =~ ^[1-9][0-9]*$ ]] || refuse "NHOSTS NPROC ${pre[*]}" "two counts >= 1" ;;
esac
[ $# -gt 0 ] || { echo "error: launch_pod.sh: nothing to train; allowed: ... -- --config RECIPE.toml" >&2; exit 2; }
train_args=$(printf '%q ' "$@")
run() { if [ "${DRY_RUN:-0}" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi; }
host_cmd() {  # the command line each host runs: $1 = env (tpu, base, none), then launcher options
  local env="${LAUNCH_POD_HOST_ENV:-$1}"; shift
  printf '%q ' bash "$ROOT/scripts/launch_pod.sh" host "$env" "$@" --; printf '%s' "$train_args"
}

combine() {  # the job's exit code from each host's: all 0 -> 0, all 75 -> 75, any 2 -> 2, else the first failure
  local all0=1 all75=1 bad=0 first=""
  for c in "$@"; do
    [ "$c" = 0 ] || all0=0; [ "$c" = 75 ] || all75=0; [ "$c" = 2 ] && bad=1
    if [ -z "$first" ] && [ "$c" != 0 ] && [ "$c" != 75 ]; then first=$c; fi
  done
  if [ $# -eq 0 ]; then echo 1; elif [ $all0 = 1 ]; then echo 0; elif [ $all75 = 1 ]; then echo 75
  elif [ $bad = 1 ]; then echo 2; elif [ -n "$first" ]; then echo "$first"; else echo 1; fi
}

nsig=0
waited=0
wait_for() {  # wait_for PID: its exit code in $waited; waits again when a (trapped) signal interrupted the wait
  local n
  while :; do
    n=$nsig
    wait "$1" && waited=0 || waited=$?
    if [ "$n" = "$nsig" ] || [ "$waited" -le 128 ]; then return; fi
  done
}

codes_in() {  # the host exit codes printed in log $1
  sed -n 's/.*launch_pod\.sh: host .* exit \([0-9][0-9]*\)$/\1/p' "$1"
}

case "$platform" in
  host)
    env="${pre[0]:?host needs ENV (tpu, base or none)}"
    cd "$ROOT"
    case "$env" in
      none) ;;
      base) set +u; source scripts/env.sh; set -u ;;
      *) set +u; source scripts/env.sh "$env"; set -u ;;
    esac
    pid=""
    trap 'nsig=$((nsig + 1)); [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null || true' TERM
    trap 'nsig=$((nsig + 1)); [ -n "$pid" ] && kill -INT "$pid" 2>/dev/null || true' INT
    python -m trainer.launch "${pre[@]:1}" -- "$@" &
    pid=$!
    wait_for "$pid"; rc=$waited
    echo "launch_pod.sh: host ${HOSTNAME:-$(uname -n)} exit $rc" >&2
    # srun returns the highest code of its tasks: a failure must rank above 75 there, so that
    # one crashed host and others preempted is not 75 (slurm below maps 76/77 back).
    if [ "${LAUNCH_POD_RANKED:-0}" = 1 ]; then
      case "$rc" in 0|75) exit "$rc" ;; 2) exit 77 ;; *) exit 76 ;; esac
    fi
    exit "$rc" ;;
  tpu-vm|qr)
    name="${pre[0]:?$platform needs NAME ZONE}"; zone="${pre[1]:?$platform needs NAME ZONE}"
    project=(); [ -n "${pre[2]:-}" ] && project=(--project "${pre[2]}")
    cmd=$(host_cmd tpu --platform tpu-vm)
    ssh=(gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" "${project[@]}" --worker=all)
    [ "$platform" = qr ] && ssh=(gcloud compute tpus queued-resources ssh "$name" --zone "$zone" "${project[@]}" --node=all --worker=all)
    if [ "${DRY_RUN:-0}" = 1 ]; then run "${ssh[@]}" --command "$cmd"; exit 0; fi
    log=$(mktemp); trap 'rm -f "$log"' EXIT
    pid=""
    trap 'nsig=$((nsig + 1)); [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null || true' TERM INT
    "${ssh[@]}" --command "$cmd" 2> >(tee -a "$log" >&2) &
    pid=$!
    wait_for "$pid"; rc=$waited
    sleep 0.2  # the tee of gcloud's stderr
    # gcloud's own code for many workers is not documented: the hosts' lines decide when present.
    mapfile -t codes < <(codes_in "$log")
    if [ ${#codes[@]} -gt 0 ]; then exit "$(combine "${codes[@]}")"; fi
    [ "$rc" = 75 ] && rc=1
    exit "$rc" ;;
  xpk)
    cluster="${pre[0]:?xpk needs CLUSTER WORKLOAD TPU_TYPE NUM_SLICES}"; workload="${pre[1]:?}"
    tpu_type="${pre[2]:?}"; slices="${pre[3]:-1}"
    run xpk workload create --cluster "$cluster" --workload "$workload" --tpu-type "$tpu_type" \
      --num-slices "$slices" --command "$(host_cmd tpu --platform gke)" ;;
  slurm)
    cmd="LAUNCH_POD_RANKED=1 $(host_cmd base --platform slurm)"
    if [ "${DRY_RUN:-0}" = 1 ]; then run srun --ntasks-per-node=1 bash -c "$cmd"; exit 0; fi
    pid=""
    trap 'nsig=$((nsig + 1)); [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null || true' TERM INT
    srun --ntasks-per-node=1 bash -c "$cmd" &
    pid=$!
    wait_for "$pid"; rc=$waited
    case "$rc" in 0|75) exit "$rc" ;; 77) exit 2 ;; 76) exit 1 ;; *) exit "$rc" ;; esac ;;
  local)
    hosts="${pre[0]:?local needs NHOSTS NPROC}"; nproc="${pre[1]:?local needs NHOSTS NPROC}"
    port="${MASTER_PORT:-29511}"; pids=()
    trap 'nsig=$((nsig + 1)); for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done' TERM INT
    for ((h = 0; h < hosts; h++)); do
      launcher=(python -m trainer.launch --platform manual --device cpu --nnodes "$hosts" --node-rank "$h"
                --master-addr 127.0.0.1 --master-port "$port" --nproc-per-node "$nproc" -- "$@")
      if [ "${DRY_RUN:-0}" = 1 ]; then run "${launcher[@]}"; continue; fi
      "${launcher[@]}" &  # the launcher itself (not a subshell around it): the trap signals it
      pids+=($!)
    done
    [ "${DRY_RUN:-0}" = 1 ] && exit 0
    codes=()
    for p in "${pids[@]}"; do wait_for "$p"; codes+=("$waited"); done
    exit "$(combine "${codes[@]}")" ;;
  *) echo "error: launch_pod.sh: platform $platform; allowed: tpu-vm, qr, xpk, slurm, local, host" >&2; exit 2 ;;
esac
