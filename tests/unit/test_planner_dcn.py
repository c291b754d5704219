"""The DCN in the planner (planner/multislice.py): FSDP across slices (its all-gathers and
reduce-scatters) by hand, the split of the slices between the replicas and the shards, graph-mode
PP's permutes on the critical path (planner/pipeline.py), and the search that puts a pipeline first
on several slices only where it wins with the DCN priced (planner/search.py `pp_ranks`)."""

import dataclasses
from types import SimpleNamespace

import pytest

import planner as P
from models import get_model_family
from planner.multislice import dcn_cost, dcn_split, priced_step_s
from planner.pipeline import PipelineCost, PipelineSpec
from trainer.step import StepRequest

LLAMA = get_model_family("llama3")
GiB = 2**30


def _est(**kw):
    """An estimate's fields `dcn_cost` reads: 4 GiB of fp32 parameter shard per device (2 GiB
    gathered in bf16), as many gradients, FSDP 512 over the world, no pipeline."""
    base = dict(
        params=4 * GiB,
        grads=4 * GiB,
        saved_weights=0,
        dp_shard=512,
        dp_replicate=1,
        cp=1,
        pp=1,
        fsdp_gather_ratio=1.0,
        grad_accum=1,
        recompute_factor=4 / 3,
        step_time_s=20.0,
        n_layers=100,
    )
    return SimpleNamespace(**{**base, **kw})


def test_fsdp_across_slices_by_hand():
    """v6e: 4 devices per host at 50 GB/s, 12.5 GB/s per device. Two slices: each collective moves
    (2 - 1) x the device's shard over the DCN: the forward gathers 2 GiB (bf16), the backward
    re-gathers 2 GiB less the kept weights' shard (1 GiB gathered over 512 = 2 MiB), the gradient
    reduce-scatter 4 GiB (fp32); four slices: 3 x each."""
    t2, t4 = P.parse_target("v6e-256x2"), P.parse_target("v6e-256x4")
    est = _est(saved_weights=GiB)
    two = dcn_cost(est, t2)
    assert (two.num_slices, two.shard_slices) == (1, 2)
    assert two.forward_gather_bytes == 2 * GiB
    assert two.backward_gather_bytes == 2 * GiB - GiB / 512
    assert two.reduce_scatter_bytes == 4 * GiB
    assert two.dcn_s == pytest.approx((8 * GiB - GiB / 512) / 12.5e9)
    four = dcn_cost(est, t4)
    assert four.fsdp_bytes == pytest.approx(3 * two.fsdp_bytes) and four.dcn_s == pytest.approx(3 * two.dcn_s)
    # bf16 reduction halves the reduce-scatter; float8 gathers (`fsdp_gather_ratio`) halve the gathers
    assert dcn_cost(est, t2, reduce_bytes=2).reduce_scatter_bytes == 2 * GiB
    assert dcn_cost(_est(fsdp_gather_ratio=0.5), t2).forward_gather_bytes == GiB
    # every micro-batch gathers and reduce-scatters again
    assert dcn_cost(_est(grad_accum=3, saved_weights=GiB), t2).fsdp_bytes == pytest.approx(3 * two.fsdp_bytes)
    # no AC: the forward's gathered blocks are kept (saved_weights = all of them), nothing re-gathered
    assert dcn_cost(_est(saved_weights=2 * GiB * 512), t2).backward_gather_bytes == 0


