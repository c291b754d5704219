"""The MoE parity table: one layer on EP thread ranks vs one process, dropless and capacity-bounded.

For each (world size, ep) in --meshes and each capacity factor in --factors (0 = dropless), runs
`moe_parity.layer_parity` (8 experts, top-2, routing skewed towards two experts so the
capacity drops copies; CPU thread ranks over gloo, EP x FSDP, fp32) and prints the largest
relative differences (max |a - b| / max |b|) of the outputs, input gradients and parameter
gradients against one process on the same sequences, with the copies each side dropped.

    python scripts/bench/moe_parity_table.py [--meshes 2x1,2x2,4x4,4x2] [--factors 0,1.0,1.25] [--csv out.csv]
"""

from __future__ import annotations

import sys

from trainer.runtime import cli


def _pairs(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in text.split(","):
        world, _, ep = item.partition("x")
        if not (world.isdigit() and ep.isdigit()) or int(world) % int(ep) or int(ep) not in (1, 2, 4, 8):
            cli.fail(f"--meshes: {item!r}; allowed: WORLDxEP with EP in 1, 2, 4, 8 dividing WORLD, e.g. 4x2")
        pairs.append((int(world), int(ep)))
    return pairs


def main() -> None:
    parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--meshes", default="2x1,2x2,4x4,4x2", help="WORLDxEP, comma-separated")
    parser.add_argument("--factors", default="0,1.0,1.25", help="capacity factors (0: dropless)")
    parser.add_argument("--csv", help="write the table here")
    opts = parser.parse_args()
    meshes = _pairs(opts.meshes)
    try:
        factors = [float(f) for f in opts.factors.split(",")]
    except ValueError:
        cli.fail(f"--factors: {opts.factors!r}; allowed: comma-separated numbers >= 0")
    if any(f < 0 for f in factors):
        cli.fail(f"--factors: {opts.factors!r}; allowed: numbers >= 0")
    from moe_parity import layer_parity

    rows = [layer_parity(world_size=w, ep=e, capacity_factor=f) for f in factors for w, e in meshes]
    print(
        f"{'path':>14} {'ranks':>5} {'ep':>3} {'copies':>6} {'dropped 1 proc / ranks':>23} {'out':>9} {'dx':>9} {'grads':>9}"
    )
    for r in rows:
        path = "dropless" if r["capacity_factor"] == 0 else f"capacity {r['capacity_factor']:g}"
        print(
            f"{path:>14} {r['world_size']:>5} {r['ep']:>3} {r['copies']:>6} "
            f"{r['dropped_one_process']:>11} / {r['dropped_ranks']:<9} {r['out']:>9.1e} {r['dx']:>9.1e} {r['grads']:>9.1e}"
        )
    if opts.csv:
        from bench_runs import write_csv

        write_csv(opts.csv, rows)
        print(f"wrote {opts.csv}")


if __name__ == "__main__":
    sys.exit(cli.run(main))
