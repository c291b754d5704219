"""The graph step with SimpleFSDP on 2 gloo ranks (dp_shard=2) matches one eager process.

Llama 3 debug flavor (2 layers, seq 16), fp32, same global batch (each rank its half), AdamW
(eps 1e-6) + global-norm clipping, 3 steps at a changing lr. Unrolled and layer-scan graphs:
the all-gathers / reduce-scatters are inside the one graph (in the scan body with scan).
Tolerances as tests/unit/test_parallel_training.py: losses 1e-5 relative, weights 1e-5 absolute.
Measured: weights <= 3.5e-6 (both), losses equal to 1e-7.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

from parallelisms import ParallelDims, build_mesh, parallelize_model
from tests.support.parallel_harness import (
    LLAMA3_PLAN,
    Llama3,
    batch,
    full,
    llama3_args,
    lm_loss,
    load_full_state,
    reference_state,
    run_processes,
)
from trainer.graph import build_graph_step
from trainer.graph.passes import ALL_GATHER_LOOKAHEAD

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # ~1-2 min: two compiles per rank

STEPS, EPS, MAX_NORM = 3, 1e-6, 1.0


def _lr(step: int) -> float:
    return 1e-3 * (step + 1) / STEPS


def _reference(state):
    model = Llama3(llama3_args())
    model.load_state_dict(state, strict=False)
    opt = torch.optim.AdamW(model.parameters(), lr=_lr(0), eps=EPS, weight_decay=0.1, foreach=False)
    losses = []
    for s in range(STEPS):
        inputs, labels = batch(4096, batch_size=4, seed=s)
        for g in opt.param_groups:
            g["lr"] = _lr(s)
        opt.zero_grad()
        loss = lm_loss(model(inputs), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _fsdp_model(state, mesh, dims, param_dtype=torch.float32):
    with torch.device("meta"):
        model = Llama3(llama3_args())
    parallelize_model(
        model, plan=LLAMA3_PLAN, parallel_dims=dims, mesh=mesh, param_dtype=param_dtype, reduce_dtype=torch.float32
    )
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    load_full_state(model, state)
    return model


def _train(step, rank: int) -> list[float]:
    """STEPS graph steps on this rank's half of the global batch; the mean loss of each."""
    losses = []
    for s in range(STEPS):
        inputs, labels = batch(4096, batch_size=4, seed=s)
        mb = [(inputs[2 * rank : 2 * rank + 2], labels[2 * rank : 2 * rank + 2])]
        mean = step(mb, _lr(s)).loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / 2)
    return losses


def _graph_on_rank(state, scan_variants):
    dims = ParallelDims(world_size=2, dp_shard=2)
    mesh = build_mesh(dims, "cpu")
    rank = dist.get_rank()
    results = {}
    for scan in scan_variants:
        model = _fsdp_model(state, mesh, dims)
        opt = torch.optim.AdamW(model.parameters(), lr=_lr(0), eps=EPS, weight_decay=0.1, foreach=False)
        step = build_graph_step(
            model=model, optimizer=opt, max_norm=MAX_NORM, backend="aot_eager", scan_layers=scan, plan=LLAMA3_PLAN
        )
        losses = _train(step, rank)
        stats = step.stats
        results[scan] = (
            losses,
            {n: full(p).detach().clone() for n, p in model.named_parameters()},
            dict(stats.collectives),
            stats.scans,
            stats.prefetched_gathers,
        )
    return results


def test_graph_step_simple_fsdp_matches_single_process():
    state = reference_state(n_layers=2)
    ref_losses, ref_params = _reference(state)
    results = run_processes(2, _graph_on_rank, state, (False, True))
    for scan in (False, True):
        losses, params, collectives, scans, prefetched = results[0][scan]
        for a, b in zip(ref_losses, losses):
            assert abs(a - b) <= 1e-5 * abs(a), (scan, ref_losses, losses)
        worst = max((params[n] - ref_params[n]).abs().max().item() for n in ref_params)
        assert worst <= 1e-5, (scan, worst)
        # The FSDP collectives are in the graph: one all-gather per parameter use (the scan
        # body gathers a layer, then gathers it again for the backward), the gradients'
        # reduce-scatters (on gloo as all-to-alls + a sum, gloo_reduce_scatter_pass: the
        # parity above is with them, unrolled and in the scan body), one all-reduce for the
        # global gradient norm.
        assert collectives["all_gather_into_tensor"] >= 12 and collectives["all_to_all_single"] >= 12
        assert "reduce_scatter_tensor" not in collectives, collectives
        assert collectives["all_reduce"] == 1
        assert scans == (2 if scan else 0)
        # Unrolled, the gathers are issued ahead of their use (all but the first move; the
        # losses above are with that order); with scan the gathers are in the body.
        assert prefetched >= (0 if scan else collectives["all_gather_into_tensor"] - ALL_GATHER_LOOKAHEAD), prefetched
    # Both ranks hold the same (gathered) weights.
    for scan in (False, True):
        assert all(torch.equal(results[0][scan][1][n], results[1][scan][1][n]) for n in ref_params)


