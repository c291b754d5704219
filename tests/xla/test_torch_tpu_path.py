"""torch-tpu's own compile path for the graph step, run on the CPU up to its lowering call.

Probe torch_tpu_path.py (ttpu venv: torch-tpu 0.2.0, libtpu 0.0.52): rank 0 of a fake 2-rank process
group builds Llama 3 debugmodel (2 layers) with SimpleFSDP over dp_shard = 2 and
`build_graph_step(backend="tpu")`, and the real path runs (Dynamo under `spmd_safe`, our AOT capture
and passes, torch-tpu's TpuBackend and SplitCompiler) until `fx_to_mlir`, which a stand-in records
and stops: the real one builds the MLIR and the PJRT executable in one call and needs a TPU
(reference/xla_cpu_path.md §D). So this proves the graph reaches torch-tpu's lowering as one
program; not that torch-tpu lowers it.

Checked: the run ends in the stand-in (not an earlier error); every functional collective the
SplitCompiler sees carries `spmd_safe`, so it hands the lowering the whole graph as one partition;
with scan, both scan ops reach the lowering. Control: without `spmd_safe` the same step is split at
its collectives, so the one-partition check can fail.

The `tpu_*` variants take the path a TPU run takes, as `plan_step` plans it on a TPU: bf16
parameters and matmuls, the Pallas ops (`titan_tpu::splash_*`, `titan_tpu::linear_ce_*`) in
place of SDPA and the plain loss, activation checkpointing full (unrolled: the recomputed ops
behind `titan::optimization_barrier` fences; scanned: recomputed in the backward body, which
needs no fence). With scan, the backward scan reaches the lowering without flips and tagged for
torch-tpu's reverse loop (`tag_reverse_scans`), and torch-tpu's own scan lowering, run on that
graph with its device calls recorded, passes `ScanDirection.kReverse` to `create_scan_op` for it
and `kForward` for the forward scan. Control (`scan_flipped`): without the pass, torch's flips
reach the lowering and both scans run forward.

MoE (`tpu_moe_*`, a third probe process): Qwen 3 MoE debug at ep = 2 on the same TPU plan, the
static-shape EP dispatch. With layer scan it reaches the lowering as one program with int shapes
only, no host read, the Pallas grouped matmul and the all-to-alls (torch-tpu's ragged one, or
equal-split). The gradient reaches the experts through both transports: torch-tpu's ragged
all-to-all has no autograd kernel, so `titan_kernels.collectives.differentiable` gives it the reverse
ragged all-to-all (before, the backward body had none and EP got no gradient on a TPU). The
unrolled step reaches the lowering too (it once failed in our remat pass: a recomputed op's
name clashed).

Context parallelism (`tpu_cp2`, `tpu_cp2_doc`, a fifth probe process): Llama 3 debug at cp = 2,
seq 512 (128-token chunks), layer scan, the TPU plan, attention as `build_job` sets it up on a TPU
with cp > 1: k/v (and the segment ids with the document mask) all-gathered over cp inside the
scan bodies, and rank 0's own splash ops `titan_tpu::splash_cp2r0[_seg]_fwd / _bwd`
(`register.build_cp`). The step reaches the lowering as one program, every collective
`spmd_safe` (scan bodies too), the backward scan a reverse loop; the gathered keys' gradients go
back by reduce-scatter in the backward body; the only flips are the CP gather's reorder over the
cp axis. Rank 1's program (other ops, same shapes) is not traced here.

Compile mode (`compile_blocks*`, in a fourth probe process): `[compile] mode = "compile"` on the
tpu backend compiles each block on its own. With the blocks traced under `spmd_safe`
(parallelisms/compile.py), SplitCompiler hands torch-tpu's compiler one partition for the block
forward and one for its backward; the control without the annotation is cut at every
SimpleFSDP all-gather (forward) and reduce-scatter (backward): 2 x collectives + 1 partitions.
Here torch-tpu's per-partition compiler is a recorder that runs each partition on the CPU, so
the backward is compiled as well (the graph-mode variants stop at the first lowering call).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xla


TPU_RUN_VARIANTS = ("scan_flipped", "tpu_unrolled", "tpu_scan")
"""Run in a second probe process (the first, conftest's TORCH_TPU_VARIANTS, starts early)."""
MOE_VARIANTS = ("tpu_moe_ep2", "tpu_moe_ep2_equal", "tpu_moe_ep2_unrolled")
"""Run in a third probe process (Qwen 3 MoE debug at ep 2; about 40 s each on one core)."""
COMPILE_VARIANTS = ("compile_blocks", "compile_blocks_unannotated")
"""`[compile] mode = "compile"`, in a fourth probe process (about 50 s for both on one core)."""
CP_VARIANTS = ("tpu_cp2", "tpu_cp2_doc")
"""Context parallelism at cp 2, in a fifth probe process (about 40 s for both on one core)."""


@pytest.fixture(scope="module")
def tpu_run_path(probe) -> dict:
    return probe("ttpu", "torch_tpu_path.py", *TPU_RUN_VARIANTS, timeout=1500)


@pytest.fixture(scope="module")
def compile_path(probe) -> dict:
    return probe("ttpu", "torch_tpu_path.py", *COMPILE_VARIANTS, timeout=900)


@pytest.fixture(scope="module")
def tpu_moe_path(probe) -> dict:
    return probe("ttpu", "torch_tpu_path.py", *MOE_VARIANTS, timeout=1500)


@pytest.fixture(scope="module")
def tpu_cp_path(probe) -> dict:
    return probe("ttpu", "torch_tpu_path.py", *CP_VARIANTS, timeout=1500)


def _variant(source, name: str) -> dict:
    """The probe's result for variant `name`; `source` is the probe's JSON or the pytest request."""
    if not isinstance(source, dict):
        source = source.getfixturevalue(
            "tpu_cp_path"
            if name in CP_VARIANTS
            else "tpu_moe_path"
            if name in MOE_VARIANTS
            else "tpu_run_path"
            if name in TPU_RUN_VARIANTS
            else "torch_tpu_path"
        )
    res = source["variants"][name]
    assert "error" not in res, f"{name}: {res['error']}\n{res.get('traceback', '')}"
    assert res["reached_fx_to_mlir"] and res["exception_chain"].endswith("ReachedLowering"), (
        res.get("error_text"),
        res,
    )
    return res


@pytest.mark.parametrize("name", ["unrolled", "scan", "tpu_unrolled", "tpu_scan"])
def test_step_reaches_torch_tpu_lowering_as_one_program(request, name):
    res = _variant(request, name)
    assert res["split_collectives"] > 0, res
    assert res["split_collectives_spmd_safe"] == res["split_collectives"], res
    # One partition: the graph given to fx_to_mlir is the whole graph SplitCompiler received.
    assert res["mlir_nodes"] == res["split_input_nodes"], res
    assert res["mlir_collectives"] == res["split_collectives"], res
    scan = name.endswith("scan")
    assert res["mlir_scans"] == (2 if scan else 0), res
    # With scan, SimpleFSDP's per-layer all-gathers / reduce-scatters are inside the scan bodies;
    # they carry the annotation too (whether torch-tpu lowers them there needs a TPU).
    assert res["split_body_collectives_spmd_safe"] == res["split_body_collectives"], res
    assert (res["split_body_collectives"] > 0) == scan, res
    # No flipped copy reaches the lowering (with scan: tag_reverse_scans removed torch's flips).
    assert res["mlir_flips"] == 0, res


@pytest.mark.parametrize("name", ["tpu_unrolled", "tpu_scan"])
def test_tpu_run_lowers_bf16_pallas_ops_and_checkpointing(request, name):
    res = _variant(request, name)
    scan = name == "tpu_scan"
    assert res["plan"] == {
        "param_dtype": "torch.bfloat16",
        "block_ac": "none" if scan else "full",
        "scan_ac": "full" if scan else "none",
        "fused_loss": True,
        "scan": scan,
    }, res
    # Every matmul of the step (forward, recompute, backward; in scan bodies too) runs in bf16.
    assert res["mlir_matmuls"] > 0 and res["mlir_bf16_matmuls"] == res["mlir_matmuls"], res
    # Attention is splash, the loss the fused kernel: no SDPA and one fused loss per micro-batch.
    # AC full runs the attention forward again in the backward: per layer (or per scan body) one
    # forward, one recomputed forward and one backward op.
    layers = 1 if scan else 2
    assert res["mlir_sdpa"] == 0, res
    assert res["mlir_titan_tpu_ops"] == {
        "titan_tpu::linear_ce_bwd": 1,
        "titan_tpu::linear_ce_fwd": 1,
        "titan_tpu::splash_bwd": layers,
        "titan_tpu::splash_fwd": 2 * layers,
    }, res
    if scan:  # the backward body recomputes from the saved layer input; no remat fence is needed there
        assert res["mlir_barriers"] == 0, res
    else:  # the recomputed ops read forward values through the fences, which reach the lowering
        assert res["project_recomputed"] > 0 and res["mlir_barriers"] > 0, res
    # Each top-level reduce-scatter's shard passes one barrier (fence_reduce_scatters_pass): with
    # scan the parameters outside the stack (embedding, final norm, head), unrolled every one.
    assert res["mlir_reduce_scatter_fences"] == (3 if scan else 3 + layers * 9), res


@pytest.mark.parametrize("name", ["scan", "tpu_scan"])
def test_backward_scan_lowers_as_a_reverse_loop(request, name):
    res = _variant(request, name)
    forward, backward = res["scan_lowering"]
    for rec in (forward, backward):
        assert "error" not in rec, rec
        # torch-tpu's scan lowering ran to create_scan_op, with every stacked input scanned.
        assert rec["num_scan_inputs"] == rec["xs"] and rec["body_lowered"] > 0, rec
    assert forward["body_tagged_nodes"] == 0 and not forward["asks_for_reverse"], forward
    assert forward["direction"] == "kForward", forward
    # The tag survived torch-tpu's own AOT re-trace of the graph on every node of the body.
    assert backward["body_tagged_nodes"] == backward["body_nodes"] and backward["asks_for_reverse"], backward
    assert backward["direction"] == "kReverse", backward
    # The per-layer weight gradients are the backward's stacked outputs.
    assert backward["ys"] > 0, backward


def test_without_the_tag_flips_reach_the_lowering(request):
    res = _variant(request, "scan_flipped")
    assert res["project_flips"] > 0 and res["mlir_flips"] > 0, res
    assert [rec["direction"] for rec in res["scan_lowering"]] == ["kForward", "kForward"], res
    assert not any(rec["asks_for_reverse"] for rec in res["scan_lowering"]), res


def test_without_spmd_safe_the_step_is_split(torch_tpu_path):
    res = _variant(torch_tpu_path, "unrolled_unannotated")
    assert res["split_collectives"] > 0 and res["split_collectives_spmd_safe"] == 0, res
    assert res["mlir_nodes"] < res["split_input_nodes"], res


# --- MoE with expert parallelism ------------------------------------------------------------------
# Qwen 3 MoE debug (2 layers) at ep = 2 on the TPU plan (bf16, Pallas ops, AC full, aux loss),
# the static-shape EP dispatch (`dispatch_combine_static`). `tpu_moe_ep2`: layer scan, torch-tpu's
# `ragged_all_to_all` as `select_dispatch` picks it on a TPU; `tpu_moe_ep2_equal`: layer scan, the
# equal-split all-to-alls (the control for the gradient); `tpu_moe_ep2_unrolled`: no scan.


def _one_scanned_tpu_program(res):
    """The TPU plan (bf16, AC full in the scan, fused loss) reached fx_to_mlir as one program with
    its forward and backward scans, every collective (scan bodies included) spmd_safe."""
    assert res["plan"] == {
        "param_dtype": "torch.bfloat16",
        "block_ac": "none",
        "scan_ac": "full",
        "fused_loss": True,
        "scan": True,
    }, res
    assert res["split_collectives"] > 0 and res["split_collectives_spmd_safe"] == res["split_collectives"], res
    assert res["split_body_collectives"] > 0, res
    assert res["split_body_collectives_spmd_safe"] == res["split_body_collectives"], res
    assert res["mlir_nodes"] == res["split_input_nodes"] and res["mlir_scans"] == 2, res


@pytest.mark.parametrize("name", ["tpu_moe_ep2", "tpu_moe_ep2_equal"])
def test_moe_ep_step_reaches_lowering_with_static_shapes(request, name):
    res = _variant(request, name)
    # One program: SplitCompiler hands fx_to_mlir the whole graph, every collective spmd_safe.
    _one_scanned_tpu_program(res)
    # Static shapes: every node that reaches the lowering (graph and scan bodies) has a value
    # whose shape is all ints; nothing reads a device value on the host.
    assert res["mlir_symbolic_count"] == 0 and res["mlir_nodes_without_val"] == 0, res["mlir_symbolic_shapes"]
    assert res["mlir_host_reads"] == {}, res
    # Graphs: the step, the forward scan body, the backward scan body (AC full: it recomputes the
    # forward). The experts are the Pallas grouped matmul (w1/w3 and w2: 3 per layer), forward
    # in both bodies, backward in the backward one; the per-peer count table is one all-to-all.
    step, fwd, bwd = res["mlir_per_graph"]
    ragged = name == "tpu_moe_ep2"
    transport = {"tpu::_ragged_all_to_all": 2} if ragged else {"_c10d_functional::all_to_all_single": 2}
    table = {"_c10d_functional::all_to_all_single": 1}
    expected_fwd = {**transport, **table, "titan_tpu::gmm_t": 3}
    if not ragged:
        expected_fwd["_c10d_functional::all_to_all_single"] = 3
    else:
        # The reverse ragged all-to-alls' offset exchanges (one integer per peer, four per layer
        # body) read forward values only, so AOT's partitioner places them in the forward body.
        expected_fwd["_c10d_functional::all_to_all_single"] = 1 + 4
    assert step == {} and fwd == expected_fwd, res["mlir_per_graph"]
    assert bwd["titan_tpu::gmm_t"] == 3 and bwd["titan_tpu::gmm_t_bwd"] == 3, res["mlir_per_graph"]
    assert res["scan_lowering"][1]["direction"] == "kReverse", res["scan_lowering"]


def _gradient_transport(request, name: str) -> tuple[int, int, list]:
    res = _variant(request, name)
    _, fwd, bwd = res["mlir_per_graph"]

    def moves(graph: dict) -> int:
        return sum(c for k, c in graph.items() if "all_to_all" in k)

    return moves(fwd), moves(bwd), res["backprop_without_autograd_kernel"]


def test_moe_ep_gradient_moves_through_equal_split_all_to_all(request):
    # Backward body: the recomputed forward's moves, plus the transposed dispatch and combine.
    fwd, bwd, no_autograd = _gradient_transport(request, "tpu_moe_ep2_equal")
    assert bwd == fwd + 2 and no_autograd == [], (fwd, bwd, no_autograd)


def test_moe_ep_gradient_moves_through_ragged_all_to_all(request):
    # Backward body: the recomputed forward's two ragged moves plus the reverse dispatch and
    # combine (`titan_kernels.collectives.differentiable`).
    res = _variant(request, "tpu_moe_ep2")
    _, fwd, bwd = res["mlir_per_graph"]
    assert res["backprop_without_autograd_kernel"] == [], res["backprop_without_autograd_kernel"]
    assert fwd["tpu::_ragged_all_to_all"] == 2 and bwd["tpu::_ragged_all_to_all"] == 4, res["mlir_per_graph"]


def test_moe_ep_unrolled_reaches_lowering(request):
    res = _variant(request, "tpu_moe_ep2_unrolled")
    assert res["mlir_symbolic_count"] == 0 and res["mlir_host_reads"] == {}, res


# --- context parallelism ------------------------------------------------------------------------------
# Llama 3 debug (2 layers) at cp 2, seq 512, layer scan, the TPU plan; rank 0 of the cp group.


@pytest.mark.parametrize("name", CP_VARIANTS)
def test_cp_step_reaches_lowering_with_rank_specific_splash(request, name):
    res = _variant(request, name)
    doc = name.endswith("_doc")
    # One program: SplitCompiler hands fx_to_mlir the whole graph; every collective, the k/v
    # all-gathers in the scan bodies included, carries spmd_safe.
    _one_scanned_tpu_program(res)
    assert res["mlir_matmuls"] > 0 and res["mlir_bf16_matmuls"] == res["mlir_matmuls"], res
    # Attention is this rank's CP splash (forward, its recompute under AC full, backward), no SDPA.
    op = "titan_tpu::splash_cp2r0_seg" if doc else "titan_tpu::splash_cp2r0"
    assert res["mlir_sdpa"] == 0, res
    assert res["mlir_titan_tpu_ops"] == {
        "titan_tpu::linear_ce_bwd": 1,
        "titan_tpu::linear_ce_fwd": 1,
        f"{op}_bwd": 1,
        f"{op}_fwd": 2,
    }, res
    step, fwd, bwd = res["cp_per_graph"]
    assert fwd[f"{op}_fwd"] == 1 and bwd[f"{op}_fwd"] == 1 and bwd[f"{op}_bwd"] == 1, res["cp_per_graph"]
    # The backward body gathers again what the forward body gathered (SimpleFSDP's weights, k/v,
    # the segment ids), and reduce-scatters the gradient of each but the segment ids.
    ag, rs = "_c10d_functional::all_gather_into_tensor", "_c10d_functional::reduce_scatter_tensor"
    assert fwd[ag] == bwd[ag] and bwd[rs] == fwd[ag] - doc, res["cp_per_graph"]
    # The loss's token count is all-reduced over cp at the top level.
    assert step.get("_c10d_functional::all_reduce", 0) >= 1, step
    forward, backward = res["scan_lowering"]
    assert "error" not in forward and "error" not in backward, res["scan_lowering"]
    assert forward["direction"] == "kForward" and backward["direction"] == "kReverse", res["scan_lowering"]
    # The only flips: the CP gather's reorder of the late chunks over the cp axis ([cp, chunk, ...]),
    # two per body pass (k, v; and the segment ids), none over a scan's layer axis.
    assert res["cp_flips"] and all(f["dims"] == [0] and f["shape"][:2] == [2, 128] for f in res["cp_flips"]), res[
        "cp_flips"
    ]
    assert res["mlir_flips"] == len(res["cp_flips"]), res


def test_cp_document_mask_gathers_the_segment_ids(request):
    plain, doc = (_variant(request, name)["cp_per_graph"] for name in CP_VARIANTS)
    ag = "_c10d_functional::all_gather_into_tensor"
    assert doc[1][ag] == plain[1][ag] + 1 and doc[2][ag] == plain[2][ag] + 1, (plain, doc)


# --- compile mode: one program per block ---------------------------------------------------------------


def _compile_variant(request, name: str) -> dict:
    res = request.getfixturevalue("compile_path")["variants"][name]
    assert "error" not in res, f"{name}: {res['error']}\n{res.get('traceback', '')}"
    return res


def test_compile_mode_is_one_partition_per_block_forward_and_backward(request):
    res = _compile_variant(request, "compile_blocks")
    calls = res["split_calls"]
    # One Dynamo graph serves both blocks (the block is the same code); its forward and its
    # backward each reach SplitCompiler once, with SimpleFSDP's collectives, all annotated.
    assert [c["is_fwd"] for c in calls] == [True, False], calls
    for call in calls:
        assert call["collectives"] > 0 and call["spmd_safe"] == call["collectives"], call
        assert call["partitions"] == 1, call
    assert res["params_with_grad"] == res["params"], res
    assert res["block_forward_types"] == ["function", "function"], res  # the spmd_safe wrapper


def test_compile_mode_without_spmd_safe_is_split_at_every_collective(request):
    res = _compile_variant(request, "compile_blocks_unannotated")
    calls = res["split_calls"]
    assert [c["is_fwd"] for c in calls] == [True, False], calls
    for call in calls:
        assert call["collectives"] > 0 and call["spmd_safe"] == 0, call
        # Each collective in a partition of its own, with compute before, between and after.
        assert call["partitions"] == 2 * call["collectives"] + 1, call
