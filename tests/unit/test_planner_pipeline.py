"""Pipeline parallelism in the planner (planner/pipeline.py): the stage memory terms by hand for a
tiny model, the bubble in the step time, the p2p bytes and their link, a search that takes PP only
when memory forces it, the refusal-consistency of the search, and the recipe check of the pending
pipeline recipe (configs/pending/)."""

import dataclasses
import os

import pytest

import planner as P
from models import get_model_family
from parallelisms.pipeline_parallel import bubble_fraction
from planner.pipeline import PipelineSpec, p2p_transfer_bytes
from trainer.step import StepRequest
from trainer.step.plan import refusals

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA = get_model_family("llama3")
GPU = StepRequest(mode="eager", device_type="cuda", model_has_experts=False)


def _inputs(args, *, seq=256, batch=4, step=GPU, **pipe):
    return P.PlanInputs(
        family=LLAMA,
        args=args,
        model_name="tiny",
        seq_len=seq,
        local_batch_size=batch,
        step=dataclasses.replace(step, **pipe),
    )


def test_stage_memory_by_hand_pp2_halves_the_blocks_and_splits_embedding_and_head():
    """debugmodel (6 layers, dim 256, vocab 2048) on 8 GPUs: PP 2 x FSDP 4 against FSDP 4 alone on
    4 GPUs (the same stage mesh). `split_layers(6, 2)` = 3 + 3; pp rank 0 holds 3 blocks and the
    embedding, rank 1 3 blocks, the norm and the head; 1F1B over 4 micro-batches of 1 sequence:
    rank 0 holds 2 in flight, rank 1 one and the loss."""
    args = LLAMA.flavors["debugmodel"]
    pp1 = P.plan_estimate(_inputs(args), P.parse_target("h100-4"), pp=1)
    pp2 = P.plan_estimate(_inputs(args, pp_degree=2, pp_microbatches=4), P.parse_target("h100-8"), pp=2)
    dim, vocab, fsdp = args.dim, args.vocab_size, 4
    embedding = head = vocab * dim // fsdp
    block = (pp1.params // 4 - embedding - head - dim // fsdp) // 6
    c = pp2.pipeline
    assert (c.rank_layers, c.spec.m, c.micro_batch, c.spec.in_flight(0), c.spec.in_flight(1)) == ((3, 3), 4, 1, 2, 1)
    rank_params = {0: 3 * block + embedding, 1: 3 * block + head + dim // fsdp}
    assert pp2.params == 4 * rank_params[c.rank]  # fp32 master weights of the heaviest rank
    assert pp2.grads == pp2.params and pp2.optimizer == 2 * pp2.params
    # the blocks' weights halve; the embedding stays on rank 0, the head on rank 1
    assert rank_params[0] - embedding == (pp1.params // 4 - embedding - head - dim // fsdp) // 2
    # activations: rank 1 keeps 1 micro-batch of 1 sequence through 3 blocks plus the loss; the
    # whole model keeps 4 sequences through 6 blocks
    assert pp2.activations.blocks * 8 == pp1.activations.blocks * (2 if c.rank == 0 else 1)
    assert c.rank_totals[c.rank] == pp2.total == max(c.rank_totals)


def test_uniform_stages_hold_the_embedding_and_head_on_every_rank():
    """Graph mode's uniform stages (trainer/graph/pipeline.py): every pp rank holds 3 blocks, the
    embedding, the norm and the head, and keeps the loss; the blocks still halve. The head and the
    loss run once on all m chunks together, so the logits' transient is the whole local batch's, as
    without PP (before: one chunk's, 1/m of it; the compile of Llama 3 8B at pp 2 x tp 2 held one
    f32[2, 2048, 128256] logits buffer, docs/pipeline_parallel.md "On a TPU")."""
    args = LLAMA.flavors["debugmodel"]
    graph = dataclasses.replace(GPU, mode="graph", pp_schedule="GPipe", pp_first_less=0, pp_last_less=0)
    pp1 = P.plan_estimate(_inputs(args), P.parse_target("h100-4"), pp=1)
    pp2 = P.plan_estimate(_inputs(args, step=graph, pp_degree=2, pp_microbatches=4), P.parse_target("h100-8"), pp=2)
    c = pp2.pipeline
    assert c.spec.uniform and c.holds == "embedding and head + loss"
    assert c.rank_layers == (3, 3) and c.rank_totals[0] == c.rank_totals[1]
    dim, vocab, fsdp = args.dim, args.vocab_size, 4
    root = 2 * vocab * dim // fsdp + dim // fsdp
    block = (pp1.params // 4 - root) // 6
    assert pp2.params == 4 * (3 * block + root)
    assert pp2.activations.loss == pp1.activations.loss  # GPipe: all m chunks' loss on every rank
    assert pp2.activations.logits_transient == pp1.activations.logits_transient > 0


def test_tp_divides_a_uniform_stage_as_it_divides_the_model_without_pp():
    """Graph-mode PP 2 x TP 2 x FSDP 4 (h100-16) against PP 2 x FSDP 4 (h100-8), the same local batch:
    the stage's per-device weights by hand (every block matrix, the embedding and the head split by
    tp; the norms replicated over tp), gradients and AdamW state alike, and the per-block activations
    shrink by the ratio TP 2 gives without PP (h100-8 against h100-4), held for T = m + p - 1 = 5
    iterations either way; the loss (no loss parallel with PP) stays whole on every tp rank."""
    args = LLAMA.flavors["debugmodel"]
    graph = dataclasses.replace(GPU, mode="graph", pp_schedule="GPipe", pp_first_less=0, pp_last_less=0)
    pipe = dict(step=graph, pp_degree=2, pp_microbatches=4)
    pp2 = P.plan_estimate(_inputs(args, **pipe), P.parse_target("h100-8"), pp=2)
    pp2tp2 = P.plan_estimate(_inputs(args, **pipe), P.parse_target("h100-16"), pp=2, tp=2)
    one = dataclasses.replace(GPU, mode="graph")
    tp1 = P.plan_estimate(_inputs(args, step=one), P.parse_target("h100-4"), pp=1)
    tp2 = P.plan_estimate(_inputs(args, step=one), P.parse_target("h100-8"), pp=1, tp=2)
    dim, vocab, fsdp, tp = args.dim, args.vocab_size, 4, 2
    s = args.shape()
    q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    matrices = 2 * dim * q + 2 * dim * kv + 3 * dim * s.ffn_hidden  # wq wo, wk wv, w1 w2 w3
    norms = 2 * dim  # attention_norm, ffn_norm
    # uniform stages: 3 blocks, the embedding, the head and the final norm on each pp rank
    assert pp2.params == 4 * (3 * (matrices + norms) + 2 * vocab * dim + dim) // fsdp
    assert pp2tp2.params == 4 * ((3 * matrices + 2 * vocab * dim) // (fsdp * tp) + (3 * norms + dim) // fsdp)
    for e in (pp2, pp2tp2):
        assert e.grads == e.params and e.optimizer == 2 * e.params
    # activations: the per-block bytes shrink as without PP, and 5 iterations x 3 blocks are held
    assert (
        pp2tp2.activations.per_block * tp1.activations.per_block
        == pp2.activations.per_block * tp2.activations.per_block
    )
    assert pp2tp2.activations.per_block < 0.55 * pp2.activations.per_block
    T = pp2tp2.pipeline.spec.iterations
    assert T == 5 and pp2tp2.activations.blocks == pp2tp2.activations.per_block * 3 * T
    assert pp2tp2.activations.loss == pp2.activations.loss
    # the p2p: each tp rank sends its sequence shard
    assert pp2tp2.pipeline.transfer_bytes * tp == pp2.pipeline.transfer_bytes
    assert pp2tp2.total < pp2.total


def test_the_bubble_inflates_the_step_time_and_p2p_is_priced_on_its_link():
    args = LLAMA.flavors["debugmodel"]
    pp1 = P.plan_estimate(_inputs(args), P.parse_target("h100-4"), pp=1)
    pp2 = P.plan_estimate(_inputs(args, pp_degree=2, pp_microbatches=4), P.parse_target("h100-8"), pp=2)
    c = pp2.pipeline
    assert c.bubble == bubble_fraction("1F1B", 2, 4) == pytest.approx(1 / 5)
    # the same tokens per dp rank over half the layers per device: half the compute, then / (1 - bubble)
    assert pp2.compute_s == pytest.approx(pp1.compute_s / 2 * c.imbalance)
    assert pp2.step_time_s == pytest.approx(pp2.compute_s / (1 - 1 / 5) + c.p2p_exposed_s(pp2.compute_s))
    # p2p: [1, 256, 256] bf16 per micro-batch and boundary, forward and backward, 4 micro-batches
    assert (
        c.transfer_bytes
        == 2 * 1 * 256 * args.dim
        == p2p_transfer_bytes(args.shape(), micro_batch=1, seq_len=256, tp=1, cp=1)
    )
    assert c.p2p_bytes == 2 * 4 * c.transfer_bytes and c.link == "ICI"
    assert c.p2p_serial_s == pytest.approx(c.p2p_bytes / 50e9)
    # exposed: the fill and drain (2 (p - 1) hops), the steady state hidden under the compute
    assert c.p2p_exposed_s(1.0) == pytest.approx(2 * c.transfer_s)
    # several slices: the stages take the slices, the boundary crosses the DCN at a device's share
    from planner.pipeline import link_of

    t = P.parse_target("v6e-256x2")
    assert link_of(t, 2) == ("DCN", t.dcn_bytes_per_s_per_host / 4) and link_of(t, 1)[0] == "ICI"


def test_schedules_in_flight():
    """1F1B: p - r on rank r; GPipe: all m; interleaved: (v - 1) p + 2 (p - 1 - r) + 1 chunks of 1/v."""
    assert [PipelineSpec(4, "1F1B", 8).in_flight(r) for r in range(4)] == [4, 3, 2, 1]
    assert PipelineSpec(4, "GPipe", 8).in_flight(0) == 8
    assert PipelineSpec(4, "Interleaved1F1B", 8, 2).in_flight(0) == pytest.approx((4 + 6 + 1) / 2)
    assert PipelineSpec(4, "ZBVZeroBubble", 8).in_flight(3) == 4


def test_search_takes_pp_only_when_memory_forces_it():
    """Llama 3 70B at seq 256, no AC, tp = cp = 1 on h100-64: without PP every device keeps the
    whole model's bf16 block weights for the backward (140 GB); PP 4 keeps a quarter. The search
    proposes no PP where a plan without it fits (the debug model)."""
    args = LLAMA.flavors["70B"]
    inputs = _inputs(args, batch=1)
    kw = dict(tp_choices=[1], cp_choices=[1], ac_modes=("none",), max_local_batch=8)
    best = P.recommend(inputs, P.parse_target("h100-64"), pp_choices=[1, 2, 4], **kw)
    assert best[0].fits and best[0].pp == 4, [(c.pp, c.fits, c.total / 2**30) for c in best[:3]]
    assert not any(c.fits for c in best if c.pp == 1)
    small = P.recommend(_inputs(LLAMA.flavors["debugmodel"]), P.parse_target("h100-8"), pp_choices=[1, 2], **kw)
    assert small[0].fits and small[0].pp == 1


def test_search_never_proposes_what_the_rules_refuse():
    """Every candidate the search returns passes `refusals` with its own pipeline; on a TPU target
    (no pipeline there yet) it proposes none, and the default degrees say so by trying pp 1 only."""
    args = LLAMA.flavors["70B"]
    inputs = _inputs(args, batch=1)
    kw = dict(tp_choices=[1], cp_choices=[1], ac_modes=("none",), max_local_batch=4)
    for target in ("h100-64", "v6e-64"):
        t = P.parse_target(target)
        candidates = P.recommend(inputs, t, pp_choices=[1, 2, 4], **kw)
        assert any(c.pp > 1 for c in candidates) == (t.device_type == "cuda")
        for c in candidates:
            spec = c.pipeline.spec if c.pipeline else PipelineSpec(1)
            request = inputs._request(
                tp=c.tp,
                ac_mode=c.ac_mode,
                target=t,
                dp_replicate=c.dp_replicate,
                pp=c.pp,
                local_batch=c.local_batch_size,
                pp_microbatches=spec.microbatches,
            )
            assert not refusals(request), (target, c.pp, c.tp, c.ac_mode, c.local_batch_size)
            assert c.pp == 1 or t.device_type == "cuda"
    from planner.search import _pipeline_degrees

    assert _pipeline_degrees(inputs, P.parse_target("v6e-64"), 8) == [1]
    assert _pipeline_degrees(inputs, P.parse_target("h100-64"), 8) == [1, 2, 4, 8]
    assert _pipeline_degrees(P.PlanInputs(LLAMA, args, "70B", 256, 1), P.parse_target("h100-64"), 8) == [1]


def test_pending_pipeline_recipe_is_priced_and_does_not_fit():
    """configs/pending/llama3_405b_v6e_2x256_pp.toml (graph-mode PP 2 over two v6e-256 slices x FSDP
    256): the rules accept it now (PP over the DCN) and the recipe check prices the pipeline (degree,
    schedule, micro-batches, bubble, the heaviest stage, the DCN) and says it does not fit."""
    from tools.recipe_check import check_recipe

    r = check_recipe(os.path.join(ROOT, "configs", "pending", "llama3_405b_v6e_2x256_pp.toml"), capture=False)
    assert r.error is None and r.fits is False and not r.ok, (r.error, r.planned_gib)
    assert r.mesh == "pp 2 x fsdp 256", r.mesh
    assert r.pipeline.startswith("pp 2 GPipe, 2 micro-batches, bubble 33.3%, heaviest pp rank"), r.pipeline
    assert "over DCN" in r.pipeline and r.planned_gib > r.hbm_gib
    assert any(n.startswith("pipeline: pp 2, GPipe") and "3 micro-batches in flight" in n for n in r.notes)


def test_the_head_weighs_on_the_last_stage_by_its_flops():
    """The last stage runs the output head: 6 dim vocab training FLOPs per token, in block units the
    rest of the count over the layers (planner.pipeline.head_block_units); the embedding is a lookup.
    The debug model at 8 layers and seq 512 (scripts/bench/bench_pipeline.py's shape): by hand."""
    import dataclasses

    from planner.pipeline import PipelineSpec, head_block_units
    from trainer.runtime.flops import model_flops_per_token

    args = dataclasses.replace(LLAMA.flavors["debugmodel"], n_layers=8)
    shape = args.shape()
    flops = model_flops_per_token(args, 512)["palm"]
    head = 6 * shape.dim * shape.vocab_size
    h = head_block_units(shape, flops)
    assert h == pytest.approx(head / ((flops - head) / 8))
    assert 1.0 < h < 1.1  # 256 x 4096 head against a 256-dim block with a 768 FFN at seq 512
    spec = PipelineSpec(pp=2, schedule="GPipe", microbatches=4, first_less=0, last_less=0)
    assert spec.rank_units(8, h) == [4, 4 + h]
    assert spec.imbalance(8, h) == pytest.approx((4 + h) * 2 / (8 + h))
    assert spec.imbalance(8) == 1.0  # the knobs' accounting: no lighter stage, no imbalance
    # uniform stages (graph mode) run the head on every rank: the ranks are alike, but each does its
    # 4 blocks and the whole head against the model's (8 + h) / 2 (1.0 before 2026-12-07: the ranks'
    # sum, with the head p times, was taken for the model's work)
    uniform = dataclasses.replace(spec, uniform=True)
    assert uniform.rank_units(8, h) == [4 + h, 4 + h]
    assert uniform.imbalance(8, h) == pytest.approx((4 + h) * 2 / (8 + h)) and uniform.imbalance(8, h) > 1.02
    # ZBV's V puts the first and the last stage on rank 0
    zbv = PipelineSpec(pp=2, schedule="ZBVZeroBubble", microbatches=4, first_less=0, last_less=0)
    assert zbv.rank_units(8, h) == [4 + h, 4]
    assert head_block_units(shape, None) is None


def test_fsdp_bound_reads_the_pipeline_micro_batch():
    """`Estimate.fsdp_bound` of a pipeline plan reads one pipeline micro-batch (`local_batch / m`
    sequences), whose pass through the stage gathers its weights: graph-mode PP 2 x FSDP 4 of the
    debug model on v6e-8 at 8 sequences of 2048 (16,384 tokens a device, above the ~5,100 that hide
    its gathers): 8 micro-batches of 2,048 tokens are FSDP-bound, 2 of 8,192 are not. Before
    2026-12-07 it read the whole local batch (neither bound), which favoured pipeline plans."""
    args = LLAMA.flavors["debugmodel"]
    graph = StepRequest(
        mode="graph", device_type="tpu", model_has_experts=False, pp_schedule="GPipe", pp_first_less=0, pp_last_less=0
    )
    bound = {}
    for m in (8, 2):
        inputs = _inputs(args, seq=2048, batch=8, step=graph, pp_degree=2, pp_microbatches=m)
        est = P.plan_estimate(inputs, P.parse_target("v6e-8"), pp=2, probe=True)
        assert est.local_batch_size * est.seq_len == 16384 > est.fsdp_min_tokens > 2048, est.fsdp_min_tokens
        assert est.micro_batch_tokens == 8 // m * 2048
        bound[m] = est.fsdp_bound
    assert bound == {8: True, 2: False}
