"""Pipeline parallelism in graph mode (trainer/graph/pipeline.py): the pipeline inside the captured
train step, GPipe's order, uniform stages (one SPMD program: the stage index is an input), the
activations moved between stages by a permute over the pp group.

On 2 gloo processes (aot_eager, fp32, the Llama 3 debug model narrowed to 6 layers, AdamW with
clipping, 3 steps): the graph step's losses and gradient norms against one process's eager step on
the same global batch (and, on the same ranks, eager PP's GPipe), and the final weights. Tolerance:
eager PP's (tests/unit/test_pipeline_parallel.py): the loss is the mean of the chunk means and
each gradient a sum over chunks, fp32 sums in another order: losses within 2e-6 relative, gradient
norms within 1e-5 (FSDP's reduce-scatters sum in yet another order), graph against eager PP within
2e-6, weights within 5 % of lr x steps absolute. A wrong stage mask breaks these by orders of
magnitude (the loss kept on stage 0: losses 1.4e-2, norms 1.3e-1). Measured with uniform stages
(2026-12-06): docs/pipeline_parallel.md, "Correctness and tolerance".
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_pipeline_parallel import BATCH, LR, N_LAYERS, STEPS, _batches, _one_process_reference
from trainer.step import StepRequest, plan_step


def _graph_pp_worker(seed, batches, dp_shard, accum, microbatches, modes, tp=1):
    """On each rank, per mode ("graph": the captured pipeline, unrolled; "graph_scan": its iterations as
    one scan; "eager": eager PP's GPipe): the losses
    (the loop's global mean) and gradient norms, this rank's final weights (full), the graph's
    collectives."""
    import torch.distributed as dist

    from parallelisms import ParallelDims, build_mesh
    from parallelisms.parallel_dims import pp_mesh
    from tests.support.parallel_harness import llama3_args
    from tests.support.pipeline_runs import eager_pipeline_step, full_state, llama3_family, pp_model, rank_run
    from trainer.graph import build_graph_step
    from trainer.graph.pipeline import PipelinedLoss

    out = {}
    for mode in modes:
        dims = ParallelDims(pp=2, dp_shard=dp_shard, tp=tp, world_size=dist.get_world_size())
        mesh = build_mesh(dims, "cpu")
        graph = mode.startswith("graph")
        ac_mode = "full" if mode.endswith("_full") else "none"
        request = StepRequest(
            mode="graph" if graph else "eager",
            backend="aot_eager" if graph else "auto",
            pp_degree=2,
            pp_schedule="GPipe",
            pp_microbatches=microbatches,
            pp_first_less=0,
            pp_last_less=0,
            tp_degree=tp,
            loss_parallel="lossparallel" in mode,
            model_has_experts=False,
            ac_mode=ac_mode,
            pp_scan_iterations=mode.startswith("graph_scan"),
            n_layers=N_LAYERS,
            local_batch=BATCH // dp_shard // accum,
        )
        plan = plan_step(request)
        args = llama3_args(N_LAYERS)
        model, opt = pp_model(args, plan, seed=seed, lr=LR, dims=dims, mesh=mesh)
        pp = pp_mesh(mesh)
        if graph:
            loss_fn = PipelinedLoss(
                pp_rank=pp.get_local_rank(),
                pp=2,
                group_name=pp.get_group().group_name,
                microbatches=plan.pipeline.microbatches,
                dim=args.dim,
                dtype=torch.float32,
                scan=plan.pipeline.scan_iterations,
                device=torch.device("cpu"),
                fused=mode == "graph_fused",
                rank_independent=mode == "graph_uniform",
            )
            step = build_graph_step(
                model=model,
                optimizer=opt,
                max_norm=1.0,
                backend="aot_eager",
                grad_accum_steps=accum,
                loss_fn=loss_fn,
                pp_mesh=pp,
                scan_layers="layerscan" in mode,
                ac_mode=plan.scan_ac,
                plan=llama3_family().plan,
                loss_context=plan.loss_context,
            )
        else:
            step = eager_pipeline_step(model, opt, plan, n_layers=N_LAYERS, pp_mesh=pp)
        run_step = (lambda micro: step(micro, LR)) if graph else step
        losses = rank_run(run_step, batches, dp_rank=dims.dp_rank(mesh), dp_shard=dp_shard, accum=accum)
        with plan.loss_context():  # as validation runs it (TP's loss parallel)
            val = step.eval_loss(*batches[0]) if dp_shard == 1 else None
        colls = dict(step.stats.collectives) if graph else None
        code = spmd_text(step.graph_module) if graph else None
        raw = "\n".join(m.code for m in step.graph_module.modules() if hasattr(m, "code")) if graph else None
        saved = step.stats.scan_saved_bytes if graph else None
        out[mode] = (losses, full_state(model), None if val is None else val.item(), colls, code, raw, saved)
    return out


def spmd_text(gm) -> str:
    """The captured graph's code with the permutes' split sizes (the one per-rank constant of
    graph-mode PP: which peer a rank sends to) written as SPLITS: equal on every pp rank when the
    stages are uniform (one SPMD program)."""
    import re

    code = "\n".join(m.code for m in gm.modules() if hasattr(m, "code"))
    return re.sub(r"(all_to_all_single\.default\(\w+), \[[^\]]*\], \[[^\]]*\]", r"\1, SPLITS, SPLITS", code)


def permutes(raw: str) -> int:
    """The stage permutes in a captured graph's code: the all-to-alls with a zero split (one peer
    each way), not the equal-split ones gloo runs reduce-scatters as."""
    import re

    splits = re.findall(r"all_to_all_single\.default\(\w+, \[([^\]]*)\]", raw)
    return sum("0" in [x.strip() for x in s.split(",")] for s in splits)


def graph_mode(mode: str) -> bool:
    return mode.startswith("graph")


def _one_process_val(state, batch) -> float:
    """The loss of the one-process run's final weights on `batch` (validation's reference)."""
    from tests.support.parallel_harness import llama3_args
    from tests.support.pipeline_runs import pp_model
    from trainer.step.loss import lm_loss

    model, _ = pp_model(llama3_args(N_LAYERS), plan_step(StepRequest()), seed=0, lr=LR)
    model.load_state_dict(state)
    with torch.no_grad():
        return lm_loss(model(batch[0]), batch[1]).item()


def _graph_parity(
    nproc: int,
    *,
    dp_shard: int = 1,
    accum: int = 1,
    microbatches: int = 4,
    modes=("graph",),
    tp: int = 1,
    check_val: bool = False,
):
    from tests.support.parallel_harness import llama3_args, run_processes

    batches = _batches(llama3_args(N_LAYERS).vocab_size)
    ref_losses, ref_state = _one_process_reference(0, batches)
    results = run_processes(nproc, _graph_pp_worker, 0, batches, dp_shard, accum, microbatches, modes, tp)
    worst = {}
    for mode in modes:
        w_loss = w_norm = w_weight = w_eager = 0.0
        covered = set()
        for rank_out in results:
            losses, state = rank_out[mode][:2]
            for (loss, norm), (ref_loss, ref_norm) in zip(losses, ref_losses):
                w_loss = max(w_loss, abs(loss - ref_loss) / ref_loss)
                w_norm = max(w_norm, abs(norm - ref_norm) / ref_norm)
            for k, v in state.items():
                w_weight = max(w_weight, (v - ref_state[k]).abs().max().item())
                covered.add(k)
            if graph_mode(mode) and "eager" in modes:
                for (loss, norm), (e_loss, e_norm) in zip(losses, rank_out["eager"][0]):
                    w_eager = max(w_eager, abs(loss - e_loss) / e_loss, abs(norm - e_norm) / e_norm)
        assert covered == set(ref_state), mode
        if check_val:  # validation's pipelined forward on every rank == the one process's final weights
            want = _one_process_val(ref_state, batches[0])
            w_val = max(abs(r[mode][2] - want) / want for r in results)
            print(f"{mode} validation: {w_val:.2e} from one process ({want:.7f})")
            assert w_val < 2e-6, (mode, [r[mode][2] for r in results], want)
        worst[mode] = (w_loss, w_norm, w_weight, w_eager)
        print(
            f"{mode} pp parity: losses {w_loss:.2e}, grad norms {w_norm:.2e}, weights {w_weight:.2e}, vs eager PP {w_eager:.2e}"
        )
        assert w_loss < 2e-6 and w_norm < 1e-5 and w_eager < 2e-6, worst[mode]
        assert w_weight < 0.05 * LR * STEPS, w_weight
    return results, worst


@pytest.mark.multiprocess
def test_graph_pp2_equals_one_process():
    """PP 2 in graph mode (2 chunks of 4 sequences, 3 pipeline iterations, aot_eager) == one process:
    losses, gradient norms, weights; validation's pipelined forward gives the same loss on both
    ranks; each rank's graph holds 2 x 2 permutes (all-to-alls, forward and backward)."""
    results, _ = _graph_parity(2, microbatches=2)
    vals = [r["graph"][2] for r in results]
    assert vals[0] == vals[1], vals
    for r in results:
        colls = r["graph"][3]
        assert colls.get("all_to_all_single") == 4, colls
    # uniform stages: both ranks captured the same program (the stage index is an input)
    codes = [r["graph"][4] for r in results]
    assert "SPLITS" in codes[0] and codes[0] == codes[1]


