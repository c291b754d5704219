"""MoE dispatch cost per layer: the dropless static dispatch vs the capacity-bounded one.

For each MoE recipe (its flavor, local batch, sequence length, EP degree and `[moe]
capacity_factor`), per device and MoE layer:

- rows: the token copies the layer routes (`M = batch x seq x top_k`), the rows of the dropless
  static dispatch's buffers (`ep x M`: the receive buffer sized for every peer sending all its
  copies here; parallelisms/expert_parallel.py `dispatch_combine_static`, the path a TPU and every
  traced step take) and of the capacity dispatch's (`E x batch x capacity`, about `factor x M`;
  models/common/moe.py);
- buffer bytes (forward + backward): the planner's term for those buffers
  (`planner.memory.ep_dispatch_bytes`: the received rows and the experts' output at `dim`, the
  SwiGLU's gate, up and product at `moe_hidden`, bf16, and their gradients);
- all-to-all bytes leaving the device (dispatch + combine, forward + backward, bf16; `(ep-1)/ep`
  of the rows go to other ranks): dropless moves the real rows with torch-tpu's ragged all-to-all
  (`M`, balanced routing) or the whole buffers without it (`ep x M`); the capacity dispatch moves
  its buffer (about `factor x M`).

"before" is the recipe dropless at the batch the dropless dispatch fits (`--dropless-batch`,
default 2, the recipes' batch before the capacity dispatch); "after" the recipe as shipped.
`--measure` runs the debug recipe's MoE layer through both dispatches on 2 CPU thread ranks
(gloo) and counts the rows the experts are given. `--csv` writes the table.

    python scripts/bench/moe_dispatch_cost.py [--measure] [--csv out.csv]
"""

from __future__ import annotations

import math
import os
import sys

from trainer.runtime import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RECIPES = ("qwen3_30b_a3b_v6e", "qwen3_235b_a22b_v7x", "deepseek_v3_671b_v7x", "kimi_k2_v7x")
BYTES = 2  # bf16 rows
GiB = 2.0**30


def _shape(recipe: str):
    """The recipe's config and its model's shape (as the recipe check builds it)."""
    from tools.recipe_check import plan_inputs
    from trainer.config import build_config

    cfg = build_config(os.path.join(ROOT, "configs", f"{recipe}.toml"))
    return cfg, plan_inputs(cfg).args.shape()


def cost_row(recipe: str, *, dropless_batch: int = 2, dropless_ep: int | None = None) -> dict:
    """One recipe's per-device, per-MoE-layer dispatch costs, before (dropless) and after (as shipped)."""
    from planner.memory import ep_dispatch_bytes

    cfg, shape = _shape(recipe)
    t, p = cfg.training, cfg.parallelism
    ep, seq, batch, factor = p.expert_parallel_degree, t.seq_len, t.local_batch_size, cfg.moe.capacity_factor
    ep_before = dropless_ep or ep
    m_before = dropless_batch * seq * shape.top_k
    m_after = batch * seq * shape.top_k
    capacity = min(seq, math.ceil(factor * seq * shape.top_k / shape.num_experts)) if factor > 0 else 0
    rows_after = shape.num_experts * batch * capacity if factor > 0 else ep * m_after
    # Bytes leaving the device: dispatch + combine, forward + backward; of a rank's rows (balanced
    # routing for the ragged transport) all but the 1/ep addressed to itself.
    a2a = lambda rows, ep: 2 * 2 * rows * shape.dim * BYTES * (ep - 1) / ep  # noqa: E731
    before = ep_dispatch_bytes(shape, tokens=dropless_batch * seq, ep=ep_before)
    after = ep_dispatch_bytes(
        shape, tokens=batch * seq, ep=ep, capacity_factor=factor, local_batch_size=batch, seq_len=seq
    )
    return {
        "recipe": recipe,
        "ep_before": ep_before,
        "ep_after": ep,
        "batch_before": dropless_batch,
        "batch_after": batch,
        "capacity_factor": factor,
        "copies_before": m_before,
        "copies_after": m_after,
        "buffer_rows_before": ep_before * m_before,
        "buffer_rows_after": rows_after,
        "rows_per_copy_before": float(ep_before),
        "rows_per_copy_after": rows_after / m_after,
        "buffer_gib_before": before / GiB,
        "buffer_gib_after": after / GiB,
        "buffer_mib_per_1k_tokens_before": before / 2**20 / (dropless_batch * seq / 1024),
        "buffer_mib_per_1k_tokens_after": after / 2**20 / (batch * seq / 1024),
        "a2a_gib_before_ragged": a2a(m_before, ep_before) / GiB,
        "a2a_gib_before_equal_split": a2a(ep_before * m_before, ep_before) / GiB,
        "a2a_gib_after": a2a(rows_after, ep) / GiB,
    }


