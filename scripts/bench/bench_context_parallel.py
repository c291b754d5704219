"""Time context-parallel attention (fwd + bwd) on the CPU: cp = 1 against cp = 2 gloo processes.

Rows per sequence length, each run in fresh processes of one thread each:
- `cp1_causal`: one process, the whole sequence, `ops.sdpa_causal_attention` (SDPA with
  `is_causal`, ATen's CPU flash kernel, which skips fully masked blocks): the baseline.
- `cp1_masked`: one process, `context_parallel_attention` on a group of one: the CP code path's
  explicit-mask product without any split (3/4 of the full s x s product, nothing skipped).
- `cp<N>`: N gloo processes, each `context_parallel_attention` on its load-balanced shard (k/v
  all-gathered, their gradients reduce-scattered).
Columns: median over --repeats of the slowest rank's fwd+bwd time (ranks start together at a
barrier); `cpu_ms`: the same for the process CPU time (what the rank computed; on a shared
machine wall time also holds the waits for a core); `gather_ms`: median time of the forward all-gathers of k and v alone; `peak_mib`:
the largest per-process growth of the resident set during the timed calls over the resident
set after warm-up (Linux: VmHWM after resetting it through /proc/self/clear_refs; the inputs
are in the baseline). Prints the CPU model and a table, writes CSV.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench/bench_context_parallel.py \\
        --out docs/results/cpu_context_parallel.csv

`--train-step`: the trainer's whole step instead (`build_job` + the job's eager step, the path
`trainer.train` runs: `LMTask.prepare` shards each window, the cp attention serves the op): the
debug Llama 3 (2 layers, fp32, batch 1) at each sequence length, cp = 1 (one process) against
cp = N (N gloo processes, one thread each). Rounds interleave the variants (round r runs every
(seq, variant) once, in fresh processes: a warm-up step, then `--steps` timed steps); the table
quotes the median over rounds of the slowest rank's step time, the job's tokens/s (window
tokens / step time) and per process (/ N, the trainer's per-device convention), and the
per-process peak resident set: absolute (weights, optimizer, data, activations) and its growth
over the built job's resident set before the first step (activations, gradients, optimizer
state: the step's memory).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench/bench_context_parallel.py --train-step \\
        --seq-lens 4096,8192 --rounds 3 --out docs/results/cpu_context_parallel_train.csv
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from models.common import ops
from parallelisms.context_parallel import (
    CPGroup,
    context_parallel_attention,
    cp_group,
    gather_sequence,
    shard_sequence,
)
from trainer.runtime import cli


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _worker(rank: int, world: int, mode: str, cfg: dict, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        cp = cp_group(dist.group.WORLD)
    else:
        cp = CPGroup(None, 1, 0)  # no collective is issued with one rank
    g = torch.Generator().manual_seed(0)
    b, h, hk, s, d = cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["seq"], cfg["head_dim"]
    q = torch.randn(b, h, s, d, generator=g)
    k, v = (torch.randn(b, hk, s, d, generator=g) for _ in range(2))
    grad_out = torch.randn(b, h, s, d, generator=g)
    if world > 1:
        q, k, v, grad_out = (shard_sequence(t, 2, cp.rank, cp.size) for t in (q, k, v, grad_out))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def step():
        if mode == "causal":
            out = ops.sdpa_causal_attention(q, k, v)
        else:
            out = context_parallel_attention(q, k, v, cp=cp)
        out.backward(grad_out)
        for t in (q, k, v):
            t.grad = None

    def barrier():
        if world > 1:
            dist.barrier()

    step()  # warm-up
    barrier()
    baseline_kib = _status_kib("VmRSS")
    peak_ok = _reset_peak()
    times, cpu_times = [], []
    for _ in range(cfg["repeats"]):
        barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    peak_kib = _status_kib("VmHWM")
    gathers = []
    if world > 1:
        with torch.no_grad():
            for _ in range(cfg["repeats"]):
                barrier()
                t0 = time.perf_counter()
                gather_sequence(k, 2, cp)  # the reorder (a cat) waits for the collective
                gather_sequence(v, 2, cp)
                gathers.append(time.perf_counter() - t0)
    result = {
        "times": times,
        "cpu_times": cpu_times,
        "gathers": gathers,
        "peak_mib": (peak_kib - baseline_kib) / 1024 if peak_ok and peak_kib and baseline_kib else None,
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if world > 1:
        dist.destroy_process_group()


def _train_worker(rank: int, world: int, cfg: dict, init_file: str, out_dir: str) -> None:
    """The trainer's job and step at cp = `world` (every rank a cp rank of one dp group)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from trainer.config import build_config, split_cli
    from trainer.job import build_job

    recipe = "configs/llama3_debug.toml"
    _, _, overrides = split_cli(
        [
            "--config",
            recipe,
            f"--training.seq_len={cfg['seq']}",
            "--model.n_layers=2",
            "--training.local_batch_size=1",
            "--training.global_batch_size=1",
            "--training.mixed_precision_param=float32",
            "--checkpoint.enable=false",
            "--validation.enable=false",
            "--metrics.enable_tensorboard=false",
            f"--job.dump_folder={out_dir}/job",
            f"--parallelism.context_parallel_degree={world}",
            "--parallelism.data_parallel_shard_degree=1",
        ]
    )
    job = build_job(build_config(recipe, overrides), purpose="train")
    step = job.build_step(loss_fn=job.data.task.loss_fn(job.plan.step_plan))

    def run_step():
        batch = tuple(x.to(job.runtime.device) for x in job.data.task.prepare(job.data.loader.next_batch()))
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        out = step([batch], job.scheduler.get_last_lr()[0])
        float(out.loss)  # wait for the step
        return time.perf_counter() - t0, time.process_time() - c0

    # The step's memory: the resident-set peak over the steps (warm-up included: it creates the
    # optimizer state, and the host heap keeps what a step freed, `[device] host_malloc`) over
    # the resident set of the built job (weights, data) before the first step.
    baseline_kib = _status_kib("VmRSS")
    peak_ok = _reset_peak()
    run_step()  # warm-up
    timed = [run_step() for _ in range(cfg["steps"])]
    peak_kib = _status_kib("VmHWM")
    result = {
        "times": [t for t, _ in timed],
        "cpu_times": [c for _, c in timed],
        "peak_mib": peak_kib / 1024 if peak_ok and peak_kib else None,
        "growth_mib": (peak_kib - baseline_kib) / 1024 if peak_ok and peak_kib and baseline_kib else None,
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _run_train(world: int, cfg: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_train_worker, args=(world, cfg, os.path.join(tmp, "pg"), tmp), nprocs=world)
        ranks = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    return {
        "step_s": statistics.median(max(ts) for ts in zip(*(r["times"] for r in ranks))),
        "cpu_s": statistics.median(max(ts) for ts in zip(*(r["cpu_times"] for r in ranks))),
        "peak_mib": max(r["peak_mib"] or 0 for r in ranks),
        "growth_mib": max(r["growth_mib"] or 0 for r in ranks),
    }


def train_step_table(args) -> list[dict]:
    """Rounds x (seq, variant), interleaved; medians over rounds (module docstring)."""
    seqs = list(map(int, args.seq_lens.split(",")))
    variants = [1, *map(int, args.cps.split(","))]
    runs: dict[tuple[int, int], list[dict]] = {}
    for r in range(args.rounds):
        for seq in seqs:
            for cp in variants:
                load = round(os.getloadavg()[0], 2)
                res = _run_train(cp, dict(seq=seq, steps=args.steps))
                res["load"] = load
                runs.setdefault((seq, cp), []).append(res)
                print(
                    f"round {r + 1} seq {seq} cp {cp}: step {res['step_s']:.2f} s (cpu {res['cpu_s']:.2f} s), "
                    f"peak {res['peak_mib']:.0f} MiB (+{res['growth_mib']:.0f}), load before {load}",
                    flush=True,
                )
    rows = []
    for (seq, cp), rs in runs.items():
        step_s = statistics.median(x["step_s"] for x in rs)
        rows.append(
            {
                "seq": seq,
                "cp": cp,
                "processes": cp,
                "rounds": len(rs),
                "step_s": round(step_s, 3),
                "cpu_s": round(statistics.median(x["cpu_s"] for x in rs), 3),
                "tokens_per_s": round(seq / step_s, 1),
                "tokens_per_s_per_process": round(seq / step_s / cp, 1),
                "peak_mib_per_process": round(statistics.median(x["peak_mib"] for x in rs)),
                "step_mib_per_process": round(statistics.median(x["growth_mib"] for x in rs)),
                "load_before_median": statistics.median(x["load"] for x in rs),
            }
        )
    for row in rows:
        base = next(r for r in rows if r["seq"] == row["seq"] and r["cp"] == 1)
        row["speedup_vs_cp1"] = round(base["step_s"] / row["step_s"], 2)
    return rows


def _run(world: int, mode: str, cfg: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, mode, cfg, os.path.join(tmp, "pg"), tmp), nprocs=world)
        ranks = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    slowest = [max(ts) for ts in zip(*(r["times"] for r in ranks))]
    busiest = [max(ts) for ts in zip(*(r["cpu_times"] for r in ranks))]
    gathers = [max(ts) for ts in zip(*(r["gathers"] for r in ranks))] if world > 1 else []
    peaks = [r["peak_mib"] for r in ranks if r["peak_mib"] is not None]
    return {
        "fwd_bwd_ms": round(1e3 * statistics.median(slowest), 1),
        "min_ms": round(1e3 * min(slowest), 1),
        "cpu_ms": round(1e3 * statistics.median(busiest), 1),
        "gather_ms": round(1e3 * statistics.median(gathers), 1) if gathers else "",
        "peak_mib": round(max(peaks), 1) if peaks else "",
    }


