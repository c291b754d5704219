#!/usr/bin/env bash
# One-shot GPU benchmark (CUDA): the debug recipe and a Llama 3 8B-shaped model with fewer
# layers, eager vs torch.compile vs graph vs graph + scan, through scripts/benchmark.py; then the same
# 8B-shaped model with float8_rowwise linears (`[quantize]`, torch._scaled_mm, sm89+) against bf16.
# Usage: OUT=results_dir bash scripts/bench/bench_gpu.sh   (results: $OUT/*.csv, $OUT/*.log)
set -uo pipefail
OUT="${OUT:-outputs/bench_gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; "$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"; } 2>&1 | tee "$OUT/env.log"
common=(--nproc 1 --max-busy 1.0 --max-wait 0 --timeout 300)
# 1. The debug model at TorchTitan's debug shape (seq 2048, batch 8).
"$PY" scripts/benchmark.py --config configs/llama3_debug.toml --variants eager,compile --repeats 2 --steps 12 --warmup 4 \
  "${common[@]}" --out "$OUT/debug_gpu.csv" -- --device.type=cuda --training.seq_len=2048 --training.local_batch_size=8 \
  2>&1 | tee "$OUT/debug_gpu.log"
# 2. Llama 3 8B shapes (dim 4096, 32 heads, 8 kv heads, ffn 14336, vocab 128256), 4 layers, seq 4096.
"$PY" scripts/benchmark.py --config configs/llama3_debug.toml --variants eager,compile,graph,graph_scan --repeats 1 \
  --steps 10 --warmup 4 "${common[@]}" --out "$OUT/llama8b_l4_gpu.csv" -- --device.type=cuda --model.flavor=8B \
  --model.n_layers=4 --training.seq_len=4096 --training.local_batch_size=2 --activation_checkpoint.mode=none \
  2>&1 | tee "$OUT/llama8b_l4_gpu.log"
# 3. Low precision (docs/low_precision.md): the same 8B-shaped model, bf16 against float8_rowwise
# linears (every block linear; the head stays bf16), eager and compile, runs interleaved.
fp8="--quantize.recipe=float8_rowwise"
"$PY" scripts/benchmark.py --config configs/llama3_debug.toml --variants eager,compile \
  --variant "eager_float8_rowwise=--compile.mode=eager $fp8" --variant "compile_float8_rowwise=--compile.mode=compile $fp8" \
  --repeats 1 --steps 10 --warmup 4 "${common[@]}" --out "$OUT/llama8b_l4_float8_gpu.csv" -- --device.type=cuda \
  --model.flavor=8B --model.n_layers=4 --training.seq_len=4096 --training.local_batch_size=2 \
  --activation_checkpoint.mode=none 2>&1 | tee "$OUT/llama8b_l4_float8_gpu.log"