@pytest.mark.multiprocess
def test_graph_pp2_equals_eager_pp():
    """PP 2, 4 chunks of 2 sequences (5 pipeline iterations), in graph mode and through eager PP's
    GPipe on the same ranks: losses and gradient norms within 2e-6 of each other, both within the
    bounds of one process."""
    _graph_parity(2, modes=("graph", "eager"))


@pytest.mark.multiprocess
def test_graph_pp2_scan_over_iterations_equals_one_process():
    """PP 2 in graph mode with the pipeline's 5 iterations (4 chunks) as one scan: == one process;
    the graph holds one permute forward and one backward (the scan bodies), whatever m."""
    results, _ = _graph_parity(2, modes=("graph_scan",))
    for r in results:
        colls = r["graph_scan"][3]
        assert colls.get("all_to_all_single") == 2, colls


@pytest.mark.multiprocess
def test_graph_pp2_scan_over_iterations_full_ac_keeps_stage_inputs():
    """Full activation checkpointing inside the iteration scan (`[activation_checkpoint] mode = "full"`
    with `[compile] scan_pipeline_iterations`; the step plan's `scan_ac`, the scan body's partition
    tagged by trainer/graph/remat.py `scan_remat`, as layer scan's): PP 2, 2 chunks of 4 sequences,
    T = 3 iterations of the stage's 3 blocks == one process and eager PP's GPipe (the bounds of
    `_graph_parity`), and the forward scan keeps, per iteration, exactly its stacked output and the
    stage's input ([4, 16, 256] fp32 each) and each block's attention output and log-sum-exp: the
    CPU's SDPA is tagged random, which the partitioner cannot recompute inside a scan body on torch
    2.13 (remat.py), so it saves them, as in layer scan's full mode. Before (the blocks' checkpoint wrapper, which does
    not reach the scan body) the scan kept 37,999,104 bytes, with AC as without: every block
    activation and each iteration's copy of the transposed weights (2026-12-07)."""
    from tests.support.parallel_harness import SEQ_LEN, llama3_args

    results, _ = _graph_parity(2, microbatches=2, modes=("graph_scan_full", "eager"))
    args = llama3_args(N_LAYERS)
    chunk = BATCH // 2 * SEQ_LEN * args.dim * 4  # one chunk's hidden states, fp32
    lse = BATCH // 2 * args.n_heads * SEQ_LEN * 4  # one block's attention log-sum-exp, fp32
    blocks, iterations = N_LAYERS // 2, 2 + 2 - 1
    want = iterations * (2 * chunk + blocks * (chunk + lse))
    assert [r["graph_scan_full"][6] for r in results] == [want, want], want


