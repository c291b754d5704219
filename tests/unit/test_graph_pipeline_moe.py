"""MoE models through graph mode's pipeline (trainer/graph/pipeline.py `PipelinedLoss(moe=True)`):
each stage's load-balancing loss and expert loads out of the one captured program.

- `live` (default tier): the iterations in which a rank's stage works on a chunk, m per rank, none
  in the bubble; and a bubble iteration's aux term gets an exact zero gradient and its loads count
  nothing (`_moe_terms` on a stand-in stack).
- Qwen 3 MoE (the debug flavor at 6 layers, seq 16, fp32, `moe_expert_bias` on, aux_loss_coef 0.1;
  tests/unit/test_pipeline_moe.py's set-up) on PP 2 in graph mode (2 gloo processes, aot_eager,
  GPipe, uniform stages 3 | 3), 3 AdamW steps, against one process on the same global batch whose
  micro-batches are the pipeline's chunks (the global-batch load-balancing loss counts one chunk's
  tokens, as eager PP's: test_pipeline_moe.py's `_reference`): losses, gradient norms, aux losses,
  MaxVio, the final weights and expert biases; unrolled with 4 chunks (5 iterations, 1 bubble
  iteration per rank), with the iterations as one scan, with the capacity dispatch, with layer
  scan, with 2 accumulation micro-batches, with the first 3 blocks dense (`DenseFirstQwen3`: pp
  rank 0 holds no MoE layer and joins the statistics with zeros), and on PP 2 x EP 2.

Tolerance: test_pipeline_moe.py's (fp32 sums in another order): losses and aux losses 2e-6
relative, gradient norms 1e-5, MaxVio 1e-5 absolute (integer loads), biases 1e-6 (multiples of
the rate 1e-2: any wrong load sign moves one by 2e-2), weights 5 % of lr x steps. What breaks it
(measured 2026-12-07, docs/pipeline_parallel.md "MoE in graph mode"): counting the bubble
iterations (`live` always true) and dropping the aux term's gradient (the coefficient 0 in the
pipeline, 0.1 in the reference); the figures are in the docs' table.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.unit.test_pipeline_moe import AUX_COEF, BATCH, BIAS_RATE, FLAVORS, LR, N_LAYERS, STEPS
from trainer.step import StepRequest, plan_step

SABOTAGE = os.environ.get("TITAN_GRAPH_PP_MOE_SABOTAGE", "")
"""A measurement of what the bounds catch (never set by the suite): "bubble" (every iteration
counted), "noaux" (the pipeline's aux coefficient 0)."""


# ------------------------------------------------------------------------------ the bubble mask, one process


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 2), (3, 5)])
def test_live_iterations_are_each_stage_s_m_chunks(p, m):
    """`PipelinedLoss.live(t)`: rank r works on chunk t - r, so it is live exactly in iterations
    r .. r + m - 1 of the m + p - 1: m live iterations per rank, the p - 1 others its bubble."""
    from trainer.graph.pipeline import PipelinedLoss

    for r in range(p):
        loss = PipelinedLoss(pp_rank=r, pp=p, group_name="", microbatches=m, dim=4, dtype=torch.float32, moe=True)
        live = [bool(loss.live(t)) for t in range(loss.iterations)]
        assert live == [r <= t < r + m for t in range(m + p - 1)], (p, m, r, live)


def test_bubble_iteration_aux_and_load_count_nothing():
    """`_mask` of a stage's aux term and loads: in a live iteration as given (the aux term's gradient
    1), in a bubble iteration zero, its aux term's gradient exactly 0, also where the idle stage's
    value is not finite (the `where`); a rank without MoE layers (None) or a dense model gives
    (None, None)."""
    from trainer.graph.pipeline import PipelinedLoss

    loss = PipelinedLoss(pp_rank=1, pp=2, group_name="", microbatches=2, dim=4, dtype=torch.float32, moe=True)
    w = torch.tensor(3.0, requires_grad=True)
    got = []
    for t, value in enumerate((float("inf"), 2.0, 5.0)):  # rank 1: bubble at t = 0, live at 1 and 2
        aux = w + value if t == 0 else w * value  # the bubble's: not finite (its derivative is)
        got.append(loss._mask(aux, torch.full((2, 4), value), loss.live(t)))
    total = sum(a for a, _ in got)
    (grad,) = torch.autograd.grad(total, w)
    assert total.item() == 3.0 * (2.0 + 5.0) and grad.item() == 2.0 + 5.0, (total, grad)
    assert torch.equal(sum(ld for _, ld in got), torch.full((2, 4), 7.0))
    assert loss._mask(None, None, loss.live(1)) == (None, None)
    dense = PipelinedLoss(pp_rank=1, pp=2, group_name="", microbatches=2, dim=4, dtype=torch.float32)
    assert dense._mask(w * 1.0, torch.ones(2, 4), dense.live(1)) == (None, None)


