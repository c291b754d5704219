"""MoE EP dispatch cost: expert FLOPs per step and all-to-all bytes, old padded vs static vs minimum.

For each recipe (its model flavor, local batch, sequence length and EP degree) this prints, per
device and training step (forward + backward = 3x the forward matmul FLOPs, all MoE layers):

- expert FLOPs of the grouped matmuls for the unpadded minimum (the real token copies; balanced
  routing, so every rank's experts get `M = tokens x top_k` rows on average), for the old
  padded dispatch (removed: its `ep x M`-row worst-case buffer joined the last expert's group,
  so the grouped matmul computed all of it), and for the static dispatch (the group sizes cover
  the real rows only: the minimum);
- all-to-all bytes (dispatch + combine, forward + backward, bf16 rows) for the ragged eager
  dispatch and torch-tpu's `ragged_all_to_all` (real rows only), and for the equal-split
  all-to-all of the worst-case buffers (old padded dispatch and the static dispatch's portable
  path);
- the static dispatch's receive buffer per MoE layer (worst case: every peer sends it all).

`--measure` also runs the debug recipe's MoE layer shape (one layer, random routing) through
`dispatch_combine_static` on CPU thread ranks and counts the rows its experts are given, next
to the old dispatch's `ep x M` rows. Writes CSV with `--csv`.

    python scripts/bench/moe_dispatch_cost.py [--measure] [--csv out.csv]
"""

from __future__ import annotations

import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from models.qwen3 import FLAVORS  # noqa: E402
from trainer.runtime import cli  # noqa: E402

BYTES = 2  # bf16 rows on the wire (the recipes' param dtype)
# (recipe, flavor, local batch, seq, ep): the pod recipes' own settings; the debug recipe at
# the EP degree docs/expert_parallel.md launches it with.
RECIPES = (
    ("qwen3_moe_debug.toml (ep 2)", "debugmodel_moe", 8, 512, 2),
    ("qwen3_30b_a3b_v6e.toml", "30B-A3B", 2, 4096, 16),
    ("qwen3_235b_a22b_v7x.toml", "235B-A22B", 2, 4096, 32),
)


def cost_row(recipe: str, flavor: str, batch: int, seq: int, ep: int) -> dict:
    """One recipe's per-device, per-step costs (module docstring)."""
    args = FLAVORS[flavor]
    copies = batch * seq * args.num_experts_per_tok  # M: this rank's token copies per layer
    per_row = 3 * 2 * 3 * args.dim * args.moe_hidden_dim  # 3 matmuls, 2 FLOP/MAC, fwd+bwd = 3x
    layers = args.n_layers
    minimum = copies * per_row * layers
    padded_rows = ep * copies
    a2a = lambda rows: 2 * 2 * rows * args.dim * BYTES * layers  # noqa: E731 - dispatch+combine, fwd+bwd
    return {
        "recipe": recipe,
        "ep": ep,
        "rows_per_layer_min": copies,
        "rows_per_layer_old": padded_rows,
        "rows_per_layer_new": copies,
        "expert_tflop_min": minimum / 1e12,
        "expert_tflop_old": padded_rows * per_row * layers / 1e12,
        "expert_tflop_new": minimum / 1e12,
        "old_over_min": padded_rows / copies,
        "new_over_min": 1.0,
        "a2a_gib_ragged": a2a(copies) / 2**30,
        "a2a_gib_equal_split": a2a(padded_rows) / 2**30,
        "recv_buffer_gib_per_layer": padded_rows * args.dim * BYTES / 2**30,
    }


def measure_debug(routing_seed: int = 0) -> dict:
    """Rows the experts get from `dispatch_combine_static`, debug MoE shape, 2 CPU thread ranks."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from parallelisms.expert_parallel import dispatch_combine_static
    from tools.thread_world import run_threads

    args = FLAVORS["debugmodel_moe"]
    ep, tokens, top_k, num_experts = 2, 8 * 512, args.num_experts_per_tok, args.num_experts
    dim = 8  # the row counts do not depend on the width

    def rank_fn():
        torch.manual_seed(routing_seed + dist.get_rank())
        mesh = init_device_mesh("cpu", (ep,))
        experts = torch.topk(torch.rand(tokens, num_experts), top_k).indices.flatten()
        counts = torch.bincount(experts, minlength=num_experts)
        x = torch.randn(tokens * top_k, dim)
        seen = []

        def experts_fn(rows, sizes):
            seen.append((rows.shape[0], int(sizes.sum())))
            return rows

        dispatch_combine_static(x, counts, experts_fn, mesh)
        return seen[0]

    per_rank = run_threads(ep, rank_fn)
    return {
        "buffer_rows": [b for b, _ in per_rank],
        "covered_rows": [c for _, c in per_rank],
        "copies_per_rank": tokens * top_k,
    }


def main() -> None:
    parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--csv", help="write the table here")
    parser.add_argument("--measure", action="store_true", help="count the debug shape's rows on CPU ranks")
    opts = parser.parse_args()
    rows = [cost_row(*recipe) for recipe in RECIPES]
    print(
        f"{'recipe':30} {'ep':>3} {'expert TFLOP/step: min':>23} {'old padded':>11} {'new':>9} "
        f"{'old/min':>7} {'a2a GiB: real rows':>19} {'equal split':>12} {'recv buf GiB/layer':>19}"
    )
    for r in rows:
        print(
            f"{r['recipe']:30} {r['ep']:>3} {r['expert_tflop_min']:>23.3f} {r['expert_tflop_old']:>11.2f} "
            f"{r['expert_tflop_new']:>9.3f} {r['old_over_min']:>6.0f}x {r['a2a_gib_ragged']:>19.2f} "
            f"{r['a2a_gib_equal_split']:>12.2f} {r['recv_buffer_gib_per_layer']:>19.3f}"
        )
    if opts.measure:
        got = measure_debug()
        print(
            f"measured (debug MoE layer, ep 2, random routing): experts given {got['covered_rows']} real rows "
            f"of buffers of {got['buffer_rows']} rows per rank ({got['copies_per_rank']} copies sent per rank); "
            f"the old padded dispatch gave them the whole buffer"
        )
    if opts.csv:
        with open(opts.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {opts.csv}")


if __name__ == "__main__":
    sys.exit(cli.run(main))
