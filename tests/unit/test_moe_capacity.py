"""The capacity-bounded MoE dispatch (`[moe] capacity_factor`, models/common/moe.py).

- `capacity_slots`: per (sequence, expert) at most `capacity` copies, first choices before second
  choices, then by position; kept slots distinct; the rest dropped.
- Nothing dropped (capacity = seq): output, input gradient and every parameter gradient equal the
  dropless layer's (fp32).
- Copies dropped: the layer equals a token-by-token reference written from the rule (fp32), and
  the dropped count it reports is the reference's.
- Mesh independence: one process on the global batch and EP 2 / EP 4 (ranks as threads, gloo,
  EP x FSDP), each rank on its own sequences, drop the same copies and give the same outputs, input
  gradients, parameter gradients and aux loss (the layer is per sequence; the data-parallel mean
  of the ranks' losses is the one-process loss).

Tolerance: fp32 throughout; the paths differ only in the summation order of the same products
(bmm over capacity rows vs grouped or per-token matmuls, the all-to-all's gradient sums), each
result a sum of at most a few hundred products of O(1) terms: relative error a few 1e-7, bounded
here by 1e-5 (the EP tests' TOL).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.common.moe import MoE, capacity_slots, expert_capacity, use_capacity

from moe_parity import E, K, layer_parity, skewed_case
from thread_world import rel_diff

TOL = 1e-5


def test_expert_capacity():
    assert expert_capacity(seq_len=4096, top_k=8, num_experts=128, factor=1.25) == 320
    assert expert_capacity(seq_len=10, top_k=2, num_experts=8, factor=1.0) == 3  # ceil(2.5)
    assert expert_capacity(seq_len=10, top_k=8, num_experts=8, factor=4.0) == 10  # never above seq


def test_capacity_slots_follow_the_rule():
    # One sequence of 4 tokens, k = 2, 3 experts, capacity 2.
    selected = torch.tensor([[[0, 1], [1, 0], [0, 2], [0, 1]]])
    slots = capacity_slots(selected, num_experts=3, capacity=2).view(4, 2)
    dump = 3 * 1 * 2
    # Expert 0: first choices of tokens 0, 2, 3 then the second choice of token 1: tokens 0 and 2
    # keep it (slots 0, 1), token 3's first choice and token 1's second choice are dropped.
    assert slots[0, 0] == 0 and slots[2, 0] == 1 and slots[3, 0] == dump and slots[1, 1] == dump
    # Expert 1: token 1's first choice, then second choices of tokens 0 and 3 (position order).
    assert slots[1, 0] == 2 and slots[0, 1] == 3 and slots[3, 1] == dump
    assert slots[2, 1] == 4  # expert 2: token 2's second choice


@pytest.mark.parametrize(
    "bs, seqlen, num_experts, top_k, capacity", [(3, 40, 8, 2, 6), (2, 33, 6, 4, 1), (1, 9, 4, 1, 2)]
)
def test_capacity_slots_random(bs, seqlen, num_experts, top_k, capacity):
    g = torch.Generator().manual_seed(0)
    selected = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(bs * seqlen)]).view(
        bs, seqlen, top_k
    )
    slots = capacity_slots(selected, num_experts, capacity)
    dump = num_experts * bs * capacity
    kept = slots[slots != dump]
    assert kept.unique().numel() == kept.numel()  # distinct slots
    flat = selected.reshape(-1)
    seq = torch.arange(bs).repeat_interleave(seqlen * top_k)
    for b in range(bs):
        for e in range(num_experts):
            mine = (seq == b) & (flat == e)
            want = min(int(mine.sum()), capacity)
            assert int((slots[mine] != dump).sum()) == want
            # Every kept slot lies in this (expert, sequence) block of the buffer.
            block = slots[mine & (slots != dump)] // capacity
            assert (block == e * bs + b).all()


def _run(moe: MoE, x: torch.Tensor, grad_out: torch.Tensor):
    x = x.clone().requires_grad_()
    out, aux, load = moe(x)
    ((out * grad_out).sum() + 0.1 * aux).backward()
    return out.detach(), x.grad, aux.detach(), load


def test_no_drop_equals_dropless():
    layer, x, g = skewed_case(2, 12, skew=0.0)
    moe = layer.layers["0"].moe
    want_out, want_dx, want_aux, want_load = _run(moe, x, g)
    want_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    assert use_capacity(layer, float(E)) == 1  # capacity = seq: nothing can drop
    out, dx, aux, load = _run(moe, x, g)
    assert load.shape == (E + 1,) and load[-1] == 0 and torch.equal(load[:-1], want_load)
    assert rel_diff(out, want_out) < TOL and rel_diff(dx, want_dx) < TOL and torch.allclose(aux, want_aux)
    for n, p in layer.named_parameters():
        assert rel_diff(p.grad, want_grads[n]) < TOL, n


def _reference(moe: MoE, x: torch.Tensor, factor: float):
    """Token by token from the documented rule: per (sequence, expert) keep copies by choice rank,
    then position, up to the capacity; a kept copy adds weight x SwiGLU_e(token)."""
    bs, seqlen, dim = x.shape
    flat = x.reshape(-1, dim)
    weights, experts, _ = moe.router(flat)
    experts = experts.view(bs, seqlen, K)
    weights = weights.view(bs, seqlen, K)
    cap = expert_capacity(seq_len=seqlen, top_k=K, num_experts=E, factor=factor)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    out = torch.zeros_like(x)
    dropped = 0
    for b in range(bs):
        used = [0] * E
        for j in range(K):
            for t in range(seqlen):
                e = int(experts[b, t, j])
                if used[e] >= cap:
                    dropped += 1
                    continue
                used[e] += 1
                h = F.silu(x[b, t] @ w1[e].T) * (x[b, t] @ w3[e].T)
                out[b, t] = out[b, t] + weights[b, t, j] * (h @ w2[e].T)
    return out, dropped


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_dropping_equals_token_reference(factor):
    layer, x, g = skewed_case(2, 12, skew=2.0)
    moe = layer.layers["0"].moe
    x = x.requires_grad_()
    want_out, want_dropped = _reference(moe, x, factor)
    ((want_out * g).sum()).backward()
    want_dx = x.grad.clone()
    want_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    assert want_dropped > 0  # the skew really overflows experts 0 and 1
    layer.zero_grad()
    use_capacity(layer, factor)
    x2 = x.detach().clone().requires_grad_()
    out, _, load = moe(x2)
    (out * g).sum().backward()
    assert int(load[-1]) == want_dropped
    assert rel_diff(out, want_out) < TOL and rel_diff(x2.grad, want_dx) < TOL
    for n, p in layer.named_parameters():
        assert rel_diff(p.grad, want_grads[n]) < TOL, n


@pytest.mark.parametrize("factor", [0.0, 1.0])
@pytest.mark.parametrize("world_size, ep", [(2, 2), (4, 4), (4, 2)])
def test_capacity_is_mesh_independent(world_size, ep, factor):
    """EP (x FSDP) ranks, one sequence each, against one process on all the sequences; the
    dropless layer (factor 0) on the same skewed routing beside it."""
    got = layer_parity(world_size=world_size, ep=ep, capacity_factor=factor)
    assert (got["dropped_one_process"] > 0) == (factor > 0)  # the skew really overflows experts 0, 1
    assert got["dropped_ranks"] == got["dropped_one_process"]  # counted per rank, the same copies
    assert got["out"] < TOL and got["dx"] < TOL and got["grads"] < TOL, got


@pytest.mark.parametrize("world_size, ep, chunks, seqs", [(2, 2, 2, 1), (4, 2, 3, 1), (2, 2, 2, 4), (4, 4, 4, 4)])
def test_dispatch_chunks_are_mesh_independent(world_size, ep, chunks, seqs):
    """`[moe] dispatch_chunks`: the capacity buffer sent over EP in chunks gives the one-process
    layer's outputs and gradients, the same bound as unchunked (every row meets the same products,
    only the matmuls' row counts differ). One sequence per rank (capacity ceil(1.0 x 10 x 2 / 8) = 3
    rows per expert): chunks that do not divide the batch split the rows, 2 + 1 or 1 + 1 + 1; four
    per rank: the chunk-major layout, whole sequences per chunk (2 x 2, 4 x 1)."""
    got = layer_parity(world_size=world_size, ep=ep, capacity_factor=1.0, dispatch_chunks=chunks, seqs_per_rank=seqs)
    assert got["dropped_one_process"] > 0 and got["dropped_ranks"] == got["dropped_one_process"]
    assert got["out"] < TOL and got["dx"] < TOL and got["grads"] < TOL, got


def test_forward_chunks_are_mesh_independent():
    """`MoE.forward_chunks` (the MoE block under `[moe] dispatch_chunks`: each chunk of sequences
    routed, dispatched over EP and combined on its own, the router weights applied on the expert's
    rank) on thread ranks against one process's `forward` on every sequence: EP 4, 2 chunks of 2
    sequences per rank; the same copies dropped, outputs and gradients within the bound of the
    unchunked path (the same products, other row counts in the matmuls)."""
    got = layer_parity(world_size=4, ep=4, capacity_factor=1.0, dispatch_chunks=2, seqs_per_rank=4, forward_chunks=True)
    assert got["dropped_one_process"] > 0 and got["dropped_ranks"] == got["dropped_one_process"]
    assert got["out"] < TOL and got["dx"] < TOL and got["grads"] < TOL, got


@pytest.mark.parametrize("routing", ["learned", "random"])
def test_forward_chunks_equal_forward(routing):
    """One process: `forward_chunks` on the batch in 2 chunks equals `forward` on all of it, the
    auxiliary loss and the load (dropped copies last) included; under random routing each chunk's
    tokens draw by their place in the whole batch (the routing key's first token), not in the chunk."""
    from models.common.moe import set_routing_key, use_routing

    layer, x, g = skewed_case(4, 12, skew=2.0)
    moe = layer.layers["0"].moe
    use_capacity(layer, 1.0)
    if routing != "learned":
        use_routing(layer, routing)
        set_routing_key(layer, seed=3, step=1, first_token=48)
    x1 = x.clone().requires_grad_()
    out, aux, load = moe(x1)
    (out * g).sum().add(aux).backward()
    want = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    x2 = x.clone().requires_grad_()
    outs, aux2, load2 = moe.forward_chunks(list(x2.chunk(2)))
    (torch.cat(outs) * g).sum().add(aux2).backward()
    assert load[-1] > 0 and torch.equal(load, load2)
    assert rel_diff(torch.cat(outs), out) < TOL and rel_diff(aux2, aux) < TOL and rel_diff(x2.grad, x1.grad) < TOL
    for n, p in layer.named_parameters():
        assert rel_diff(p.grad, want[n]) < TOL, n


def test_capacity_drops_bench_counts_the_layers_rule():
    """scripts/bench/capacity_drops.py (the drop shares docs/moe.md quotes): the balanced draw fills
    every expert exactly (nothing dropped at factor 1), the random draw overflows some at 1 and
    fewer at a larger factor, and a factor of E / k (capacity = seq) drops nothing."""
    from capacity_drops import dropped_share

    shape = dict(experts=8, top_k=2, batch=2, seq=64, layers=2)
    assert dropped_share(**shape, factor=1.0, routing="balanced") == 0
    tight, loose = (dropped_share(**shape, factor=f, routing="random") for f in (1.0, 1.5))
    assert tight > loose and tight > 0.01
    assert dropped_share(**shape, factor=4.0, routing="random") == 0


def test_capacity_drops_expected_share_by_hand():
    """capacity_drops.py's closed form: 2 tokens, 2 experts, top 1, capacity 1: an expert's count is
    Binomial(2, 1/2), one copy dropped when both tokens pick it (1/4): E[(X - 1)+] / E[X] = 1/4.
    At the Qwen3-235B shape the trainer's draw stays near it (factor 1: 2.4 % by the binomial)."""
    from capacity_drops import dropped_share, expected_share

    assert expected_share(experts=2, top_k=1, factor=1.0, seq=2) == pytest.approx(0.25)
    assert expected_share(experts=2, top_k=1, factor=2.0, seq=2) == 0.0
    # 8 sequences x 128 experts = 1,024 (sequence, expert) cells, each over its capacity of 32 by
    # 2.2 copies on average (sd about 3): the share's standard error is about 4 % of it; 30 % is 7 of them
    want = expected_share(experts=128, top_k=8, factor=1.0, seq=512)
    got = dropped_share(experts=128, top_k=8, factor=1.0, batch=8, seq=512, layers=1, routing="random")
    assert got == pytest.approx(want, rel=0.3)
