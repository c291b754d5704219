"""The projector's price of a low-precision dot (tools/xla_hlo.py `peak_rates`, `mxu_flops`;
tools/mfu_projection.py's scheduled prediction): a dot whose operands are float8 on a v7x, int8 on
a v6e, runs at the chip's low-precision peak (twice bf16's, assets/anchors.toml), so a compute-bound
float8 dot takes half the bf16 dot's time. Hand-written scheduled HLO in the form XLA:TPU writes
these dots (a `convolution` of f8e4m3fn / s8 operands inside an output fusion, as the deviceless
compile of `lax.dot_general` on float8 operands gives; XLA's Mosaic call for a `ragged-dot`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.mfu_report import load_anchors
from tools.xla_hlo import compute_ops, mxu_flops, parse_hlo, peak_rates

M, K, N = 4096, 8192, 8192
FLOPS = 2.0 * M * K * N


def program(a: str, b: str, out: str = "bf16") -> str:
    """One dot fusion [M, K] x [N, K]^T of operand types a, b (as XLA:TPU writes a dot: a
    convolution in a kOutput fusion), the whole program."""
    return (
        "HloModule m, is_scheduled=true\n\n"
        f"%fused (p0: {a}[{M},{K}], p1: {b}[{N},{K}]) -> {out}[{M},{N}] {{\n"
        f"  %p0 = {a}[{M},{K}]{{1,0}} parameter(0)\n"
        f"  %p1 = {b}[{N},{K}]{{1,0}} parameter(1)\n"
        f"  ROOT %c = {out}[{M},{N}]{{1,0}} convolution(%p0, %p1), dim_labels=bf_oi->bf\n"
        "}\n\n"
        f"ENTRY %main (x: {a}[{M},{K}], w: {b}[{N},{K}]) -> {out}[{M},{N}] {{\n"
        f"  %x = {a}[{M},{K}]{{1,0}} parameter(0)\n"
        f"  %w = {b}[{N},{K}]{{1,0}} parameter(1)\n"
        f"  ROOT %f = {out}[{M},{N}]{{1,0}} fusion(%x, %w), kind=kOutput, calls=%fused\n"
        "}\n"
    )


RAGGED = (
    "HloModule m, is_scheduled=true\n\n"
    "ENTRY %main (x: f8e4m3fn[2048,1024], w: f8e4m3fn[8,1024,512], s: s32[1]) -> f32[2048,512] {\n"
    "  %x = f8e4m3fn[2048,1024]{1,0} parameter(0)\n"
    "  %w = f8e4m3fn[8,1024,512]{2,1,0} parameter(1)\n"
    "  %s = s32[1]{0} parameter(2)\n"
    '  ROOT %ragged-dot-none = f32[2048,512]{1,0} custom-call(%s, %x, %w), custom_call_target="tpu_custom_call", '
    'frontend_attributes={ragged_dot_tiling="256,1024,512"}, metadata={op_name="ragged-dot-none"}, '
    'backend_config={"custom_call_config":{"cost_estimate":{"flops":"2147483648","transcendentals":"0",'
    '"bytes_accessed":"10485792"}}}\n'
    "}\n"
)


def test_the_chips_rates_come_from_the_anchors():
    """v7x: float8 4,614 over bf16 2,307 TFLOP/s per chip; v6e: int8 1,836 over 918, float8 not listed
    (it runs at the bf16 rate there); a chip without the table: none."""
    anchors = load_anchors()
    assert peak_rates(anchors, "v7x") == {"f8e4m3fn": 2.0, "f8e5m2": 2.0}
    assert peak_rates(anchors, "v6e") == {"s8": 2.0, "u8": 2.0}
    assert peak_rates(anchors, "v5p") == {}


@pytest.mark.parametrize(
    "gen, a, b, factor",
    [
        ("v7x", "f8e4m3fn", "f8e4m3fn", 0.5),  # FP8 at twice the bf16 rate
        ("v7x", "f8e4m3fn", "f8e5m2", 0.5),  # the gradient's e5m2 too
        ("v7x", "f8e4m3fn", "bf16", 1.0),  # one bf16 operand: the bf16 rate
        ("v7x", "bf16", "bf16", 1.0),
        ("v6e", "s8", "s8", 0.5),  # int8 at twice the bf16 rate
        ("v6e", "f8e4m3fn", "f8e4m3fn", 1.0),  # FP8 on a v6e: the bf16 rate
    ],
)
def test_a_low_precision_dot_is_charged_at_its_rate(gen, a, b, factor):
    """The dot's MXU FLOPs (its 2 M N K; dims multiples of the 256-wide MXU: no padding) over its
    operands' rate: the bf16-equivalent FLOPs the walk divides by the bf16 peak. The FLOPs executed
    (`compute_ops`) stay 2 M N K whatever the type."""
    hlo = parse_hlo(program(a, b))
    assert mxu_flops(hlo, 256, peak_rates(load_anchors(), gen))["f"] == FLOPS * factor
    assert mxu_flops(hlo, 256)["f"] == FLOPS  # without rates: every dot at the bf16 rate
    assert [o.flops for o in compute_ops(hlo) if o.name == "f"] == [FLOPS]


def test_xlas_ragged_dot_is_an_xla_op_at_its_estimate_and_rate():
    """XLA:TPU lowers `lax.ragged_dot` to a Mosaic call of its own (`ragged-dot-*`, with a
    cost_estimate of the rows' 2 M N K): an XLA op (not one of the program's kernels, whose time the
    capture's model gives), its FLOPs the estimate's, at float8's rate on a v7x."""
    hlo = parse_hlo(RAGGED)
    (op,) = [o for o in compute_ops(hlo) if o.name == "ragged-dot-none"]
    assert (op.kind, op.flops, op.bytes) == ("xla", 2.0 * 2048 * 1024 * 512, 10485792.0)
    assert mxu_flops(hlo, 256, peak_rates(load_anchors(), "v7x"))["ragged-dot-none"] == 2048 * 1024 * 512


def test_the_scheduled_prediction_of_a_float8_program_is_half_the_bf16_ones(tmp_path: Path):
    """tools/mfu_projection.py `program_times` (the scheduled walk of a compiled program) on the same
    compute-bound dot, float8 vs bf16 operands on a v7x device (1,153.5 TFLOP/s bf16 at the
    calibrated MXU efficiency): the float8 program's step is half; the dot's bytes (96 MiB bf16 at
    3,690 GB/s: 27 us) are far below its compute (2 x 4096 x 8192^2 / (1153.5e12 x 0.66): 723 us)."""
    from tools import xla_projection as xp
    from tools.mfu_projection import program_times

    anchors = load_anchors()
    peak, hbm = 1153.5e12, anchors["hbm_gbps_per_device"]["v7x"] * 1e9
    steps = {}
    for dtype in ("bf16", "f8e4m3fn"):
        path = tmp_path / f"{dtype}.txt"
        path.write_text(program(dtype, dtype))
        t = program_times(
            {"hlo": str(path), "devices": 1},
            peak=peak,
            hbm=hbm,
            ici=anchors["ici"]["v7x"],
            target_devices=1,
            generation="v7x",
        )
        steps[dtype] = t["step_scheduled_s"]
    assert steps["bf16"] == pytest.approx(FLOPS / (peak * xp.MXU_EFFICIENCY), rel=1e-9)
    assert steps["f8e4m3fn"] == pytest.approx(steps["bf16"] / 2, rel=1e-9)


def masked_program(groups: int, chunks: int) -> str:
    """The grouped weight gradient as XLA:TPU lowers a ragged dot's contracting mode (the form its
    deviceless compile of `lax.ragged_dot_general` gives): one convolution over `groups` masked copies
    of the 2048 rows, its fusion skipping the iterations whose mask is empty (`groups` x `chunks`
    row iterations)."""
    g = groups
    return (
        "HloModule m, is_scheduled=true\n\n"
        f"%fused (a: f8e4m3fn[{g},2048,512], b: f8e4m3fn[{g},2048,1024]) -> bf16[{g},512,1024] {{\n"
        f"  %a = f8e4m3fn[{g},2048,512]{{2,1,0}} parameter(0)\n"
        f"  %b = f8e4m3fn[{g},2048,1024]{{2,1,0}} parameter(1)\n"
        f"  ROOT %c = bf16[{g},512,1024]{{2,1,0}} convolution(%a, %b), window={{size={g} stride={g - 1} "
        f"lhs_dilate={g}}}, dim_labels=0fb_0io->0bf\n"
        "}\n\n"
        f"ENTRY %main (x: f8e4m3fn[{g},2048,512], y: f8e4m3fn[{g},2048,1024]) -> bf16[{g},512,1024] {{\n"
        f"  %x = f8e4m3fn[{g},2048,512]{{2,1,0}} parameter(0)\n"
        f"  %y = f8e4m3fn[{g},2048,1024]{{2,1,0}} parameter(1)\n"
        f"  ROOT %f = bf16[{g},512,1024]{{2,1,0}} fusion(%x, %y), kind=kOutput, calls=%fused, "
        'backend_config={"window_config":{"iteration_bounds":["1","' + str(g) + '","1","1","' + str(chunks) + '"]},'
        '"mask_aggregator_config":{"mask_dim_to_iteration_index":["1","4"],"write_outputs_of_masked_iterations":false,'
        '"mask_value":0,"iteration_skipper_mode":"ITERATION_SKIPPER_MODE_GROUP_STARTS"}}\n'
        "}\n"
    )


@pytest.mark.parametrize("groups, chunks", [(8, 4), (8, 64)])
def test_a_masked_group_convolution_is_charged_for_the_iterations_it_runs(groups, chunks):
    """The convolution's taps are every group's copy of the rows: groups x 2 x 2048 x 512 x 1024 FLOPs;
    the fusion runs the row chunks of each group's own rows, chunks + groups - 1 of groups x chunks
    iterations with the rows split evenly (a chunk at a group boundary runs for both groups), and the
    projector charges that share (8 groups in 4 chunks: 11 / 32; in 64: 71 / 512)."""
    from tools.xla_hlo import dot_flops_by_type

    hlo = parse_hlo(masked_program(groups, chunks))
    taps = groups * 2.0 * 2048 * 512 * 1024
    share = (chunks + groups - 1) / (groups * chunks)
    (op,) = [o for o in compute_ops(hlo) if o.name == "f"]
    assert op.flops == pytest.approx(taps * share, rel=1e-12)
    assert mxu_flops(hlo, 256, peak_rates(load_anchors(), "v7x"))["f"] == pytest.approx(taps * share / 2, rel=1e-12)
    assert dot_flops_by_type(hlo) == {"f8e4m3fn x f8e4m3fn": pytest.approx(taps * share, rel=1e-12)}


NESTED_RAGGED = (
    "HloModule m, is_scheduled=true\n\n"
    "%conv (k: f8e4m3fn[8,1536,4096], a: f8e4m3fn[8,81920,4096]) -> bf16[8,81920,1536] {\n"
    "  %k = f8e4m3fn[8,1536,4096]{2,1,0} parameter(0)\n"
    "  %a = f8e4m3fn[8,81920,4096]{2,1,0} parameter(1)\n"
    "  ROOT %c = bf16[8,81920,1536]{2,1,0} convolution(%a, %k), window={size=8 stride=7 lhs_dilate=8}, "
    "dim_labels=0bf_0oi->0bf\n"
    "}\n\n"
    "%outer (k: f8e4m3fn[8,1536,4096], a: f8e4m3fn[8,81920,4096]) -> bf16[8,81920,1536] {\n"
    "  %k = f8e4m3fn[8,1536,4096]{2,1,0} parameter(0)\n"
    "  %a = f8e4m3fn[8,81920,4096]{2,1,0} parameter(1)\n"
    "  ROOT %inner = bf16[8,81920,1536]{2,1,0} fusion(%k, %a), kind=kOutput, calls=%conv, "
    'backend_config={"convolution_algorithm_config":{"is_ragged_dot":true,"num_groups_in_ragged_dot":"8"},'
    '"mask_aggregator_config":{"iteration_skipper_mode":"ITERATION_SKIPPER_MODE_GROUP_STARTS",'
    '"mask_dim_to_iteration_index":["1","2"]},"window_config":{"iteration_bounds":[]}}\n'
    "}\n\n"
    "ENTRY %main (k: f8e4m3fn[8,1536,4096], a: f8e4m3fn[8,81920,4096]) -> bf16[8,81920,1536] {\n"
    "  %k = f8e4m3fn[8,1536,4096]{2,1,0} parameter(0)\n"
    "  %a = f8e4m3fn[8,81920,4096]{2,1,0} parameter(1)\n"
    "  ROOT %f = bf16[8,81920,1536]{2,1,0} fusion(%k, %a), kind=kCustom, calls=%outer\n"
    "}\n"
)


def test_a_nested_ragged_dot_without_iteration_bounds_is_charged_its_rows_once():
    """The MoE pod programs' ragged dots (the experts' float8 forward, 81,920 rows per device over 8
    local experts): the scheduled fusion (kCustom) calls one (kOutput) whose config says
    `is_ragged_dot` with 8 groups and the group-starts skipper but leaves the iteration bounds to the
    emitter; its convolution's taps are the 8 groups' copies of every row. Charged: each row in its
    own group, 2 x 81920 x 1536 x 4096 (was 8x that: the Qwen3-235B FP8 program's dot ops at 26.5 s
    instead of 4.5 s), at float8's rate in the MXU FLOPs."""
    from tools.xla_hlo import dot_flops_by_type

    hlo = parse_hlo(NESTED_RAGGED)
    rows = 2.0 * 81920 * 1536 * 4096
    (op,) = [o for o in compute_ops(hlo) if o.name == "f"]
    assert op.flops == pytest.approx(rows, rel=1e-12)
    assert mxu_flops(hlo, 256, peak_rates(load_anchors(), "v7x"))["f"] == pytest.approx(rows / 2, rel=1e-12)
    assert dot_flops_by_type(hlo) == {"f8e4m3fn x f8e4m3fn": pytest.approx(rows, rel=1e-12)}