def test_overlap_per_pass():
    """The forward gathers hide under the forward (1 / (3 rf) of the compute: 5 s of a 20 s step
    with full AC), the backward's traffic under the backward (15 s); what is left exposed is per
    pass the larger of one layer's share and what exceeds the pass."""
    t = P.parse_target("v6e-256x2")
    fast = dcn_cost(_est(), t)
    assert fast.exposed_s == pytest.approx(fast.forward_gather_bytes / 12.5e9 / 100 + 6 * GiB / 12.5e9 / 100)
    slow = dcn_cost(_est(step_time_s=0.4), t)  # forward 0.1 s, backward 0.3 s
    fwd, bwd = 2 * GiB / 12.5e9, 6 * GiB / 12.5e9
    assert slow.exposed_s == pytest.approx((fwd - 0.1) + (bwd - 0.3))
    assert priced_step_s(SimpleNamespace(**vars(_est(step_time_s=0.4)), target=t)) == pytest.approx(
        0.4 + slow.exposed_s
    )


def test_the_slices_go_to_the_stages_then_the_replicas_then_the_shards():
    t4 = P.parse_target("v6e-256x4")
    assert dcn_split(_est(dp_replicate=4), t4) == (4, 1)  # HSDP: one replica per slice
    assert dcn_split(_est(dp_replicate=2), t4) == (2, 2)  # 2 replicas, each sharded over 2 slices
    assert dcn_split(_est(dp_replicate=1), t4) == (1, 4)  # FSDP over all four (MaxText's dcn_fsdp)
    assert dcn_split(_est(pp=4), t4) == (1, 1)  # the stages take the slices: nothing else crosses
    assert dcn_split(_est(pp=2, dp_replicate=2), t4) == (2, 1)
    # HSDP over 2 of them: the all-reduce term only, and the same bytes as before this module priced FSDP
    hsdp = dcn_cost(_est(dp_replicate=2), t4)
    assert hsdp.reduce_scatter_bytes and hsdp.num_slices == 2
    assert dcn_cost(_est(dp_replicate=4), t4).fsdp_bytes == 0


def test_a_real_plan_across_two_slices_gathers_its_own_shard():
    """The debug Llama on v6e-8x2, FSDP 16 across both slices (allow_dcn_sharding): the DCN bytes
    are the plan's own shard (its parameter count / 16, bf16 gathered, fp32 reduce-scattered)."""
    args = LLAMA.flavors["debugmodel"]
    step = StepRequest(mode="eager", device_type="tpu", model_has_experts=False, allow_dcn_sharding=True)
    inputs = P.PlanInputs(family=LLAMA, args=args, model_name="tiny", seq_len=256, local_batch_size=2, step=step)
    t = P.parse_target("v6e-8x2")
    est = P.plan_estimate(inputs, t, dp_replicate=1, ac_mode="full", probe=True)
    cost = dcn_cost(est, t)
    s = args.shape()
    q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    block = 2 * s.dim * q + 2 * s.dim * kv + 3 * s.dim * s.ffn_hidden + 2 * s.dim  # + the two norms
    numel = s.n_layers * block + 2 * s.vocab_size * s.dim + s.dim  # embedding, head, final norm
    shard = est.params // 4
    assert shard == pytest.approx(numel / 16, rel=1e-3)  # sharded over both slices' 16 devices
    assert cost.shard_slices == 2 and cost.forward_gather_bytes == 2 * shard
    assert cost.reduce_scatter_bytes == 4 * shard
    kept = est.saved_weights / 16  # the head and final norm, kept gathered over the 16 shards
    assert 0 < kept < 2 * shard and cost.backward_gather_bytes == pytest.approx(2 * shard - kept)
    hsdp = P.plan_estimate(inputs, t, dp_replicate=2, ac_mode="full", probe=True)
    assert dcn_cost(hsdp, t).fsdp_bytes == 0 and dcn_cost(hsdp, t).num_slices == 2