# ------------------------------------------------------------------------------ Qwen 3 MoE: graph PP == one process


def _graph_moe_worker(family: str, modes, dp: int, accum: int, chunks: int, capacity: float, ep: int = 1, cp: int = 1):
    """On each rank, per mode ("graph": unrolled; "graph_scan": the iterations as one scan;
    "graph_layerscan": each stage's blocks one scan): [(loss, grad norm, aux, MaxVio, dropped)] per
    step (loss and aux averaged over the world, as the trainer logs them) and this rank's final
    state (full). `cp` > 1: each stage's cp ranks hold their shards of every sequence
    (tests/unit/test_pipeline_cp.py `_shard`) and run the CP attention."""
    import torch.distributed as dist

    from models.common import ops
    from parallelisms import ParallelDims, build_mesh
    from parallelisms.context_parallel import cp_attention_fn, cp_group
    from parallelisms.parallel_dims import pp_mesh
    from tests.support.pipeline_runs import full_state
    from tests.unit.test_pipeline_cp import _shard
    from tests.unit.test_pipeline_moe import _batches, _family, _model, _stats
    from trainer.graph import build_graph_step
    from trainer.graph.pipeline import PipelinedLoss
    from trainer.optim.expert_balance import ExpertBalance, StageBalance

    if SABOTAGE == "bubble":
        PipelinedLoss.live = lambda self, t: torch.ones_like(torch.as_tensor(t), dtype=torch.bool)
    out = {}
    world = dist.get_world_size()
    for mode in modes:
        dims = ParallelDims(pp=2, dp_shard=dp, ep=ep, cp=cp, world_size=world)
        mesh = build_mesh(dims, "cpu")
        group = cp_group(mesh["cp"]) if cp > 1 else None
        previous = ops.register("causal_attention", cp_attention_fn(group)) if group is not None else None
        request = StepRequest(
            mode="graph",
            backend="aot_eager",
            pp_degree=2,
            pp_schedule="GPipe",
            pp_microbatches=chunks,
            pp_first_less=0,
            pp_last_less=0,
            model_has_experts=True,
            n_layers=N_LAYERS,
            local_batch=BATCH // dp // accum,
            ep_degree=ep,
            cp_degree=cp,
            scan_layers=mode == "graph_layerscan",
            model_document_mask=True,
            pp_scan_iterations=mode.startswith("graph_scan"),
            ac_mode="full" if mode.endswith("_full") else "none",
        )
        plan = plan_step(request)
        model, opt = _model(family, plan, dims=dims, mesh=mesh, capacity=capacity)
        pp = pp_mesh(mesh)
        loss_fn = PipelinedLoss(
            pp_rank=pp.get_local_rank(),
            pp=2,
            group_name=pp.get_group().group_name,
            microbatches=chunks,
            dim=model.tok_embeddings.weight.shape[1],
            dtype=torch.float32,
            scan=plan.pipeline.scan_iterations,
            moe=True,
            cp=group,
        )
        balance = StageBalance(
            ExpertBalance(model, rate=BIAS_RATE),
            stage_mesh=mesh,
            pp_group=pp.get_group(),
            device=torch.device("cpu"),
            capacity=capacity > 0,
        )
        step = build_graph_step(
            model=model,
            optimizer=opt,
            max_norm=1.0,
            backend="aot_eager",
            grad_accum_steps=accum,
            aux_loss_coef=0.0 if SABOTAGE == "noaux" else AUX_COEF,
            loss_fn=loss_fn,
            pp_mesh=pp,
            balance=balance,
            scan_layers=plan.scan,
            ac_mode=plan.scan_ac,
            plan=_family(family).plan,
        )
        r = dims.dp_rank(mesh)
        runs = []
        for inputs, labels in _batches(family):
            share = slice(r * (BATCH // dp), (r + 1) * (BATCH // dp))
            mine, local = (inputs[share], labels[share]), BATCH // dp // accum
            micro = [(mine[0][i * local : (i + 1) * local], mine[1][i * local : (i + 1) * local]) for i in range(accum)]
            o = step([_shard(m, group) for m in micro] if group is not None else micro, LR)
            means = torch.stack([o.loss.detach(), o.aux_loss.detach()])
            dist.all_reduce(means)
            _, norm, _, vio, dropped = _stats(o)
            runs.append((means[0].item() / world, norm, means[1].item() / world, vio, dropped))
        out[mode] = (runs, full_state(model))
        if group is not None:
            ops.register("causal_attention", previous)
    return out


def _graph_parity(
    nproc: int,
    modes,
    *,
    family: str = "qwen3",
    dp: int = 1,
    accum: int = 1,
    chunks: int = 4,
    capacity: float = 0.0,
    ep: int = 1,
    cp: int = 1,
):
    """`modes` on `nproc` processes == one process (the chunks as its micro-batches); -> the worst
    differences."""
    from tests.support.parallel_harness import run_processes
    from tests.unit.test_pipeline_moe import _reference

    ref_runs, ref_state = _reference(family, dp, accum, chunks, capacity)
    out = run_processes(nproc, _graph_moe_worker, family, modes, dp, accum, chunks, capacity, ep, cp)
    worst = {}
    for mode in modes:
        w = dict(loss=0.0, norm=0.0, aux=0.0, vio=0.0, dropped=0.0, weight=0.0, bias=0.0)
        covered = set()
        for rank_out in out:
            runs, state = rank_out[mode]
            for (loss, norm, aux, vio, dropped), (rl, rn, ra, rv, rd) in zip(runs, ref_runs, strict=True):
                w["loss"] = max(w["loss"], abs(loss - rl) / rl)
                w["norm"] = max(w["norm"], abs(norm - rn) / rn)
                w["aux"] = max(w["aux"], abs(aux - ra) / ra)
                w["vio"] = max(w["vio"], abs(vio - rv))
                w["dropped"] = max(w["dropped"], abs(dropped - rd))
            for k, v in state.items():
                key = "bias" if k.endswith("expert_bias") else "weight"
                w[key] = max(w[key], (v - ref_state[k]).abs().max().item())
                covered.add(k)
        assert covered == set(ref_state), (mode, set(ref_state) - covered)
        worst[mode] = w
        print(
            f"graph PP MoE parity ({family}, {mode}, dp {dp}, ep {ep}, cp {cp}, accum {accum}, chunks {chunks}, capacity {capacity}"
            f"{', sabotage ' + SABOTAGE if SABOTAGE else ''}): " + ", ".join(f"{k} {v:.2e}" for k, v in w.items())
        )
    for mode, w in worst.items():
        assert w["loss"] < 2e-6 and w["aux"] < 2e-6, (mode, w)
        assert w["norm"] < 1e-5, (mode, w)
        assert w["vio"] < 1e-5 and w["dropped"] == 0, (mode, w)
        assert w["bias"] < 1e-6, (mode, w)
        assert w["weight"] < 0.05 * LR * STEPS, (mode, w)
    biases = [v for k, v in ref_state.items() if k.endswith("expert_bias")]
    assert not FLAVORS[family][1] or any(v.abs().max() > 0 for v in biases)  # the biases moved
    assert capacity == 0 or min(r[4] for r in ref_runs) > 0, ref_runs  # the capacity run drops copies
    return worst


@pytest.mark.multiprocess
def test_graph_pp2_moe_equals_one_process():
    """Qwen 3 MoE on graph-mode PP 2, 4 chunks (5 iterations: each rank idle in one), unrolled, with
    the iterations as one scan, and with full AC inside that scan's body (the step plan's `scan_ac`;
    measured 2026-12-07: loss 1.1e-7, norm 2.3e-7, aux 7.7e-8, weights 6.4e-6) == one process; and
    unrolled with the capacity dispatch at factor 1 (copies dropped: each stage's layers' dropped
    counts summed over the pp axis) (scheduled tier)."""
    _graph_parity(2, ("graph", "graph_scan", "graph_scan_full"))
    _graph_parity(2, ("graph",), capacity=1.0)


@pytest.mark.multiprocess
@pytest.mark.parametrize("ep", [1, 2], ids=["cp2", "cp2_ep2"])
def test_graph_pp2_cp2_moe_equals_one_process(ep):
    """Qwen 3 MoE on graph-mode PP 2 x CP 2 (4 processes: each stage's 2 cp ranks hold half of every
    sequence and run the CP attention in every pipeline iteration; the global-batch load-balancing
    counts and the expert loads summed over the stage's ranks, cp included), 4 chunks, unrolled ==
    one process; `cp2_ep2`: the 8 experts split over each stage's 2 cp ranks (scheduled tier)."""
    _graph_parity(4, ("graph",), cp=2, ep=ep)


@pytest.mark.multiprocess
@pytest.mark.parametrize("ep", [1, 2], ids=["cp2", "cp2_ep2"])
def test_graph_pp2_cp2_moe_iteration_scan_equals_one_process(ep):
    """The same PP 2 x CP 2 (and x EP 2) with the pipeline's 5 iterations as one scan
    (`compile.scan_pipeline_iterations`): the scan body takes the stage's parameters as local
    tensors and gathers SimpleFSDP's shards over the cp axis by group name (`_StageBody`), the
    experts split over the cp ranks dispatch with static shapes by group name; == one process
    (scheduled tier)."""
    _graph_parity(4, ("graph_scan",), cp=2, ep=ep)


@pytest.mark.multiprocess
def test_graph_pp2_moe_layer_scan_accumulation_and_dense_first_stage_equal_one_process():
    """Graph-mode PP 2 with layer scan (each stage's 3 MoE blocks one scan per iteration), with 2
    accumulation micro-batches of 2 chunks (the aux gradient's 1 / (chunks x micro-batches)), and
    with a dense first stage (`DenseFirstQwen3`: rank 0's blocks are dense, its graph has no aux
    term or load, and it joins MaxVio's pp-axis reduction with zeros) == one process (scheduled
    tier)."""
    _graph_parity(2, ("graph_layerscan",), chunks=2)
    _graph_parity(2, ("graph",), accum=2, chunks=2)
    _graph_parity(2, ("graph",), family="qwen3_dense_first")


def test_graph_pp_plans_moe_with_expert_parallelism():
    """The rules: graph-mode PP takes a model with experts (uniform stages, GPipe; on a TPU too, with
    layer scan), expert parallelism and context parallelism inside its stages."""

    base = dict(pp_degree=2, pp_schedule="GPipe", pp_first_less=0, pp_last_less=0, mode="graph")
    base.update(model_has_experts=True, n_layers=6, local_batch=4, model_document_mask=True)
    assert plan_step(StepRequest(**base)).pipeline.uniform
    assert plan_step(StepRequest(**base, device_type="tpu", scan_layers=True)).scan
    assert plan_step(StepRequest(**base, ep_degree=2)).pipeline.uniform
    assert plan_step(StepRequest(**base, ep_degree=2, cp_degree=2)).pipeline.uniform


@pytest.mark.multiprocess
def test_graph_pp2_ep2_moe_equals_one_process():
    """Qwen 3 MoE on graph-mode PP 2 x EP 2 (4 processes: dp_shard 2 in each stage, its 8 experts split
    over the stage's 2 ranks; the dispatch and combine all-to-alls in every pipeline iteration, the
    bubble's too, inside the one program), 2 chunks of 2 sequences per rank == one process (scheduled
    tier)."""
    _graph_parity(4, ("graph",), dp=2, ep=2, chunks=2)
