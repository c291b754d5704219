"""Graph-mode Muon on sharded matrix stacks: all-to-all to whole matrices vs gathering the stack.

For each rank count D (gloo processes on this CPU) and each stack shape B x m x n (B matrices,
e.g. layers x experts, rows split over the D ranks as SimpleFSDP splits them), times on every
rank, in interleaved repeats:

- `all_to_all`: the product's `trainer.graph.optim.orthogonalize_sharded` (each rank receives
  ceil(B/D) whole matrices, orthogonalises them, sends the rows back);
- `gather`: the previous scheme, written out here for the comparison: all-gather the whole stack,
  orthogonalise all B matrices on every rank, keep this rank's rows.

Both run eagerly (the same functional collectives the captured step holds) with fp32 Newton-
Schulz. Reports the median wall ms per call (max over ranks), the elements each rank receives (both
all-to-alls together; the one all-gather) and
the whole matrices it holds at once, and the max |difference| of the two results. Prints a table
and writes a CSV.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench/bench_muon_sharded.py --ranks 2,4 \\
        --out docs/results/muon_sharded
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch

from trainer.runtime import cli
from trainer.runtime.device import cpu_model

from bench_runs import write_csvs

NS_STEPS = 5


def _gather_variant(u: torch.Tensor, group, full: int, index: int, size: int) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol

    from trainer.optim.muon import newton_schulz5, update_scale

    chunk = -(-full // size)
    rows = u.shape[-2]
    if rows != chunk:
        u = torch.nn.functional.pad(u, [0, 0, 0, chunk - rows])
    whole = funcol.all_gather_tensor(u, u.ndim - 2, group).narrow(-2, 0, full)
    o = newton_schulz5(whole, steps=NS_STEPS, dtype=torch.float32) * update_scale(whole.shape)
    start = min(index * chunk, full)
    return o.narrow(-2, start, min(full, start + chunk) - start).clone()


def _rank(rank: int, world: int, init_file: str, shapes: list[tuple[int, int, int]], repeats: int, out: str):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from trainer.graph.optim import muon_shards, orthogonalize_sharded

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    rows_out = []
    for b, m, n in shapes:
        whole = torch.randn(b, m, n, generator=torch.Generator().manual_seed(0))
        dt = distribute_tensor(whole, mesh, [Shard(1)])
        u, shards = dt.to_local(), muon_shards(dt)
        variants = {
            "all_to_all": lambda: orthogonalize_sharded(u, shards, steps=NS_STEPS, dtype=torch.float32),
            "gather": lambda: _gather_variant(u, (mesh, 0), m, rank, world),
        }
        results = {name: fn() for name, fn in variants.items()}  # warm-up, and the comparison
        diff = (results["all_to_all"] - results["gather"]).abs().max().item() if u.numel() else 0.0
        times = {name: [] for name in variants}
        for r in range(repeats):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for name in order:
                dist.barrier()
                t0 = time.perf_counter()
                o = variants[name]()
                o.sum().item()  # wait for the collective's result
                times[name].append(time.perf_counter() - t0)
        per_rank = -(-b // world)
        chunk = -(-m // world)
        for name, ts in times.items():
            rows_out.append(
                {
                    "ranks": world,
                    "stack": f"{b}x{m}x{n}",
                    "variant": name,
                    "median_ms": 1000 * statistics.median(ts),
                    "received_elems": (
                        per_rank * chunk * n * (world - 1) * 2 if name == "all_to_all" else b * chunk * n * (world - 1)
                    ),
                    "whole_matrices_held": per_rank if name == "all_to_all" else b,
                    "max_abs_diff": diff,
                }
            )
    torch.save(rows_out, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def main() -> None:
    ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4", help="comma-separated gloo process counts")
    ap.add_argument(
        "--shapes",
        default="16x512x1536,64x256x768,3x1024x1024",
        help="comma-separated BxMxN stacks (B matrices of M rows x N columns, rows sharded)",
    )
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="docs/results/muon_sharded", help="CSV prefix")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    table = []
    for world in (int(r) for r in args.ranks.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            torch.multiprocessing.spawn(
                _rank, args=(world, os.path.join(tmp, "pg"), shapes, args.repeats, tmp), nprocs=world
            )
            per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
        for i, row in enumerate(per_rank[0]):
            row = dict(
                row,
                median_ms=max(rows[i]["median_ms"] for rows in per_rank),
                max_abs_diff=max(rows[i]["max_abs_diff"] for rows in per_rank),
                cpu=cpu_model(),
            )
            table.append(row)
    print(
        f"CPU: {cpu_model()}; fp32 Newton-Schulz ({NS_STEPS} steps); median of {args.repeats} interleaved "
        "repeats, slowest rank"
    )
    print(
        f"{'ranks':>5} {'stack':>14} {'variant':>10} {'ms':>9} {'recv elems/rank':>16} {'matrices held':>13} "
        f"{'max |diff|':>10}"
    )
    for r in table:
        print(
            f"{r['ranks']:>5} {r['stack']:>14} {r['variant']:>10} {r['median_ms']:>9.1f} {r['received_elems']:>16,} "
            f"{r['whole_matrices_held']:>13} {r['max_abs_diff']:>10.1e}"
        )
    write_csvs(args.out, {"": table})


if __name__ == "__main__":
    sys.exit(cli.run(main))