@pytest.mark.multiprocess
def test_graph_pp2_fsdp2_scan_over_iterations_equals_one_process():
    """PP 2 x dp_shard 2 with the pipeline's iterations as one scan (4 gloo processes, 2 chunks): the
    stage's SimpleFSDP DTensor shards enter the scan body as local tensors and are gathered there by
    process-group name, their gradients reduce-scattered there (`_StageBody`; a DTensor inside a
    scan body fails to capture on torch 2.13) == one process."""
    _graph_parity(4, dp_shard=2, microbatches=2, modes=("graph_scan",))


@pytest.mark.multiprocess
def test_graph_pp2_layer_scan_and_fused_loss_equal_one_process():
    """PP 2 in graph mode with layer scan (each stage's 3 blocks one scan, called once per pipeline
    iteration; rank 1's stack holds blocks 3-5, its template block not "0"), and with the fused
    linear + cross-entropy loss (the TPU's default; chunked on the CPU) == one process."""
    results, _ = _graph_parity(2, microbatches=2, modes=("graph_layerscan", "graph_fused"))
    for r in results:
        assert r["graph_layerscan"][3].get("all_to_all_single") == 4


@pytest.mark.multiprocess
def test_graph_pp2_fsdp2_accumulation_equals_one_process():
    """PP 2 x dp_shard 2 in graph mode on 4 gloo processes (SimpleFSDP's gathers and reduce-scatters
    in the same graph as the permutes), 2 accumulation micro-batches of 2 sequences per rank, each
    in 2 chunks == one process."""
    _graph_parity(4, dp_shard=2, accum=2, microbatches=2)