def main() -> None:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="8192,16384")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--cps", default="2", help="cp degrees besides the cp = 1 rows")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--train-step",
        action="store_true",
        help="time the trainer's step (debug Llama 3, 2 layers) instead of the attention alone",
    )
    parser.add_argument("--rounds", type=int, default=3, help="--train-step: interleaved rounds")
    parser.add_argument("--steps", type=int, default=1, help="--train-step: timed steps per process")
    args = parser.parse_args()
    from trainer.runtime.device import cpu_model

    if args.train_step:
        print(
            f"CPU: {cpu_model()} ({os.cpu_count()} cores visible); one thread per process; torch "
            f"{torch.__version__}; load average before {os.getloadavg()[0]:.2f}; trainer step, llama3 debugmodel "
            f"2 layers, fp32, batch 1",
            flush=True,
        )
        rows = train_step_table(args)
    else:
        rows = attention_table(args)
    header = list(rows[0])
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(row[h]) for h in header) + " |")
    print(f"load average after {os.getloadavg()[0]:.2f}")
    if args.out:
        with open(args.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["cpu", *header])
            writer.writeheader()
            writer.writerows({"cpu": cpu_model(), **row} for row in rows)


def attention_table(args) -> list[dict]:
    from trainer.runtime.device import cpu_model

    print(
        f"CPU: {cpu_model()} ({os.cpu_count()} cores visible); one thread per process; torch "
        f"{torch.__version__}; load average before {os.getloadavg()[0]:.2f}; fp32, batch {args.batch}, "
        f"heads {args.heads}/{args.kv_heads} (q/kv), head_dim {args.head_dim}",
        flush=True,
    )
    rows = []
    for seq in map(int, args.seq_lens.split(",")):
        cfg = dict(
            batch=args.batch,
            heads=args.heads,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            seq=seq,
            repeats=args.repeats,
        )
        runs = [("cp1_causal", 1, "causal"), ("cp1_masked", 1, "cp")]
        runs += [(f"cp{n}", n, "cp") for n in map(int, args.cps.split(","))]
        for name, world, mode in runs:
            load = round(os.getloadavg()[0], 2)  # 1-minute load average before the row
            row = {"seq": seq, "variant": name, "processes": world, **_run(world, mode, cfg), "load_before": load}
            rows.append(row)
            print(" | ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    for row in rows:  # speedup of the slowest rank over the single-process causal baseline
        base = next(r for r in rows if r["seq"] == row["seq"] and r["variant"] == "cp1_causal")
        row["speedup_vs_cp1"] = round(base["fwd_bwd_ms"] / row["fwd_bwd_ms"], 2)
        row["cpu_speedup_vs_cp1"] = round(base["cpu_ms"] / row["cpu_ms"], 2)
    return rows


if __name__ == "__main__":
    sys.exit(cli.run(main))
