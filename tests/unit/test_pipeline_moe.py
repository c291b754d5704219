"""Pipeline parallelism with MoE models and expert parallelism (trainer/step/pipeline.py).

- `attach_aux` on a toy two-stage split in one process: the gradients of every parameter equal the
  whole model's `loss + coef x (aux_1 + aux_2)`, and without the attachment stage 1's aux-only
  parameter gets none (the test can fail).
- Qwen 3 MoE (the debug flavor at 6 layers, seq 16, fp32, `moe_expert_bias` on, aux_loss_coef 0.1)
  on PP 2 (2 gloo processes) and PP 2 x EP 2 (dp_shard 2 in each stage, the experts split over its
  2 ranks; 4 processes), 3 AdamW steps, against one process on the same global batch: losses,
  gradient norms, aux losses, MaxVio and the final weights and expert biases; also on PP 2 x CP 2
  (each stage's cp ranks hold half of every sequence; with and without EP 2) and, with its first 3 blocks dense
  (`DenseFirstQwen3`, DeepSeek style), on PP 2 with a pp rank that holds no MoE layer.

The one-process reference: a pipeline step runs each accumulation micro-batch as `chunks`
pipeline micro-batches, and the global-batch load-balancing loss counts one chunk's tokens (over
the stage's data-parallel ranks), so the matching one-process step accumulates the same chunks as
its micro-batches (chunk k of micro-batch i = every data rank's chunk k of its micro-batch i). The
LM loss, the mean over equal chunks, is the same either way; only the aux term depends on it
(docs/pipeline_parallel.md "MoE and expert parallelism with PP").

Tolerance (fp32; tests/unit/test_pipeline_parallel.py's argument): the same ops on the same
weights, summed in another order (per chunk and stage, gradients summed over chunks, the expert
all-to-all's sums): losses and aux losses 2e-6 relative, gradient norms 1e-5 (measured in
docs/pipeline_parallel.md's table), weights 5 % of lr x steps absolute (AdamW's near-eps elements).
The expert-bias update is `rate x sign(mean - load)` of integer loads: equal routing gives equal
biases exactly; a wrong load (a layer missed, a chunk counted twice, another rank's layers
added) moves some bias by 2 x rate, far outside 1e-6.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainer.step import StepRequest, plan_step

STEPS = 3
LR = 1e-3
N_LAYERS = 6
BATCH = 8
AUX_COEF = 0.1
"""Large enough that dropping a stage's aux-loss gradient moves its routers' gradients (and the norm)
by far more than the bounds."""
BIAS_RATE = 1e-2
"""A bias step that changes some choices within 3 steps (scores ~1/8 apart)."""


# ------------------------------------------------------------------------------ the injection, one process


def test_attach_aux_gives_earlier_stages_the_aux_gradient():
    """Two 'stages' (linear layers, each with an aux term of its own parameters and input) run as a
    pipeline does it (stage 2 on stage 1's detached output, stage 1's backward from the input
    gradient) == the whole `loss + coef x (aux_1 + aux_2)`; without `attach_aux` on stage 1 its
    aux-only parameter gets no gradient."""
    from trainer.step.pipeline import attach_aux

    torch.manual_seed(0)
    w1, w2 = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    g1, g2 = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)  # aux-only ("routers")
    x = torch.randn(3, 4)
    coef, scale = 0.3, 0.5  # scale: 1 / (chunks x micro-batches)

    def stage(w, g, h):
        y = torch.tanh(h @ w)
        return y, torch.softmax(h @ g.diag(), dim=-1).pow(2).mean()

    def grads():
        out = [torch.zeros_like(t) if t.grad is None else t.grad.clone() for t in (w1, w2, g1, g2)]
        for t in (w1, w2, g1, g2):
            t.grad = None
        return out

    h, a1 = stage(w1, g1, x)
    y, a2 = stage(w2, g2, h)
    (scale * (y.sum() + coef * (a1 + a2))).backward()
    want = grads()

    def pipelined(attach_first: bool):
        h1, a1 = stage(w1, g1, x)
        out1 = attach_aux(h1, a1, coef * scale) if attach_first else h1
        recv = out1.detach().requires_grad_(True)
        y, a2 = stage(w2, g2, recv)
        (scale * attach_aux(y, a2, coef * scale).sum()).backward()  # the last stage's loss
        out1.backward(recv.grad)
        return grads()

    got = pipelined(True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    without = pipelined(False)
    assert torch.count_nonzero(without[2]) == 0 and torch.count_nonzero(want[2]) == 4
    torch.testing.assert_close(without[1], want[1], rtol=1e-6, atol=1e-7)  # stage 2 is unaffected


# ------------------------------------------------------------------------------ Qwen 3 MoE: PP (x EP) == one process


FLAVORS = {
    "qwen3": ("debugmodel_moe", {"moe_expert_bias": True}),
    "qwen3_5": ("debugmodel_moe", {}),
    "gpt_oss": ("debugmodel", {}),
    "qwen3_dense_first": ("debugmodel_moe", {"moe_expert_bias": True}),
}
"""The MoE debug flavor of each family PP runs (`PIPELINE_FAMILIES`), with the selection bias where the
family has one; `qwen3_dense_first`: Qwen 3's with dense first blocks (`DenseFirstQwen3`)."""