def _wire_on_rank(state):
    dims = ParallelDims(world_size=2, dp_shard=2)
    mesh = build_mesh(dims, "cpu")
    rank = dist.get_rank()
    results = {}
    for all_to_all in (False, True):
        model = _fsdp_model(state, mesh, dims, param_dtype=torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=_lr(0), eps=EPS, weight_decay=0.1, foreach=False)
        step = build_graph_step(
            model=model,
            optimizer=opt,
            max_norm=MAX_NORM,
            backend="aot_eager",
            plan=LLAMA3_PLAN,
            gloo_all_to_all=all_to_all,
        )
        losses = _train(step, rank)
        wire = Counter(
            str(n.args[0].meta["val"].dtype)
            for n in step.capture.graph_module.graph.nodes
            if n.target is torch.ops._c10d_functional.all_to_all_single.default
        )
        results[all_to_all] = (
            losses,
            {n: full(p).detach().clone() for n, p in model.named_parameters()},
            dict(step.stats.collectives),
            wire,
        )
    return results


def test_gloo_all_to_all_reduce_scatter_is_exact_in_bf16():
    """bf16 params, fp32 reduction (SimpleFSDP's mixed precision): with `gloo_all_to_all` every
    gradient crosses the wire as bf16 (the value before its exact up-cast) and is summed in fp32
    after the all-to-all; with 2 ranks that sum is the same a + b gloo's reduce-scatter computes,
    so losses and weights must be bit-identical to gloo's reduce-scatter (no tolerance)."""
    state = reference_state(n_layers=2)
    results = run_processes(2, _wire_on_rank, state)[0]
    (rs_losses, rs_params, rs_coll, _), (a2a_losses, a2a_params, a2a_coll, wire) = results[False], results[True]
    n_params = len(rs_params)
    assert rs_coll["reduce_scatter_tensor"] == n_params and "all_to_all_single" not in rs_coll, rs_coll
    assert a2a_coll["all_to_all_single"] == n_params and "reduce_scatter_tensor" not in a2a_coll, a2a_coll
    assert wire == {"torch.bfloat16": n_params}, wire
    assert rs_losses == a2a_losses, (rs_losses, a2a_losses)
    assert all(torch.equal(rs_params[n], a2a_params[n]) for n in rs_params)


def _bucketed_on_rank(state, all_to_all):
    dims = ParallelDims(world_size=2, dp_shard=2)
    mesh = build_mesh(dims, "cpu")
    rank = dist.get_rank()
    model = _fsdp_model(state, mesh, dims)
    opt = torch.optim.AdamW(model.parameters(), lr=_lr(0), eps=EPS, weight_decay=0.1, foreach=False)
    step = build_graph_step(
        model=model,
        optimizer=opt,
        max_norm=MAX_NORM,
        backend="inductor",
        plan=LLAMA3_PLAN,
        bucket_cap_mb=1000.0,
        gloo_all_to_all=all_to_all,
    )
    losses, calls = [], Counter()
    for s in range(STEPS):
        inputs, labels = batch(4096, batch_size=4, seed=s)
        mb = [(inputs[2 * rank : 2 * rank + 2], labels[2 * rank : 2 * rank + 2])]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            loss = step(mb, _lr(s)).loss
        if s == STEPS - 1:
            for event in prof.events():
                for kind in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
                    if event.name.startswith(f"_c10d_functional::{kind}"):
                        calls[kind] += 1
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / 2)
    return (
        losses,
        {n: full(p).detach().clone() for n, p in model.named_parameters()},
        dict(step.stats.collectives),
        dict(calls),
    )


@pytest.mark.parametrize(
    "all_to_all",
    [
        # Bucketing is one Inductor pass whatever the wire; the default wire on gloo (all-to-all)
        # runs by default, gloo's own reduce-scatter in the scheduled run.
        pytest.param(False, marks=pytest.mark.exhaustive),
        True,
    ],
    ids=["reduce-scatter", "all-to-all"],
)
def test_inductor_bucketing_merges_fsdp_collectives(all_to_all):
    """`compile.bucket_cap_mb`: with a cap above the model's size, the compiled step runs ONE
    all-gather and ONE reduce-scatter (the captured graph has one per parameter), and still
    matches one eager process. With `gloo_all_to_all` (the CPU default) the reduce-scatters are
    all-to-alls, which Inductor does not bucket: one per parameter, compiled by Inductor.
    Tolerances: losses as above; weights 1e-4 absolute, Inductor's
    (tests/unit/test_graph_step.py::test_inductor_scan_matches_eager: it fuses and reorders fp32 math,
    and AdamW's normalized update can turn a rounding-level gradient change into a visible step
    for near-zero gradients). 1e-4 is 5 % of the most any weight can move here (AdamW moves a
    weight at most ~lr per step: 1e-3 x (1/3 + 2/3 + 1) = 2e-3), so a wrong bucket (a gradient
    reduced into the wrong slice) would still fail it."""
    state = reference_state(n_layers=2)
    ref_losses, ref_params = _reference(state)
    losses, params, captured, calls = run_processes(2, _bucketed_on_rank, state, all_to_all)[0]
    n_params = len(ref_params)
    scatter = "all_to_all_single" if all_to_all else "reduce_scatter_tensor"
    assert captured["all_gather_into_tensor"] == n_params and captured[scatter] == n_params
    assert calls == {"all_gather_into_tensor": 1, scatter: n_params if all_to_all else 1}, calls
    for a, b in zip(ref_losses, losses):
        assert abs(a - b) <= 1e-5 * abs(a), (ref_losses, losses)
    worst = max((params[n] - ref_params[n]).abs().max().item() for n in ref_params)
    assert worst <= 1e-4, worst
