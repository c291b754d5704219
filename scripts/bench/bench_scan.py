#!/usr/bin/env python
"""Step time of the unrolled graph against graph + layer scan, in one process (CPU).

Builds identical Llama 3 models (the `debugmodel` flavor, SimpleFSDP cast only, as the trainer
does on one process) and one graph step per variant:
- graph:            the whole step as one graph, blocks unrolled;
- graph_scan_flip:  layer scan with torch's own backward scan (flipped copies;
                    `scan_reverse_pass` off);
- graph_scan:       layer scan as the trainer runs it with Inductor (`scan_reverse_pass` on);
- graph_scan_sel:   graph_scan with selective activation checkpointing in the scan body (the
                    body saves matmul and attention outputs, recomputes the pointwise ops);
compiles each, then times `--repeats` rounds in which every variant runs one step on the same
batch, interleaved, so load changes on a shared machine hit all variants alike. It reports the
median wall time and the median CPU time of the process per step (`time.process_time`; with
one thread the CPU time is the robust number when other jobs take turns on the cores), the
ratio of each variant's median to the unrolled one and the paired per-round ratios.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench/bench_scan.py --batch 8 --seq 512 --repeats 9
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

from trainer.runtime import cli

VARIANTS = ("graph", "graph_scan_flip", "graph_scan", "graph_scan_sel")


def _parse_args() -> argparse.Namespace:
    """The command line; `--variants` checked against VARIANTS (the list comes back as `a.variants`)."""
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--n-layers", type=int, default=6)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="SimpleFSDP param_dtype")
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument(
        "--host-malloc",
        default="retain",
        choices=["retain", "system"],
        help="glibc malloc policy for the process ([device] host_malloc; the trainer's default on the CPU is retain)",
    )
    p.add_argument("--out", default=None, help="also write the table as CSV here")
    p.add_argument(
        "--ttshape",
        action="store_true",
        help="TorchTitan's debugmodel shape (16 kv heads, vocab 2048, FFN multiple of 256), as "
        "configs/llama3_debug_ttshape.toml",
    )
    a = p.parse_args()
    a.variants = [v for v in a.variants.split(",") if v]
    if unknown := set(a.variants) - set(VARIANTS):
        p.error(f"--variants: unknown {sorted(unknown)}; allowed: {', '.join(VARIANTS)}")
    return a


def _model_args(a: argparse.Namespace):
    """The `debugmodel` flavor at `--n-layers` (TorchTitan's shape with `--ttshape`)."""
    from models.llama3 import FLAVORS

    args = dataclasses.replace(FLAVORS["debugmodel"], n_layers=a.n_layers, max_seq_len=max(a.seq, 2048))
    if a.ttshape:
        args = dataclasses.replace(args, n_kv_heads=16, vocab_size=2048, multiple_of=256)
    return args


def _build_step(variant: str, args, a: argparse.Namespace):
    """One variant's graph step on a freshly initialized model (seed 0, SimpleFSDP cast only)."""
    import torch

    from models.llama3 import Transformer
    from models.llama3.plan import PLAN
    from parallelisms.simple_fsdp import data_parallel
    from trainer.graph import build_graph_step
    from trainer.optim import build_optimizer

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(args)
    data_parallel(model, mesh=None, param_dtype=getattr(torch, a.dtype), reduce_dtype=torch.float32)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    opt = build_optimizer(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    step = build_graph_step(
        model=model,
        optimizer=opt,
        max_norm=1.0,
        backend=a.backend,
        scan_layers=variant != "graph",
        plan=PLAN,
        ac_mode="selective" if variant == "graph_scan_sel" else "none",
    )
    if variant == "graph_scan_flip":
        step.capture.reverse_scans = False
    return step


def _compile_steps(a: argparse.Namespace, args, microbatches) -> dict:
    """{variant: step}, each built and run twice (compile + warm-up), its compile time printed."""
    steps = {}
    for v in a.variants:
        start = time.perf_counter()
        steps[v] = _build_step(v, args, a)
        steps[v](microbatches(), 3e-4)
        steps[v](microbatches(), 3e-4)  # warm-up
        print(f"{v}: compiled in {time.perf_counter() - start:.0f} s, {steps[v].graph_nodes} nodes", flush=True)
    return steps


def _time_rounds(steps: dict, variants: list[str], repeats: int, microbatches) -> tuple[dict, dict]:
    """Per-step wall and CPU seconds ({variant: [s, ...]}), the variants interleaved per round."""
    wall = {v: [] for v in variants}
    cpu = {v: [] for v in variants}
    for _ in range(repeats):
        mbs = microbatches()
        for v in variants:
            t, c = time.perf_counter(), time.process_time()
            float(steps[v](mbs, 3e-4).loss)  # synchronous on the CPU
            wall[v].append(time.perf_counter() - t)
            cpu[v].append(time.process_time() - c)
    return wall, cpu


def _report(a: argparse.Namespace, wall: dict, cpu: dict) -> list[dict]:
    """Print each variant's medians against the first variant's; the same as CSV rows."""
    from trainer.runtime.device import cpu_model

    variants = a.variants
    base = variants[0]
    rows = []
    wall_ms = {v: statistics.median(wall[v]) * 1e3 for v in variants}
    cpu_ms = {v: statistics.median(cpu[v]) * 1e3 for v in variants}
    for v in variants:
        ratio = cpu_ms[v] / cpu_ms[base]
        paired = sorted(b / x for x, b in zip(cpu[base], cpu[v]))
        print(
            f"{v:>16}: wall {wall_ms[v]:8.0f} ms  cpu {cpu_ms[v]:8.0f} ms"
            f"  cpu vs {base} {ratio:.3f} (paired {paired[0]:.2f}..{paired[-1]:.2f})"
        )
        rows.append(
            {
                "cpu_model": cpu_model(),
                "variant": v,
                "batch": a.batch,
                "seq": a.seq,
                "n_layers": a.n_layers,
                "dtype": a.dtype,
                "host_malloc": a.host_malloc,
                "repeats": a.repeats,
                "wall_ms": round(wall_ms[v], 1),
                "cpu_ms": round(cpu_ms[v], 1),
                "wall_vs_base": round(wall_ms[v] / wall_ms[base], 4),
                "cpu_vs_base": round(ratio, 4),
                "base": base,
            }
        )
    return rows


def _write_csv(path: str, rows: list[dict]) -> None:
    """The table as CSV, one row per variant."""
    import csv

    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


def main() -> int:
    a = _parse_args()

    import torch

    import titan_kernels
    from trainer.runtime.device import configure_host_malloc, cpu_model

    # 1. the model shape and the trainer's attention selection
    args = _model_args(a)
    titan_kernels.select(attention="auto", device=torch.device("cpu"))  # as the trainer does
    g = torch.Generator().manual_seed(1)

    def microbatches():
        tokens = torch.randint(0, args.vocab_size, (a.batch, a.seq + 1), generator=g)
        return [(tokens[:, :-1], tokens[:, 1:])]

    malloc = configure_host_malloc(a.host_malloc, torch.device("cpu"))
    print(
        f"cpu: {cpu_model()}; batch {a.batch} x seq {a.seq}, {a.n_layers} layers, {a.dtype}, {a.backend}; "
        f"host malloc {malloc}",
        flush=True,
    )
    # 2. compile every variant, 3. time them interleaved, 4. the table
    steps = _compile_steps(a, args, microbatches)
    wall, cpu = _time_rounds(steps, a.variants, a.repeats, microbatches)
    rows = _report(a, wall, cpu)
    if a.out:
        _write_csv(a.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