DENSE_FIRST = 3
"""`DenseFirstQwen3`'s dense blocks: with the trainer's split of 6 layers over 2 stages (3 | 3) pp rank
0 holds no MoE layer (DeepSeek-V3's first_k_dense_replace layout)."""


def _dense_first_cls():
    from models.qwen3 import Transformer

    class DenseFirstQwen3(Transformer):
        """Qwen 3 MoE whose first `DENSE_FIRST` blocks have a dense SwiGLU FFN of `hidden_dim` (no
        registered pipeline family mixes them; DeepSeek-V3's two stacks are not a plain decoder)."""

        def __init__(self, args):
            super().__init__(args)
            dense = Transformer(dataclasses.replace(args, num_experts=0, moe_expert_bias=False, n_layers=DENSE_FIRST))
            for i in range(DENSE_FIRST):
                self.layers[str(i)] = dense.layers[str(i)]

    return DenseFirstQwen3


def _family(family: str):
    from models import FAMILIES

    if family == "qwen3_dense_first":
        return dataclasses.replace(FAMILIES["qwen3"], model_cls=_dense_first_cls())
    return FAMILIES[family]


def _args(family: str):
    from tests.support.parallel_harness import SEQ_LEN

    flavor, extra = FLAVORS[family]
    return dataclasses.replace(_family(family).flavors[flavor], n_layers=N_LAYERS, max_seq_len=SEQ_LEN, **extra)


def _model(family: str, plan, *, dims=None, mesh=None, capacity: float = 0.0):
    """(model, AdamW) of the family's MoE flavor for the step plan on `dims` / `mesh` (one process by
    default), fp32 on CPU from seed 0 (tests/support/pipeline_runs.py `pp_model`);
    `capacity`: `[moe] capacity_factor` (0: dropless)."""
    from tests.support.pipeline_runs import pp_model

    return pp_model(
        _args(family), plan, seed=0, lr=LR, dims=dims, mesh=mesh, family=_family(family), moe_capacity_factor=capacity
    )


def _batches(family: str):
    from tests.support.parallel_harness import batch

    return [batch(_args(family).vocab_size, batch_size=BATCH, seed=10 + i) for i in range(STEPS)]


def _rows(dp_rank: int, dp: int, accum: int, chunks: int, i: int, k: int) -> slice:
    """The global rows of data rank `dp_rank`'s chunk k of its micro-batch i."""
    share = BATCH // dp
    micro = share // accum
    chunk = micro // chunks
    start = dp_rank * share + i * micro + k * chunk
    return slice(start, start + chunk)


def _stats(o) -> tuple[float, ...]:
    """(loss, grad norm, aux, MaxVio, dropped copies) of a step's output (dropped 0 when dropless)."""
    dropped = 0.0 if o.moe_dropped is None else o.moe_dropped.item()
    return o.loss.item(), o.grad_norm.item(), o.aux_loss.item(), o.moe_max_vio.item(), dropped


def _reference(family: str, dp: int, accum: int, chunks: int, capacity: float):
    """One process: per step, accum x chunks micro-batches, micro-batch (i, k) = every data rank's
    chunk k of its micro-batch i; -> ([`_stats`], final state)."""
    from parallelisms import clip_grad_norm_
    from tests.support.pipeline_runs import full_state
    from trainer.optim.expert_balance import ExpertBalance
    from trainer.step import EagerStep

    model, opt = _model(family, plan_step(StepRequest()), capacity=capacity)
    step = EagerStep(
        model=model,
        optimizer=opt,
        max_norm=1.0,
        aux_loss_coef=AUX_COEF,
        clip_grad_norm=clip_grad_norm_,
        balance=ExpertBalance(model, rate=BIAS_RATE),
    )
    out = []
    for inputs, labels in _batches(family):
        micro = []
        for i in range(accum):
            for k in range(chunks):
                rows = [_rows(r, dp, accum, chunks, i, k) for r in range(dp)]
                micro.append((torch.cat([inputs[s] for s in rows]), torch.cat([labels[s] for s in rows])))
        out.append(_stats(step(micro)))
    return out, full_state(model)