def test_graph_mode_permutes_are_all_exposed():
    """Graph mode's pipeline iteration waits for the last one's permute: no steady state to hide
    under; eager schedules hide all but the fill and drain."""
    common = dict(
        rank=0,
        rank_layers=(3, 3),
        rank_totals=(1, 1),
        micro_batch=1,
        in_flight=1.0,
        imbalance=1.0,
        transfer_bytes=10**8,
        link="DCN",
        link_bytes_per_s=1e10,
    )
    # GPipe, p 2, m 4: eager sends 2 m = 8 transfers; graph mode 2 (T - 1) = 8 permutes, T = m + p - 1
    graph = PipelineCost(
        spec=PipelineSpec(pp=2, schedule="GPipe", microbatches=4, uniform=True), p2p_bytes=8 * 10**8, **common
    )
    eager = PipelineCost(spec=PipelineSpec(pp=2, schedule="GPipe", microbatches=4), p2p_bytes=8 * 10**8, **common)
    assert graph.spec.transfers == eager.spec.transfers == 8
    assert graph.p2p_exposed_s(100.0) == pytest.approx(0.08)  # all 8 x 0.01 s
    assert eager.p2p_exposed_s(100.0) == pytest.approx(0.02)  # the fill and the drain: 2 (p - 1) x 0.01 s


def _candidate(t, *, pp, fits=True, step=1.0, dp_replicate=1, tokens=2**20):
    """A ranked candidate's fields: `tokens` a step on one device in `step` s; FSDP over the slices
    (dp_replicate 1) gathers a 1 GiB bf16 shard, pipelines carry nothing else over the DCN."""
    return SimpleNamespace(
        **vars(_est(dp_replicate=dp_replicate, pp=pp, params=2 * GiB, grads=2 * GiB, step_time_s=step)),
        target=t,
        fits=fits,
        global_batch_tokens=tokens,
        tokens_per_device_step=1000.0,
    )


def test_pp_ranks_compare_priced_tokens_per_s():
    """On v6e-256x2: a pipeline that beats the best fitting plan without one by more than
    PP_WIN_MARGIN with the DCN priced ranks 0, one within the margin 2; where the flat plan's
    gathers are exposed (a 0.01 s step against 0.26 s of DCN) the pipeline's unpriced slower step wins."""
    from planner.search import PP_WIN_MARGIN, pp_ranks

    t = P.parse_target("v6e-256x2")
    flat = _candidate(t, pp=1, step=1.0)
    close = _candidate(t, pp=2, step=1.0 / (1 + PP_WIN_MARGIN / 2))
    clear = _candidate(t, pp=2, step=1.0 / (1 + 2 * PP_WIN_MARGIN))
    unfit = _candidate(t, pp=2, step=0.5, fits=False)
    ranks = pp_ranks([flat, close, clear, unfit], 2**22)
    assert [ranks[id(c)] for c in (flat, close, clear, unfit)] == [1, 2, 0, 2]
    # the flat plan's DCN: 1 GiB forward + 1 GiB backward gathers, 2 GiB reduce-scatter at 12.5 GB/s
    busy = _candidate(t, pp=1, step=0.01)
    assert priced_step_s(busy) == pytest.approx(0.01 + 4 * GiB / 12.5e9 - 0.01, rel=1e-6)
    slow_pipe = _candidate(t, pp=2, step=0.1)
    assert pp_ranks([busy, slow_pipe], 2**22)[id(slow_pipe)] == 0
    # a flat plan beyond the global batch does not count: nothing to beat
    big = _candidate(t, pp=1, step=0.001, tokens=2**23)
    assert pp_ranks([big, close], 2**22)[id(close)] == 0


def _search(t, *, seq):
    graph = StepRequest(
        mode="graph",
        device_type="tpu",
        model_has_experts=False,
        pp_schedule="GPipe",
        pp_first_less=0,
        pp_last_less=0,
        allow_dcn_sharding=True,
    )
    args = LLAMA.flavors["debugmodel"]
    inputs = P.PlanInputs(family=LLAMA, args=args, model_name="tiny", seq_len=seq, local_batch_size=1, step=graph)
    return P.recommend(
        inputs, t, max_global_tokens=2**22, tp_choices=[1], cp_choices=[1], max_local_batch=1, ac_modes=("none",)
    )