MODES_TP = ("graph", "graph_layerscan_lossparallel")


@pytest.mark.multiprocess
def test_graph_pp2_tp2_equals_one_process():
    """PP 2 x TP 2 in graph mode on 4 gloo processes: each stage's blocks sharded by the tensor-parallel
    plan (sequence parallel between the blocks: the permutes carry each tp rank's sequence shard to
    the pp peer with its tp coordinate; the vocab-parallel embedding, the sequence-parallel norm and
    the column-parallel head replicated over pp), 2 chunks of 4 sequences == one process: losses,
    gradient norms, weights, and validation's pipelined forward on every rank; unrolled with gathered
    logits, and with layer scan and TP's loss parallel (vocab-sharded logits, the TPU layout's
    loss)."""
    results, _ = _graph_parity(4, microbatches=2, tp=2, modes=MODES_TP, check_val=True)
    for r in results:
        # 2 permutes forward and 2 backward (one zero split each way); the other all-to-alls are TP's
        # reduce-scatters, which gloo runs as equal-split all-to-alls (trainer/graph/passes.py)
        for mode in MODES_TP:
            assert permutes(r[mode][5]) == 4, (mode, r[mode][3])


@pytest.mark.multiprocess
def test_graph_pp2_tp2_scan_over_iterations_with_full_ac_equals_one_process():
    """PP 2 x TP 2 with the pipeline's iterations as one scan and full AC in its body (4 gloo
    processes, 2 chunks of 4 sequences): the body runs the stage's TP styles in their local forms
    (parallelisms/scan.py `body_param_fn`, as layer scan's body) == one process (the bounds of
    `_graph_parity`) with validation's pipelined forward; one permute each way (the scan bodies), and
    each tp rank's forward scan keeps half of what the one-rank stage keeps
    (`test_graph_pp2_scan_over_iterations_full_ac_keeps_stage_inputs`: its sequence shard of the
    hidden states, its heads of the attention). Measured 2026-12-07 on the Intel Xeon: losses 1.1e-7,
    grad norms 1.3e-6, weights 5.6e-6, validation 7.5e-8; without AC the same numbers."""
    from tests.support.parallel_harness import SEQ_LEN, llama3_args

    results, _ = _graph_parity(4, microbatches=2, tp=2, modes=("graph_scan_full",), check_val=True)
    args = llama3_args(N_LAYERS)
    chunk = BATCH // 2 * SEQ_LEN * args.dim * 4
    lse = BATCH // 2 * args.n_heads * SEQ_LEN * 4
    want = (2 + 2 - 1) * (2 * chunk + N_LAYERS // 2 * (chunk + lse)) // 2
    for r in results:
        assert permutes(r["graph_scan_full"][5]) == 2, r["graph_scan_full"][3]
        assert r["graph_scan_full"][6] == want


@pytest.mark.multiprocess
def test_graph_pp2_tp2_fsdp2_equals_one_process():
    """PP 2 x TP 2 x FSDP 2 in graph mode on 8 gloo processes (TorchTitan's 3-D layout: SimpleFSDP over
    dp_shard, the TP plan over tp, the stages over pp), 2 sequences per dp rank in 2 chunks == one
    process."""
    results, _ = _graph_parity(8, dp_shard=2, microbatches=2, tp=2)
    for r in results:
        assert permutes(r["graph"][5]) == 4, r["graph"][3]


@pytest.mark.multiprocess
def test_graph_pp2_rank_independent_permute_prints_identically_and_equals_one_process():
    """PP 2 in graph mode with the rank-independent permute (`PipelinedLoss(rank_independent=True)`:
    equal-split all-to-alls selected by the stage tensor) == one process, and the captured graphs
    of rank 0 and rank 1 are the same text as captured (no per-rank constant left to mask); with the
    default permute they differ exactly in the split sizes."""
    results, _ = _graph_parity(2, microbatches=2, modes=("graph_uniform", "graph"))
    raw = [r["graph_uniform"][5] for r in results]
    assert "all_to_all_single" in raw[0] and raw[0] == raw[1]
    for r in results:
        assert r["graph_uniform"][3].get("all_to_all_single") == 4, r["graph_uniform"][3]
    default = [r["graph"][5] for r in results]
    assert default[0] != default[1] and results[0]["graph"][4] == results[1]["graph"][4]


@pytest.mark.parametrize("p", [2, 3, 4])
def test_rank_independent_permute_slots(p):
    """`_shift_uniform`'s send buffers (`uniform_slots`) through an emulated equal-split all-to-all
    (rank r receives slot r of every rank's buffer) and summed, as the permute sums them: rank r gets
    exactly what rank r - shift holds, forward (+1) and backward (-1), every slot but one zero."""
    from trainer.graph.pipeline import uniform_slots

    xs = [torch.full((2, 3), float(r + 1)) for r in range(p)]
    xs[1][0, 0] = float("inf")  # a non-finite value stays in its own slot
    for shift in (1, -1):
        sent = [uniform_slots(xs[r], shift, p, torch.tensor(r)) for r in range(p)]
        for r in range(p):
            got = torch.stack([sent[j][r] for j in range(p)]).sum(0).view(2, 3)
            assert torch.equal(got, xs[(r - shift) % p]), (p, shift, r, got)


def test_graph_pp_rules():
    """Graph-mode PP: uniform stages (first/last_stage_less_layers 0, layers divisible by pp) on
    cpu/cuda and TPU; each refusal one rule-table line naming its key."""
    base = dict(pp_degree=2, model_has_experts=False, n_layers=6, local_batch=4, mode="graph")
    uniform = dict(pp_first_less=0, pp_last_less=0)
    plan = plan_step(StepRequest(**base, **uniform, pp_schedule="GPipe"))
    assert plan.pipeline.microbatches == 2 and plan.pipeline.uniform
    assert plan.pipeline.rank_has_first_last(1) == (True, True)
    tpu = plan_step(StepRequest(**base, **uniform, pp_schedule="GPipe", device_type="tpu", scan_layers=True))
    assert tpu.pipeline.uniform and tpu.scan
    # tensor parallelism inside the stages (sequence parallel), with layer scan too
    assert plan_step(StepRequest(**base, **uniform, pp_schedule="GPipe", tp_degree=2, scan_layers=True)).scan
    lp = plan_step(StepRequest(**base, **uniform, pp_schedule="GPipe", tp_degree=2, loss_parallel=True))
    assert lp.loss_parallel and not lp.fused_loss  # graph mode: TP's loss parallel with PP
    # context parallelism inside the stages of a dense model (tests/unit/test_pipeline_cp.py)
    assert plan_step(
        StepRequest(**base, **uniform, pp_schedule="GPipe", cp_degree=2, model_document_mask=True)
    ).pipeline.uniform
    from models.errors import ConfigError

    for kw, key, fragment in (
        (dict(**uniform), "parallelism.pipeline_schedule", 'allowed: "GPipe"'),
        (dict(pp_schedule="GPipe"), "parallelism.pipeline_first_stage_less_layers", "allowed: pipeline_first"),
        (dict(pp_schedule="GPipe", pp_first_less=0), "parallelism.pipeline_first_stage_less_layers", "= 0"),
        (dict(**uniform, pp_schedule="GPipe", n_layers=7), "parallelism.pipeline_parallel_degree", "divisor of 7"),
        (
            dict(**uniform, pp_schedule="GPipe", mode="eager", device_type="tpu"),
            "parallelism.pipeline_parallel_degree",
            "device tpu",
        ),
    ):
        with pytest.raises(ConfigError) as e:
            plan_step(StepRequest(**{**base, **kw}))
        assert str(e.value).startswith(f"{key}: ") and fragment in str(e.value), str(e.value)
    assert not plan_step(StepRequest(**{**base, "mode": "eager", "pp_schedule": "GPipe"})).pipeline.uniform


def test_graph_pp_iteration_scan_rules():
    """`[compile] scan_pipeline_iterations` (`StepRequest.pp_scan_iterations`): the plan carries it to
    `PipelinePlan.scan_iterations` in graph-mode PP, dense or MoE, with SimpleFSDP, context, expert and
    tensor parallelism; outside graph-mode PP or with layer scan one rule-table line naming the key."""
    from models.errors import ConfigError

    base = dict(pp_degree=2, pp_schedule="GPipe", pp_first_less=0, pp_last_less=0, mode="graph")
    base.update(model_has_experts=False, n_layers=6, local_batch=4, model_document_mask=True)
    assert plan_step(StepRequest(**base, pp_scan_iterations=True)).pipeline.scan_iterations
    assert not plan_step(StepRequest(**base)).pipeline.scan_iterations
    # AC inside the iteration scan: the scan body's partition (`scan_ac`), not the blocks' wrapper
    # (`block_ac`, which does not reach a scan body); unrolled, the blocks' wrapper
    for ac in ("full", "selective"):
        scanned = plan_step(StepRequest(**base, pp_scan_iterations=True, ac_mode=ac))
        assert (scanned.block_ac, scanned.scan_ac, scanned.scan) == ("none", ac, False)
        unrolled = plan_step(StepRequest(**base, ac_mode=ac))
        assert (unrolled.block_ac, unrolled.scan_ac) == (ac, "none")
    scan = dict(base, pp_scan_iterations=True)
    assert plan_step(StepRequest(**scan, cp_degree=2)).pipeline.scan_iterations
    moe = dict(scan, model_has_experts=True)
    assert plan_step(StepRequest(**moe, ep_degree=2, cp_degree=2, device_type="tpu")).pipeline.scan_iterations
    # tensor parallelism in the body (its styles' local forms; since 2026-12-07,
    # test_graph_pp2_tp2_scan_over_iterations_with_full_ac_equals_one_process)
    assert plan_step(StepRequest(**scan, tp_degree=2)).pipeline.scan_iterations
    for kw, fragment in (
        (dict(pp_degree=1), "pipeline_parallel_degree 1"),
        (dict(mode="eager", pp_schedule="1F1B"), "compile.mode eager"),
        (dict(scan_layers=True), "scan_layers True"),
    ):
        with pytest.raises(ConfigError) as e:
            plan_step(StepRequest(**{**scan, **kw}))
        assert str(e.value).startswith("compile.scan_pipeline_iterations: ") and fragment in str(e.value), str(e.value)


def test_permute_shift_reads_rank_zero_s_splits():
    """tools/tpu_compile.py lowers an all-to-all with one nonzero split each way (rank 0 sends to d,
    receives from -d) to the collective permute i -> i + d; any other all-to-all keeps its rule."""
    from tools.tpu_compile import permute_shift

    assert permute_shift([0, 8], [0, 8], 2) == 1  # pp 2: forward and backward alike
    assert permute_shift([0, 0, 0, 8], [0, 8, 0, 0], 4) == 1  # forward: 0 -> 1, 3 -> 0
    assert permute_shift([0, 8, 0, 0], [0, 0, 0, 8], 4) == 3  # backward: 0 -> 3
    assert permute_shift([4, 4], [4, 4], 2) is None  # an equal-split all-to-all
    assert permute_shift(None, None, 2) is None
    assert permute_shift([8, 0], [8, 0], 2) is None  # to itself
    assert permute_shift([0, 8, 0, 0], [0, 8, 0, 0], 4) is None  # not a uniform shift
