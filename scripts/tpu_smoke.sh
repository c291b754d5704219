#!/usr/bin/env bash
# First run on a TPU VM: install the [tpu] extra, train the Llama 3 debug recipe in eager, compile
# and graph + scan modes on the TPU and once on the CPU as a reference, and write one report.
#   scripts/tpu_smoke.sh [STEPS]          (default 20 steps; report in outputs/tpu_smoke/report.md)
# Needs Python 3.11 (torch-tpu 0.2.0 is a cp311 wheel) and a TPU VM. It has not run on a TPU yet:
# on CI it is only syntax-checked (bash -n). Nothing here is specific to one TPU generation.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
STEPS="${1:-20}"
OUT="$ROOT/outputs/tpu_smoke"
VENV="${TITAN_VENV:-$ROOT/.venv-tpu}"
PY="${PYTHON:-python3.11}"
mkdir -p "$OUT"

"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
  || { echo "error: tpu_smoke.sh needs Python 3.11 (set PYTHON=...): torch-tpu 0.2.0 is cp311 only" >&2; exit 2; }
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/pip" install -q -e "$ROOT[tpu]"
export PATH="$VENV/bin:$PATH" OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"

COMMON=(--config configs/llama3_debug.toml --training.steps="$STEPS" --metrics.log_freq=1
        --checkpoint.enable=false --validation.enable=false --metrics.enable_tensorboard=false)

# CPU reference: torch-tpu stays unloaded (autoload off), one process.
echo "== cpu reference" >&2
TORCH_DEVICE_BACKEND_AUTOLOAD=0 python -m trainer.train "${COMMON[@]}" --device.type=cpu \
  --job.dump_folder="$OUT/cpu" >"$OUT/cpu.log" 2>&1 || echo "cpu reference failed: see $OUT/cpu.log" >&2

# TPU runs: torch-tpu's launch environment, then one process per device (docs/tpu.md).
export TORCH_DEVICE_BACKEND_AUTOLOAD=1
python -m torch.tpu.distributed >"$OUT/launch_env.txt" 2>&1 || true
eval "$(sed -n 's/^\([A-Z_][A-Z0-9_]*=\)/export \1/p' "$OUT/launch_env.txt")"
NPROC="${WORLD_SIZE:-1}"
# One process per device, but the same global batch as the CPU run (8 sequences), so the
# losses compare: 8 / NPROC sequences per device when it divides, else 1 process.
if [ $((8 % NPROC)) -ne 0 ]; then NPROC=1; fi
LOCAL_BATCH=$((8 / NPROC))
for MODE in eager compile graph; do
  EXTRA=(--compile.mode="$MODE")
  [ "$MODE" = graph ] && EXTRA+=(--compile.scan_layers=true)
  echo "== tpu $MODE ($NPROC processes)" >&2
  torchrun --standalone --nproc_per_node="$NPROC" -m trainer.train "${COMMON[@]}" "${EXTRA[@]}" \
    --device.type=tpu --training.local_batch_size="$LOCAL_BATCH" --job.dump_folder="$OUT/$MODE" \
    >"$OUT/$MODE.log" 2>&1 || echo "tpu $MODE failed: see $OUT/$MODE.log" >&2
done

python - "$OUT" <<'PY' >"$OUT/report.md"
import importlib.metadata as md, json, pathlib, platform, sys

out = pathlib.Path(sys.argv[1])
def version(p):
    try:
        return md.version(p)
    except md.PackageNotFoundError:
        return "not installed"
def metrics(name):
    f = out / name / "metrics.jsonl"
    return [json.loads(l) for l in f.read_text().splitlines() if l.strip()] if f.exists() else []

print("# TPU smoke report\n")
print("python " + platform.python_version() + ", " + ", ".join(f"{p} {version(p)}" for p in ("torch", "torch-tpu", "libtpu", "jax")))
print("\n## Topology (python -m torch.tpu.distributed)\n\n```\n" + (out / "launch_env.txt").read_text().strip() + "\n```\n")
cpu = metrics("cpu")
print("| run | steps | final loss | loss vs cpu | compile/setup s (step 1) | median step s | tokens/s/device | MFU % |")
print("|---|---|---|---|---|---|---|---|")
for name in ("cpu", "eager", "compile", "graph"):
    rows = metrics(name)
    if not rows:
        print(f"| {name} | failed (see {name}.log) | | | | | | |")
        continue
    last = rows[-1]
    times = sorted(b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rows[1:], rows[2:]))
    median = times[len(times) // 2] if times else float("nan")
    vs_cpu = (f"{last['loss'] - cpu[-1]['loss']:+.4f}" if cpu and len(cpu) == len(rows) else "-")
    first = rows[0].get("compile_s", rows[0].get("setup_s", ""))
    print(f"| {name} | {last['step']} | {last['loss']:.4f} | {vs_cpu} | {first} | {median:.4f} | "
          f"{last.get('tokens_per_sec', 0):.0f} | {last.get('mfu_pct')} |")
print("\nbf16 parameters on both devices: a final-loss difference of a few 1e-2 is rounding; "
      "larger, or a loss that does not fall, is a bug.")
PY
echo "report: $OUT/report.md" >&2
cat "$OUT/report.md"