def test_the_search_puts_pp_first_only_where_it_wins_with_the_dcn_priced():
    """The debug Llama (6 layers, dim 256) on v6e-8x2, graph mode, FSDP across slices allowed. At
    sequences of 8192 tokens (one a device: 131k tokens a step) FSDP across the slices
    fits and its DCN traffic hides under the compute, so it comes first though pipelines were
    searched; at 256 tokens (4k tokens a step) every plan without a pipeline waits on the DCN (the
    gathers, or HSDP's all-reduce, exceed the compute: the small-global-batch regime) and PP 2 over
    the slices, whose permutes carry [1, 256, 256] bf16, comes first."""
    from planner.multislice import priced_tokens_per_s
    from planner.search import PP_WIN_MARGIN

    t = P.parse_target("v6e-8x2")
    found = _search(t, seq=8192)
    best = next(c for c in found if c.fits)
    pipes = [c for c in found if c.fits and c.pp == 2]
    assert best.pp == 1 and pipes, "pipelines are searched on several slices even where a plan without one fits"
    assert (best.dp_replicate, dcn_split(best, t)) == (1, (1, 2))  # FSDP over both slices
    assert max(priced_tokens_per_s(c) for c in pipes) < priced_tokens_per_s(best)
    assert any("allow_dcn_sharding = true" in n for n in best.notes)

    small = _search(t, seq=256)
    best = next(c for c in small if c.fits)
    flat = max(priced_tokens_per_s(c) for c in small if c.fits and c.pp == 1)
    assert best.pp == 2 and priced_tokens_per_s(best) > flat * (1 + PP_WIN_MARGIN)
    # unpriced, the plans without a pipeline would look faster: the DCN decides
    assert best.tokens_per_s < max(c.tokens_per_s for c in small if c.fits and c.pp == 1)


def test_pipeline_degrees_are_asked_in_the_ac_modes_the_search_tries():
    """A recipe that offloads its block inputs (full AC and the layer scan only) takes a pipeline:
    `_pipeline_degrees` asked the rules at AC none alone and offered pp 1 only (the pending 405B PP
    recipe's `--recommend` never searched a pipeline)."""
    from planner.search import _pipeline_degrees

    graph = StepRequest(
        mode="graph",
        device_type="tpu",
        model_has_experts=False,
        scan_layers=True,
        pp_schedule="GPipe",
        pp_first_less=0,
        pp_last_less=0,
        ac_offload="block_inputs",
    )
    args = LLAMA.flavors["debugmodel"]
    inputs = P.PlanInputs(family=LLAMA, args=args, model_name="tiny", seq_len=256, local_batch_size=1, step=graph)
    assert _pipeline_degrees(inputs, P.parse_target("v6e-8x2"), 4) == [1, 2, 4]


def test_recommend_on_a_pp_recipe_rechecks_and_prints_the_choices_pipeline_degree(capsys):
    """A PP recipe on two slices with FSDP across them allowed: the search chooses a plan without a
    pipeline (long sequences: the gathers hide), and `--recommend` re-checks that choice at its own
    pipeline degree (it re-checked at the recipe's pp 2 and failed its probe-equals-model assertion)
    and prints `pipeline_parallel_degree = 1` among the recipe keys, so the pasted keys drop the
    recipe's pipeline."""
    from scripts.estimate import main

    rc = main(
        [
            "--config",
            "configs/llama3_debug.toml",
            "--target",
            "v6e-8x2",
            "--recommend",
            "--seq-len",
            "8192",
            "--parallelism.pipeline_parallel_degree=2",
            "--parallelism.allow_dcn_sharding=true",
            "--compile.mode=graph",
            "--compile.scan_layers=true",
            "--parallelism.pipeline_schedule=GPipe",
            "--parallelism.pipeline_first_stage_less_layers=0",
            "--parallelism.pipeline_last_stage_less_layers=0",
            "--training.local_batch_size=2",
        ]
    )
    keys = capsys.readouterr().out.split("recipe keys:")[-1]
    assert rc == 0 and "pipeline_parallel_degree = 1" in keys and "data_parallel_shard_degree = 16" in keys


