"""The planner's pipeline with MoE and CP (issue 53; planner/pipeline.py): a pp rank holds the
experts of its own layers (EP inside the stage), its capacity rows per MoE block and micro-batch in
flight, a dense first stage holds no experts, and the search takes pp x ep and pp x cp where the
trainer's rules do (eager on cpu/cuda), never on a TPU target (graph mode refuses them)."""

import dataclasses

import pytest

import planner as P
from models import get_model_family
from planner.memory import capacity_saved_delta, expert_rows
from planner.pipeline import PipelineSpec, stage_stats
from planner.search import make_parallel_dims
from planner.shard import fake_process_group, shard_model
from trainer.step import StepRequest
from trainer.step.plan import refusals

QWEN3 = get_model_family("qwen3")
LLAMA = get_model_family("llama3")
EAGER = StepRequest(mode="eager", device_type="cuda", model_has_experts=True)
GRAPH = StepRequest(mode="graph", device_type="tpu", pp_schedule="GPipe", pp_first_less=0, pp_last_less=0)


def _inputs(family, args, step, *, seq=256, batch=4, **pipe):
    return P.PlanInputs(family, args, "tiny", seq, batch, step=dataclasses.replace(step, **pipe))


def test_pp2_ep2_rank_holds_its_layers_experts_and_capacity_rows_by_hand():
    """Qwen 3 debugmodel_moe (6 MoE blocks, dim 256, 8 experts of width 256, top 2, vocab 4096) on
    h100-4 as PP 2 x EP 2 (a stage of 2 devices: FSDP 2, EP 2). Each pp rank holds 3 blocks: per
    device the 4 experts of its EP rank (not FSDP-sharded: efsdp 1) and half of the rest, plus half
    the embedding (rank 0) or the head and final norm (rank 1). With `[moe] capacity_factor` 1.25
    the rank keeps its 3 MoE blocks' buffer rows for each of GPipe's 4 micro-batches in flight (one
    sequence each); before, the whole model's 6 blocks once (12 against 6 here)."""
    args = QWEN3.flavors["debugmodel_moe"]
    d, e, f, v = args.dim, args.num_experts, args.moe_hidden_dim, args.vocab_size
    attention = d * 256 + 2 * d * 128 + 256 * d + 2 * 32 + 2 * d  # wq, wk, wv, wo, q/k norms, 2 block norms
    block = 3 * (e // 2) * d * f + (attention + e * d) // 2  # experts of one EP rank; the rest over FSDP 2
    hand = {0: 3 * block + v * d // 2, 1: 3 * block + v * d // 2 + d // 2}
    dims = make_parallel_dims(
        dp_replicate=1, dp_shard=-1, tp=1, ep=2, pp=2, world_size=4, shape=args.shape(), seq_len=256
    )
    with fake_process_group(4):
        stats = shard_model(QWEN3, args, dims)
    spec = PipelineSpec(pp=2, schedule="GPipe", microbatches=4)
    assert [stage_stats(stats, spec, r).param_numel for r in (0, 1)] == [hand[0], hand[1]]

    step = dataclasses.replace(EAGER, pp_schedule="GPipe", pp_degree=2, pp_microbatches=4, ep_degree=2)
    target = P.parse_target("h100-4")
    dropless = P.plan_estimate(_inputs(QWEN3, args, step), target, pp=2, ep=2)
    capacity = P.plan_estimate(
        _inputs(QWEN3, args, dataclasses.replace(step, moe_capacity_factor=1.25)), target, pp=2, ep=2
    )
    c = capacity.pipeline
    assert c.rank_layers == (3, 3) and c.micro_batch == 1 and c.in_flight == 4
    assert capacity.params == 4 * hand[c.rank]  # fp32 master weights of the heaviest rank
    tokens = 256  # one sequence per micro-batch
    rows = expert_rows(args.shape(), tokens=tokens, ep=2, capacity_factor=1.25, local_batch_size=1, seq_len=256)
    kept = capacity_saved_delta(args.shape(), rows=rows, tokens=tokens)
    assert kept > 0
    assert capacity.activations.blocks - dropless.activations.blocks == 4 * 3 * kept


def test_a_dense_first_stage_holds_no_experts():
    """DeepSeek-V3 debugmodel cut to 4 blocks (2 dense, then 2 MoE; priced with the rules off: its
    decoder is not one the pipeline cuts yet) as PP 2 x EP 2 on h100-4, stages 2 + 2: rank 0 holds the
    dense stack's blocks only, rank 1 the MoE stack's (before, half of both on each). By hand: an MoE
    block minus a dense one per device is the router and shared expert over FSDP 2 and 4 routed
    experts (EP 2), minus the dense FFN over FSDP 2. The imbalance weighs each block by its own
    FLOPs: here a dense block (a 512-wide FFN) outweighs an MoE one (3 active experts of 128)."""
    args = dataclasses.replace(get_model_family("deepseek_v3").flavors["debugmodel"], n_layers=4, n_dense_layers=2)
    family = get_model_family("deepseek_v3")
    dims = make_parallel_dims(
        dp_replicate=1, dp_shard=-1, tp=1, ep=2, pp=2, world_size=4, shape=args.shape(), seq_len=256
    )
    with fake_process_group(4):
        stats = shard_model(family, args, dims)
    spec = PipelineSpec(pp=2, schedule="1F1B", microbatches=4, first_less=0, last_less=0)
    r0, r1 = (stage_stats(stats, spec, r) for r in (0, 1))
    d, expert = args.dim, 3 * args.dim * args.moe_hidden_dim
    moe_minus_dense = (
        (args.num_experts * d + expert) // 2 + (args.num_experts // 2) * expert - 3 * d * args.hidden_dim // 2
    )
    assert r1.blocks_numel - r0.blocks_numel == 2 * moe_minus_dense
    assert r0.blocks_numel + r1.blocks_numel == stats.blocks_numel
    step = dataclasses.replace(EAGER, pp_degree=2, pp_microbatches=4, pp_first_less=0, pp_last_less=0, ep_degree=2)
    est = P.plan_estimate(_inputs(family, args, step), P.parse_target("h100-4"), pp=2, ep=2, check_rules=False)
    # imbalance by hand: a dense block's training FLOPs minus an MoE block's, 6 x (its FFN minus the
    # router, the shared expert and the top-k routed ones); the output head on rank 1
    from trainer.runtime.flops import model_flops_per_token

    k = args.num_shared_experts + args.num_experts_per_tok
    diff = 6 * (3 * d * args.hidden_dim - d * args.num_experts - k * expert)
    head = 6 * d * args.vocab_size
    mean = (model_flops_per_token(args, 256)["palm"] - head) / 4
    units = [2 * (mean + diff / 2), 2 * (mean - diff / 2) + head]
    assert diff != 0 and est.pipeline.imbalance == pytest.approx(max(units) * 2 / sum(units), rel=1e-9)


def _consistent(inputs, target, candidates):
    for c in candidates:
        request = inputs._request(
            tp=c.tp,
            ac_mode=c.ac_mode,
            target=target,
            dp_replicate=c.dp_replicate,
            pp=c.pp,
            local_batch=c.local_batch_size,
            pp_microbatches=c.pipeline.spec.microbatches if c.pipeline else None,
            cp=c.cp,
            ep=c.ep,
        )
        assert not refusals(request), (c.pp, c.cp, c.ep, c.ac_mode, c.local_batch_size)


def test_search_takes_pp_with_ep_and_cp_where_the_rules_do():
    """pp 2 forced: on h100 (eager) the search returns pp 2 x ep 2 for the MoE debug model and pp 2
    x cp 2 for the dense one, each passing the rules with its own degrees; the p2p of a cp plan is
    `[mb, seq / cp, dim]`. On a TPU target (graph mode: experts, EP and, since 3e5dfeb, CP inside its
    uniform stages) pp 2 x ep 2 and pp 2 x cp 2 too."""
    kw = dict(pp_choices=[2], tp_choices=[1], ac_modes=("none",), max_local_batch=2)
    moe = QWEN3.flavors["debugmodel_moe"]
    dense = LLAMA.flavors["debugmodel"]
    cuda, tpu = P.parse_target("h100-8"), P.parse_target("v5p-8")
    found = {}
    for name, family, args, choices in (
        ("ep", QWEN3, moe, dict(ep_choices=[2])),
        ("cp", LLAMA, dense, dict(cp_choices=[2])),
    ):
        for target, step in ((cuda, EAGER), (tpu, GRAPH)):
            # the model facts a recipe's step carries (CP needs the attention op's positions)
            inputs = _inputs(family, args, step, batch=2, model_has_experts=name == "ep", model_document_mask=True)
            got = P.recommend(inputs, target, **kw, **choices)
            _consistent(inputs, target, got)
            found[name, target.device_type] = [c for c in got if c.pp == 2 and getattr(c, name) == 2]
    assert found["ep", "cuda"] and found["cp", "cuda"]
    assert found["ep", "tpu"] and found["cp", "tpu"]
    c = found["cp", "cuda"][0].pipeline
    assert c.transfer_bytes == 2 * c.micro_batch * (256 // 2) * dense.dim


def _stage_param_numel_worker(ep: int) -> tuple[int, int]:
    """(this rank's pp rank, its parameters' local elements) of the trainer's eager PP 2 x EP `ep`
    build of Qwen 3 debugmodel_moe on 4 gloo processes (`build_model` prunes to the rank's stage)."""
    import torch.distributed as dist

    from parallelisms import ParallelDims, build_mesh
    from parallelisms.parallel_dims import pp_mesh
    from planner.shard import local_tensor
    from tests.support.pipeline_runs import pp_model
    from trainer.step import plan_step

    dims = ParallelDims(pp=2, dp_shard=2, ep=ep, world_size=dist.get_world_size())  # ep inside dp_shard
    mesh = build_mesh(dims, "cpu")
    request = StepRequest(
        mode="eager", pp_degree=2, pp_microbatches=4, n_layers=6, local_batch=4, ep_degree=ep, model_document_mask=True
    )
    model, _ = pp_model(
        QWEN3.flavors["debugmodel_moe"], plan_step(request), seed=0, lr=1e-3, dims=dims, mesh=mesh, family=QWEN3
    )
    pp_rank = pp_mesh(mesh).get_local_rank()
    return pp_rank, sum(local_tensor(p).numel() for p in model.parameters())


def test_planned_stage_params_equal_the_trainers_pp2_ep2_build():
    """The trainer's own eager PP 2 x EP 2 build of Qwen 3 debugmodel_moe on 4 gloo processes (the
    stage pruned by `build_model`, then FSDP 2 x EP 2 inside it): each rank's local parameter
    elements equal the planner's `stage_stats` of its pp rank, exactly (1F1B, the default split 3 | 3)."""
    from tests.support.parallel_harness import run_processes

    args = QWEN3.flavors["debugmodel_moe"]
    dims = make_parallel_dims(
        dp_replicate=1, dp_shard=-1, tp=1, ep=2, pp=2, world_size=4, shape=args.shape(), seq_len=256
    )
    with fake_process_group(4):
        stats = shard_model(QWEN3, args, dims)
    spec = PipelineSpec(pp=2, schedule="1F1B", microbatches=4)
    planned = [stage_stats(stats, spec, r).param_numel for r in (0, 1)]
    measured = run_processes(4, _stage_param_numel_worker, 2)
    assert sorted(measured) == sorted((r, planned[r]) for r in (0, 0, 1, 1)), (measured, planned)