def _pp_worker(
    family: str, schedules, dp: int, ep: int, accum: int, chunks: int, capacity: float, cp: int = 1, mode="eager"
):
    """On each rank, for each schedule: the PP run's [`_stats`] (loss and aux averaged over the
    world, as the trainer logs them) and this rank's final state (full). `cp` > 1: each stage's cp
    ranks hold their shards of every sequence (tests/unit/test_pipeline_cp.py `_shard`) and run the
    CP attention. `mode`: the step mode ("compile": the blocks compiled per block, Inductor; then
    also the number of graphs Dynamo had compiled on this rank after each step, `(schedule, "graphs")`)."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from models.common import ops
    from parallelisms import ParallelDims, build_mesh
    from parallelisms.context_parallel import cp_attention_fn, cp_group
    from parallelisms.parallel_dims import pp_mesh
    from tests.support.pipeline_runs import eager_pipeline_step, full_state
    from tests.unit.test_pipeline_cp import _shard
    from trainer.optim.expert_balance import ExpertBalance

    out = {}
    world = dist.get_world_size()
    for schedule in schedules:
        dims = ParallelDims(pp=2, dp_shard=dp, ep=ep, cp=cp, world_size=world)
        mesh = build_mesh(dims, "cpu")
        group = cp_group(mesh["cp"]) if cp > 1 else None
        previous = ops.register("causal_attention", cp_attention_fn(group)) if group is not None else None
        request = StepRequest(
            mode=mode,
            pp_degree=2,
            pp_schedule=schedule,
            pp_microbatches=chunks,
            n_layers=N_LAYERS,
            local_batch=BATCH // dp // accum,
            ep_degree=ep,
            cp_degree=cp,
            model_document_mask=True,  # (Qwen 3 takes RoPE positions: ModelFamily.document_mask)
        )
        plan = plan_step(request)
        torch._dynamo.reset()
        counters.clear()
        model, opt = _model(family, plan, dims=dims, mesh=mesh, capacity=capacity)
        step = eager_pipeline_step(
            model,
            opt,
            plan,
            n_layers=N_LAYERS,
            pp_mesh=pp_mesh(mesh),
            moe=True,
            aux_loss_coef=AUX_COEF,
            balance=ExpertBalance(model, rate=BIAS_RATE),
            stage_mesh=mesh,
            moe_capacity=capacity > 0,
            cp=group,
        )
        r = dims.dp_rank(mesh)
        runs, graphs = [], []
        for inputs, labels in _batches(family):
            share = slice(r * (BATCH // dp), (r + 1) * (BATCH // dp))
            mine, local = (inputs[share], labels[share]), BATCH // dp // accum
            micro = [(mine[0][i * local : (i + 1) * local], mine[1][i * local : (i + 1) * local]) for i in range(accum)]
            o = step(micro if group is None else [_shard(m, group) for m in micro])
            means = torch.stack([o.loss.detach(), o.aux_loss.detach()])
            dist.all_reduce(means)
            _, norm, _, vio, dropped = _stats(o)
            runs.append((means[0].item() / world, norm, means[1].item() / world, vio, dropped))
            graphs.append(counters["stats"]["unique_graphs"])
        out[schedule] = (runs, full_state(model))
        if mode == "compile":
            out[schedule, "graphs"] = graphs
        if group is not None:
            ops.register("causal_attention", previous)
    return out


def _parity(
    nproc: int,
    schedules,
    *,
    family: str = "qwen3",
    dp: int = 1,
    ep: int = 1,
    accum: int = 1,
    chunks: int = 4,
    capacity: float = 0.0,
    cp: int = 1,
    mode: str = "eager",
    results: list | None = None,
):
    """`schedules` on `nproc` processes == one process (`results`, if given, receives each rank's
    `_pp_worker` output)."""
    from tests.support.parallel_harness import run_processes

    ref_runs, ref_state = _reference(family, dp, accum, chunks, capacity)
    out = run_processes(nproc, _pp_worker, family, schedules, dp, ep, accum, chunks, capacity, cp, mode)
    if results is not None:
        results.extend(out)
    worst = dict(loss=0.0, norm=0.0, aux=0.0, vio=0.0, dropped=0.0, weight=0.0, bias=0.0)
    for schedule in schedules:
        covered = set()
        for rank_out in out:
            runs, state = rank_out[schedule]
            for (loss, norm, aux, vio, dropped), (rl, rn, ra, rv, rd) in zip(runs, ref_runs, strict=True):
                worst["loss"] = max(worst["loss"], abs(loss - rl) / rl)
                worst["norm"] = max(worst["norm"], abs(norm - rn) / rn)
                worst["aux"] = max(worst["aux"], abs(aux - ra) / ra)
                worst["vio"] = max(worst["vio"], abs(vio - rv))
                worst["dropped"] = max(worst["dropped"], abs(dropped - rd))
            for k, v in state.items():
                key = "bias" if k.endswith("expert_bias") else "weight"
                worst[key] = max(worst[key], (v - ref_state[k]).abs().max().item())
                covered.add(k)
        assert covered == set(ref_state), (schedule, set(ref_state) - covered)
    print(
        f"pipeline MoE parity ({family}, {schedules}, dp {dp}, ep {ep}, cp {cp}, capacity {capacity}, {mode}): "
        + ", ".join(f"{k} {v:.2e}" for k, v in worst.items())
    )
    assert worst["loss"] < 2e-6 and worst["aux"] < 2e-6, worst
    assert worst["norm"] < 1e-5, worst
    assert worst["vio"] < 1e-5 and worst["dropped"] == 0, worst  # integer loads: equal routing, equal values
    assert worst["bias"] < 1e-6, worst  # multiples of BIAS_RATE: any wrong sign is 1e-2 or more
    assert worst["weight"] < 0.05 * LR * STEPS, worst
    biases = [v for k, v in ref_state.items() if k.endswith("expert_bias")]
    assert not FLAVORS[family][1] or any(v.abs().max() > 0 for v in biases)  # the biases moved
    assert capacity == 0 or min(r[4] for r in ref_runs) > 0, ref_runs  # the capacity run drops copies
    return worst


@pytest.mark.multiprocess
def test_pp2_moe_equals_one_process():
    """Qwen 3 MoE on PP 2 (2 processes), 1F1B and ZBVZeroBubble (two stages per rank in V order: rank
    0 holds layers 0 and 5), 4 chunks of 2 sequences == one process; and 1F1B with the capacity
    dispatch at factor 1 (per-sequence capacity: the same copies drop in a chunk as in the batch;
    the dropped count summed over the pp ranks' layers) (scheduled tier)."""
    _parity(2, ("1F1B", "ZBVZeroBubble"))
    _parity(2, ("1F1B",), capacity=1.0)


@pytest.mark.multiprocess
def test_pp2_ep2_moe_equals_one_process():
    """Qwen 3 MoE on PP 2 x EP 2 (dp_shard 2 per stage, its 8 experts split over the stage's 2 ranks;
    4 processes), 1F1B and Interleaved1F1B, 2 chunks of 2 sequences per rank == one process; and 1F1B
    with 2 accumulation micro-batches of 2 chunks (the aux gradient's 1 / (chunks x micro-batches))
    (scheduled tier)."""
    _parity(4, ("1F1B", "Interleaved1F1B"), dp=2, ep=2, chunks=2)
    _parity(4, ("1F1B",), dp=2, ep=2, accum=2, chunks=2)


@pytest.mark.multiprocess
def test_pp2_other_moe_families_equal_one_process():
    """Qwen 3.5 MoE (Gated DeltaNet and gated attention blocks, a gated shared expert) and gpt-oss
    (sinks, sliding windows, its own experts) on PP 2, 1F1B, 4 chunks == one process: the other
    families `PIPELINE_FAMILIES` lets through with experts (scheduled tier)."""
    _parity(2, ("1F1B",), family="qwen3_5")
    _parity(2, ("1F1B",), family="gpt_oss")


@pytest.mark.multiprocess
def test_pp2_dense_first_stage_moe_equals_one_process():
    """A MoE whose first 3 of 6 blocks are dense (`DenseFirstQwen3`, DeepSeek style) on PP 2: pp rank 0
    holds the embedding and the dense blocks only (no aux loss, no expert load) and joins the pp-axis
    reduction of MaxVio and the dropped copies with zeros; 1F1B, 4 chunks, dropless and with the
    capacity dispatch at factor 1 == one process: losses, gradient norms, aux losses, MaxVio and the
    dropped copies as every rank (rank 0 included) reports them, the weights and the expert biases
    (scheduled tier)."""
    from parallelisms.pipeline_parallel import PipelinePlan

    plan = PipelinePlan(pp=2, schedule="1F1B", num_virtual=1, microbatches=4)
    assert plan.rank_layers(N_LAYERS, 0) == list(range(DENSE_FIRST))  # rank 0: dense blocks only
    _parity(2, ("1F1B",), family="qwen3_dense_first")
    _parity(2, ("1F1B",), family="qwen3_dense_first", capacity=1.0)


@pytest.mark.multiprocess
def test_pp2_cp2_moe_equals_one_process():
    """Qwen 3 MoE on PP 2 x CP 2 (4 processes: each stage's 2 cp ranks hold half of every sequence,
    the global-batch load-balancing counts and the expert loads summed over the stage's ranks),
    1F1B, 4 chunks, dropless, without and with EP 2 (the experts split over the stage's 2 cp ranks)
    == one process (scheduled tier)."""
    _parity(4, ("1F1B",), cp=2)
    _parity(4, ("1F1B",), cp=2, ep=2)