def test_stage_boundaries_inside_a_slice_are_ici():
    """More stages than slices: `pp / slices` stages in a slice, and only the boundaries between
    slices cross the DCN (`planner.pipeline.dcn_hops`, placed as `ParallelDims.dcn_mesh_shape` places
    the outermost axis `pp x dp_replicate`). The eager schedules' fill and drain take each boundary at
    its own link: pp 4 on 2 slices, 1 DCN and 2 ICI hops each way (before 2026-12-07: all 3 at the
    DCN rate). Graph mode's ring permutes stay at the DCN rate (`PipelineCost.p2p_exposed_s`: the
    DCN ranks pace the ring), and say which boundaries cross."""
    from planner.pipeline import dcn_hops

    def hops(pp, slices, dp_replicate=1, uniform=False):
        spec = PipelineSpec(pp=pp, schedule="GPipe", microbatches=4, uniform=uniform)
        return dcn_hops(spec, num_slices=slices, dp_replicate=dp_replicate)

    assert (hops(2, 2), hops(2, 2, uniform=True)) == (1, 2)  # every boundary (the ring's wrap too)
    assert (hops(4, 2), hops(4, 2, uniform=True)) == (1, 2)  # of 3 and of 4
    assert (hops(8, 2), hops(8, 4, uniform=True), hops(2, 4)) == (1, 4, 1)
    assert hops(4, 1) == 0 and hops(2, 2, dp_replicate=2) == 1
    assert hops(3, 2, dp_replicate=2) == 1  # each replica's 3 stages straddle the 2 slices once
    common = dict(
        rank=0,
        rank_layers=(2, 2, 2, 2),
        rank_totals=(1, 1, 1, 1),
        micro_batch=1,
        in_flight=1.0,
        imbalance=1.0,
        transfer_bytes=10**8,
        link="DCN",
        link_bytes_per_s=1e10,
        p2p_bytes=2 * 4 * 10**8,
        dcn_hops=1,
        ici_bytes_per_s=1e11,
    )
    eager = PipelineCost(spec=PipelineSpec(pp=4, schedule="GPipe", microbatches=4), **common)
    # the fill and drain: 2 DCN hops of 0.01 s and 4 ICI hops of 0.001 s (the steady state hidden)
    assert eager.p2p_exposed_s(100.0) == pytest.approx(2 * 0.01 + 4 * 0.001)
    graph = PipelineCost(
        spec=PipelineSpec(pp=4, schedule="GPipe", microbatches=4, uniform=True), **{**common, "dcn_hops": 2}
    )
    assert graph.p2p_exposed_s(100.0) == pytest.approx(0.08)  # every permute at the DCN rate
    assert graph.link_text == "DCN (2 of 4 boundaries; ICI inside a slice)"
    assert PipelineCost(spec=graph.spec, **{**common, "dcn_hops": 4}).link_text == "DCN"
    # a real plan: graph-mode PP 4 of the debug Llama at 8 layers over 2 v6e-8 slices
    args = dataclasses.replace(LLAMA.flavors["debugmodel"], n_layers=8)
    step = StepRequest(
        mode="graph", device_type="tpu", model_has_experts=False, pp_schedule="GPipe", pp_first_less=0, pp_last_less=0
    )
    step = dataclasses.replace(step, pp_degree=4, pp_microbatches=4)
    inputs = P.PlanInputs(family=LLAMA, args=args, model_name="tiny", seq_len=256, local_batch_size=4, step=step)
    c = P.plan_estimate(inputs, P.parse_target("v6e-8x2"), pp=4, probe=True).pipeline
    assert (c.link, c.dcn_hops) == ("DCN", 2) and "over DCN (2 of 4 boundaries" in c.describe()
