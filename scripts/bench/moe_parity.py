"""One MoE layer on expert-parallel thread ranks against one process, dropless or capacity-bounded.

`layer_parity(world_size=4, ep=2, capacity_factor=1.0)` builds a small MoE layer (8 experts,
top-2) whose routing is skewed towards experts 0 and 1 (so a capacity drops copies), runs it in
one process on `world_size` sequences, then on `world_size` CPU thread ranks (gloo, EP x FSDP:
`dp_shard = world_size`, `ep`), each on its own sequence, and returns the largest relative
differences of the outputs, input gradients and parameter gradients, and the dropped copies of
both. Used by scripts/bench/moe_parity_table.py (the table in docs/moe.md) and
tests/unit/test_moe_capacity.py (asserts).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

E, K, DIM, HIDDEN, SEQ = 8, 2, 16, 24, 10


class _Layers(nn.Module):
    """The smallest model with a plan: one block holding a MoE layer."""

    def __init__(self):
        from models.common.moe import MoE

        super().__init__()
        self.layers = nn.ModuleDict({"0": nn.Module()})
        self.layers["0"].moe = MoE(dim=DIM, hidden_dim=HIDDEN, num_experts=E, top_k=K, norm_topk_prob=True)


def skewed_case(bs: int, seqlen: int, skew: float, seed: int = 0):
    """A layer whose router reads features 0..7 as expert logits, and inputs pushed towards
    experts 0 and 1 by `skew`; with the output gradient."""
    torch.manual_seed(seed)
    layer = _Layers()
    with torch.no_grad():
        gate = torch.zeros(E, DIM)
        gate[:, :E] = torch.eye(E)
        layer.layers["0"].moe.router.gate.weight.copy_(gate)
    x = torch.randn(bs, seqlen, DIM)
    x[..., :2] += skew
    return layer, x, torch.randn(bs, seqlen, DIM)


def layer_parity(
    *,
    world_size: int,
    ep: int,
    capacity_factor: float,
    skew: float = 1.5,
    dispatch_chunks: int = 1,
    seqs_per_rank: int = 1,
    forward_chunks: bool = False,
) -> dict:
    """Module docstring. `world_size = 1` compares one rank without EP to the same process;
    `dispatch_chunks` sends the ranks' capacity buffers over EP in that many chunks (by sequence
    when it divides `seqs_per_rank`, the sequences each rank holds; by rows otherwise);
    `forward_chunks`: the ranks run `MoE.forward_chunks` on their sequences in `dispatch_chunks`
    chunks (what an MoE block does under `[moe] dispatch_chunks`: models/common/decoder.py)."""
    from models.common.moe import use_capacity
    from models.common.plan import ModelPlan
    from parallelisms import ParallelDims, build_mesh, data_parallel
    from parallelisms.expert_parallel import apply_ep

    from thread_world import full, load_full_state, rel_diff, run_threads

    plan = ModelPlan(block="layers", ep_block={"moe": "moe", "moe.router.gate": "router", "moe.experts": "experts"})
    layer, x, g = skewed_case(world_size * seqs_per_rank, SEQ, skew)
    state = {k: v.detach().clone() for k, v in layer.state_dict().items()}
    use_capacity(layer, capacity_factor)
    xg = x.clone().requires_grad_()
    out, _, load = layer.layers["0"].moe(xg)
    # The data-parallel mean of the ranks' per-sequence losses.
    (out * g).sum().div(world_size).backward()
    want_out, want_dx = out.detach(), xg.grad * world_size
    want_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    want_dropped = int(load[-1]) if capacity_factor > 0 else 0

    def rank_fn():
        rank = dist.get_rank()
        dims = ParallelDims(dp_shard=world_size, ep=ep, world_size=world_size)
        mesh = build_mesh(dims, "cpu")
        with torch.device("meta"):
            model = _Layers()
        use_capacity(model, capacity_factor, chunks=dispatch_chunks)
        if ep > 1:
            apply_ep(
                model, plan=plan, parallel_dims=dims, mesh=mesh, param_dtype=torch.float32, reduce_dtype=torch.float32
            )
        data_parallel(model, mesh=mesh, param_dtype=torch.float32, reduce_dtype=torch.float32)
        model.to_empty(device="cpu")
        load_full_state(model, state)
        mine = slice(rank * seqs_per_rank, (rank + 1) * seqs_per_rank)
        xr = x[mine].clone().requires_grad_()
        if forward_chunks:
            outs, _, load = model.layers["0"].moe.forward_chunks(list(xr.chunk(dispatch_chunks)))
            out = torch.cat(outs)
        else:
            out, _, load = model.layers["0"].moe(xr)
        (out * g[mine]).sum().backward()
        grads = {n: full(p.grad) for n, p in model.named_parameters()}
        return out.detach(), xr.grad, int(load[-1]) if capacity_factor > 0 else 0, grads

    results = run_threads(world_size, rank_fn)
    return {
        "world_size": world_size,
        "ep": ep,
        "capacity_factor": capacity_factor,
        "copies": world_size * seqs_per_rank * SEQ * K,
        "dropped_one_process": want_dropped,
        "dropped_ranks": sum(r[2] for r in results),
        "out": max(
            rel_diff(r[0], want_out[i * seqs_per_rank : (i + 1) * seqs_per_rank]) for i, r in enumerate(results)
        ),
        "dx": max(rel_diff(r[1], want_dx[i * seqs_per_rank : (i + 1) * seqs_per_rank]) for i, r in enumerate(results)),
        "grads": max(rel_diff(r[3][n], w) for r in results for n, w in want_grads.items()),
    }