def measure_debug(factor: float = 1.25, seed: int = 0) -> dict:
    """Rows the experts get on 2 CPU thread ranks (EP 2), debug MoE shape, random routing: the
    dropless static dispatch's buffer vs the capacity dispatch's."""
    import torch
    import torch.distributed as dist

    from models.common.moe import MoE, use_capacity
    from models.common.plan import ModelPlan
    from models.qwen3 import FLAVORS
    from parallelisms import ParallelDims, build_mesh
    from parallelisms.expert_parallel import apply_ep, dispatch_combine_static

    from thread_world import run_threads

    args = FLAVORS["debugmodel_moe"]
    ep, batch, seq, dim = 2, 8, 512, 8  # the recipe's batch and seq; the row counts do not depend on dim
    plan = ModelPlan(block="layers", ep_block={"moe.experts": "experts"})

    def rank_fn():
        torch.manual_seed(seed + dist.get_rank())
        dims = ParallelDims(dp_shard=ep, ep=ep, world_size=ep)
        mesh = build_mesh(dims, "cpu")
        root = torch.nn.Module()
        root.layers = torch.nn.ModuleDict({"0": torch.nn.Module()})
        with torch.device("meta"):
            moe = MoE(
                dim=dim,
                hidden_dim=16,
                num_experts=args.num_experts,
                top_k=args.num_experts_per_tok,
                norm_topk_prob=True,
            )
        root.layers["0"].moe = moe
        apply_ep(root, plan=plan, parallel_dims=dims, mesh=mesh, param_dtype=torch.float32, reduce_dtype=torch.float32)
        root.to_empty(device="cpu")
        torch.nn.init.normal_(moe.router.gate.weight)
        seen = {}
        experts = moe.experts
        # what the MoE layer calls under EP (models/common/moe.py `weighted_capacity`)
        forward_capacity = type(experts).forward_capacity_weighted

        def count_capacity(self, x, weights):
            seen["capacity"] = x.numel() // dim
            return forward_capacity(self, x, weights)

        type(experts).forward_capacity_weighted = count_capacity
        try:
            x = torch.randn(batch, seq, dim)
            use_capacity(root, factor)
            _, _, load = moe(x)
            seen["dropped"] = int(load[-1])
            flat = torch.topk(torch.rand(batch * seq, args.num_experts), args.num_experts_per_tok).indices.flatten()
            counts = torch.bincount(flat, minlength=args.num_experts)
            rows = torch.randn(flat.numel(), dim)

            def experts_fn(r, sizes):
                seen["dropless"] = r.shape[0]
                return r

            dispatch_combine_static(rows, counts, experts_fn, experts._ep_mesh)
        finally:
            type(experts).forward_capacity_weighted = forward_capacity
        return seen

    per_rank = run_threads(ep, rank_fn)
    return {
        "copies_per_rank": batch * seq * args.num_experts_per_tok,
        "dropless_rows": [r["dropless"] for r in per_rank],
        "capacity_rows": [r["capacity"] for r in per_rank],
        "dropped": [r["dropped"] for r in per_rank],
    }


def main() -> None:
    parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--csv", help="write the table here")
    parser.add_argument("--dropless-batch", type=int, default=2, help="the 'before' local batch (dropless)")
    parser.add_argument("--measure", action="store_true", help="count the debug shape's rows on CPU ranks")
    opts = parser.parse_args()
    if opts.dropless_batch < 1:
        cli.fail(f"--dropless-batch: {opts.dropless_batch}; allowed: >= 1")
    # Before: the dropless recipes as they shipped (2 sequences; DeepSeek-V3 and Kimi K2 at EP 4).
    before_ep = {"deepseek_v3_671b_v7x": 4, "kimi_k2_v7x": 4}
    rows = [cost_row(r, dropless_batch=opts.dropless_batch, dropless_ep=before_ep.get(r)) for r in RECIPES]
    head = (
        f"{'recipe':22} {'ep b/a':>7} {'batch b/a':>9} {'cf':>5} {'buffer rows/copy b/a':>21} "
        f"{'buffers GiB/layer b/a':>22} {'MiB per 1k tokens b/a':>22} {'a2a GiB/layer: ragged':>22} "
        f"{'equal split':>11} {'capacity':>9}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['recipe']:22} {r['ep_before']:>3}/{r['ep_after']:<3} {r['batch_before']:>4}/{r['batch_after']:<4} "
            f"{r['capacity_factor']:>5.2f} {r['rows_per_copy_before']:>10.2f}/{r['rows_per_copy_after']:<10.2f} "
            f"{r['buffer_gib_before']:>10.3f}/{r['buffer_gib_after']:<11.3f} "
            f"{r['buffer_mib_per_1k_tokens_before']:>10.1f}/{r['buffer_mib_per_1k_tokens_after']:<11.1f} "
            f"{r['a2a_gib_before_ragged']:>22.3f} {r['a2a_gib_before_equal_split']:>11.3f} {r['a2a_gib_after']:>9.3f}"
        )
    if opts.measure:
        got = measure_debug()
        print(
            f"measured (debug MoE layer, EP 2, {got['copies_per_rank']} copies per rank): dropless static buffers "
            f"{got['dropless_rows']} rows, capacity 1.25 buffers {got['capacity_rows']} rows, "
            f"dropped {got['dropped']} copies"
        )
    if opts.csv:
        from bench_runs import write_csv

        write_csv(opts.csv, rows)
        print(f"wrote {opts.csv}")


if __name__ == "__main__":
    sys.exit(cli.run(main))
