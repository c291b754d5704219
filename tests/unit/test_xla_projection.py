"""tools/xla_projection.py on a hand-written HLO program: parsing, FLOPs and bytes per op, while
trip counts, collectives and their mesh axes, the ring times and the bound. Plain text, no jax."""

import math

import pytest

from tools import xla_projection as xp

# 8 devices as a (data=2, fsdp=4) mesh. A while loop (3 trips) holds an all-gather over fsdp, a
# fusion with a dot, and a Mosaic call with a cost estimate; ENTRY holds a reduce-scatter over fsdp
# in XLA:TPU's fused form, an all-reduce over data (iota groups), an async all-gather over both
# axes (mesh form), an all-to-all over fsdp and a collective-permute.
HLO = r"""
HloModule jit_step_fn, entry_computation_layout={(bf16[64,32]{1,0})->bf16[64,32]{1,0}}

%fused_dot (p0: bf16[16,32], p1: bf16[32,64]) -> bf16[16,64] {
  %p0 = bf16[16,32]{1,0} parameter(0)
  %p1 = bf16[32,64]{1,0} parameter(1)
  ROOT %dot.1 = bf16[16,64]{1,0:T(8,128)(2,1)} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_conv (q0: bf16[4,16,32,1], q1: bf16[8,64,32,1]) -> bf16[4,16,8,64] {
  %q0 = bf16[4,16,32,1]{3,2,1,0} parameter(0)
  %q1 = bf16[8,64,32,1]{3,2,1,0} parameter(1)
  ROOT %convolution.3 = bf16[4,16,8,64]{3,2,1,0} convolution(%q0, %q1), window={size=1x8 pad=0_0x7_7 rhs_reversal=0x1}, dim_labels=0bf1_1oi0->0b1f
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%all-reduce-scatter (input: f32[64,32]) -> f32[16,32] {
  %input = f32[64,32]{1,0} parameter(0)
  %all-reduce.9 = f32[64,32]{1,0} all-reduce(%input), channel_id=9, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %offset = s32[] constant(0)
  ROOT %dynamic-slice.1 = f32[16,32]{1,0} dynamic-slice(%all-reduce.9, %offset, %offset), dynamic_slice_sizes={16,32}
}

%body (state: (s32[], bf16[16,32], bf16[8,64])) -> (s32[], bf16[16,32], bf16[8,64]) {
  %state = (s32[], bf16[16,32]{1,0}, bf16[8,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %x = bf16[16,32]{1,0} get-tuple-element(%state), index=1
  %w = bf16[8,64]{1,0} get-tuple-element(%state), index=2
  %all-gather.1 = bf16[32,64]{1,0:T(8,128)(2,1)} all-gather(%w), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %fusion.1 = bf16[16,64]{1,0} fusion(%x, %all-gather.1), kind=kOutput, calls=%fused_dot
  %kernel.1 = bf16[16,32]{1,0} custom-call(%x, %w), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{}"
}}, backend_config={"custom_call_config":{"body":"AAAA","cost_estimate":{"bytes_accessed":"5000","flops":"1000000","transcendentals":"0"}}}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], bf16[16,32], bf16[8,64]) tuple(%next, %kernel.1, %w)
}

%cond (cstate: (s32[], bf16[16,32], bf16[8,64])) -> pred[] {
  %cstate = (s32[], bf16[16,32]{1,0}, bf16[8,64]{1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%cstate), index=0
  %limit = s32[] constant(3)
  ROOT %lt = pred[] compare(%ci, %limit), direction=LT
}

ENTRY %main (param.0: bf16[16,32], param.1: bf16[8,64], param.2: f32[64,32], param.3: bf16[4,16,32,1], param.4: bf16[8,64,32,1]) -> bf16[16,32] {
  %param.0 = bf16[16,32]{1,0} parameter(0)
  %param.1 = bf16[8,64]{1,0} parameter(1)
  %param.2 = f32[64,32]{1,0} parameter(2)
  %param.3 = bf16[4,16,32,1]{3,2,1,0} parameter(3)
  %param.4 = bf16[8,64,32,1]{3,2,1,0} parameter(4)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[16,32]{1,0}, bf16[8,64]{1,0}) tuple(%zero, %param.0, %param.1)
  %while.1 = (s32[], bf16[16,32]{1,0}, bf16[8,64]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %fusion.2 = f32[16,32]{1,0:T(8,128)S(1)} fusion(%param.2), kind=kCustom, calls=%all-reduce-scatter
  %all-reduce.2 = f32[16,32]{1,0} all-reduce(%fusion.2), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
  %all-gather-start.3 = (bf16[16,32]{1,0}, bf16[128,32]{1,0}) all-gather-start(%param.0), channel_id=3, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}, dimensions={0}
  %all-gather-done.3 = bf16[128,32]{1,0} all-gather-done(%all-gather-start.3)
  %all-to-all.4 = bf16[16,32]{1,0} all-to-all(%param.0), channel_id=4, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={0}
  %collective-permute.5 = bf16[16,32]{1,0} collective-permute(%param.0), channel_id=5, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %fusion.3 = bf16[4,16,8,64]{3,2,1,0} fusion(%param.3, %param.4), kind=kOutput, calls=%fused_conv
  ROOT %result = bf16[16,32]{1,0} get-tuple-element(%while.1), index=1
}
"""

MESH = {"data": 2, "fsdp": 4}


@pytest.fixture(scope="module")
def hlo():
    return xp.parse_hlo(HLO)


def test_parse_and_loops(hlo):
    assert hlo.entry == "main"
    assert set(hlo.computations) >= {"main", "body", "cond", "fused_dot", "all-reduce-scatter"}
    kernel = hlo.computations["body"].by_name["kernel.1"]  # joined across its three lines
    assert kernel.opcode == "custom-call" and xp.cost_estimate(kernel)["flops"] == 1e6
    runs = {c.name: t for c, t in xp.executed(hlo)}
    assert runs == {"main": 1.0, "body": 3.0, "cond": 4.0}  # fusion bodies are parts of their op
    assert xp.array_bytes("(bf16[16,32]{1,0}, f32[4]{0:T(128)S(1)})") == 16 * 32 * 2 + 16
    assert xp.array_bytes("(bf16[16,32]{1,0}, f32[4]{0:T(128)S(1)})", hbm_only=True) == 16 * 32 * 2


# XLA:TPU's batched matmul over E = 8 local experts (the capacity dispatch's torch.bmm), as a
# v6e compile writes it: the expert dim is a spatial dim with window 8, stride 7, lhs_dilate 8.
BMM_AS_CONV = r"""
HloModule bmm

ENTRY %main (x: bf16[8,2560,512], w: bf16[8,256,512]) -> bf16[8,2560,256] {
  %x = bf16[8,2560,512]{2,1,0} parameter(0)
  %w = bf16[8,256,512]{2,1,0} parameter(1)
  ROOT %convolution-base-dilated.38 = bf16[8,2560,256]{2,1,0} convolution(%x, %w), window={size=8 stride=7 lhs_dilate=8}, dim_labels=0bf_0oi->0bf
}
"""


def test_a_batched_matmul_written_as_a_dilated_convolution_counts_one_tap_per_output():
    """Each output position o of the expert dim meets one real input element (dilated position
    8 o, tap o); the other 7 taps of its window fall on the dilation's holes. Counting every
    tap charged the capacity dispatch's expert matmuls 8x their FLOPs (E_local times)."""
    hlo = xp.parse_hlo(BMM_AS_CONV)
    conv = hlo.computations["main"].by_name["convolution-base-dilated.38"]
    assert xp.dot_flops(hlo.computations["main"], conv) == 2 * 8 * 2560 * 256 * 512
    assert xp.window_taps(n=8, window=8, out=8, stride=7, pad_lo=0, lhs_dilate=8, rhs_dilate=1) == 8


# A layer scan's body as XLA:TPU compiles it: one fusion slices layer i of a stacked [L, ...]
# weight and multiplies, another writes the layer's saved activation into a stacked [L, ...]
# buffer in place (the buffer is an operand and the result, aliased).
SCAN_BODY = r"""
HloModule scan

%fused_slice_mul (p0: bf16[64,256,512], p1: s32[], p2: bf16[256,512]) -> bf16[256,512] {
  %p0 = bf16[64,256,512]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = bf16[256,512]{1,0} parameter(2)
  %zero = s32[] constant(0)
  %ds = bf16[1,256,512]{2,1,0} dynamic-slice(%p0, %p1, %zero, %zero), dynamic_slice_sizes={1,256,512}
  %layer = bf16[256,512]{1,0} bitcast(%ds)
  ROOT %mul = bf16[256,512]{1,0} multiply(%layer, %p2)
}

%fused_save (q0: bf16[64,256,512], q1: bf16[256,512], q2: s32[]) -> bf16[64,256,512] {
  %q0 = bf16[64,256,512]{2,1,0} parameter(0)
  %q1 = bf16[256,512]{1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  %upd = bf16[1,256,512]{2,1,0} bitcast(%q1)
  %dus = bf16[64,256,512]{2,1,0} dynamic-update-slice(%q0, %upd, %q2, %zero, %zero)
  ROOT %out = bf16[64,256,512]{2,1,0} bitcast(%dus)
}

ENTRY %main (w: bf16[64,256,512], x: bf16[256,512], i: s32[], saved: bf16[64,256,512]) -> bf16[1,256,512] {
  %w = bf16[64,256,512]{2,1,0} parameter(0)
  %x = bf16[256,512]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %saved = bf16[64,256,512]{2,1,0} parameter(3)
  %fusion.1 = bf16[256,512]{1,0} fusion(%w, %i, %x), kind=kLoop, calls=%fused_slice_mul
  %fusion.2 = bf16[64,256,512]{2,1,0} fusion(%saved, %fusion.1, %i), kind=kLoop, calls=%fused_save
  ROOT %ds.3 = bf16[1,256,512]{2,1,0} dynamic-slice(%fusion.2, %i, %i, %i), dynamic_slice_sizes={1,256,512}
}
"""


def test_a_scan_body_is_charged_the_layer_it_slices_and_the_slice_it_updates():
    """One layer is 256 x 512 bf16 = 256 KiB; the stacks are 64 layers. Charging the stacks whole
    counted 64x the traffic per trip of the scan."""
    layer = 256 * 512 * 2
    ops = {o.name: o for o in xp.compute_ops(xp.parse_hlo(SCAN_BODY))}
    assert ops["fusion.1"].bytes == layer + 4 + layer + layer  # the slice, the index, x, the result
    assert ops["fusion.2"].bytes == 0 + layer + 4 + layer  # the buffer is not read; the update is written
    assert ops["ds.3"].bytes == 2 * layer


@pytest.mark.parametrize(
    "n,window,out,stride,pad_lo,lhs_dilate,rhs_dilate",
    [(8, 8, 8, 7, 0, 8, 1), (1, 8, 8, 1, 7, 1, 1), (5, 3, 4, 1, 1, 1, 1), (4, 3, 5, 2, 2, 3, 2), (6, 4, 3, 3, 0, 1, 2)],
)
def test_window_taps_counts_the_pairs_that_land_on_input_elements(
    n, window, out, stride, pad_lo, lhs_dilate, rhs_dilate
):
    last = (n - 1) * lhs_dilate
    brute = sum(
        1
        for o in range(out)
        for k in range(window)
        if 0 <= o * stride + k * rhs_dilate - pad_lo <= last
        and (o * stride + k * rhs_dilate - pad_lo) % lhs_dilate == 0
    )
    got = xp.window_taps(
        n=n, window=window, out=out, stride=stride, pad_lo=pad_lo, lhs_dilate=lhs_dilate, rhs_dilate=rhs_dilate
    )
    assert got == brute


def test_compute_ops(hlo):
    ops = {o.name: o for o in xp.compute_ops(hlo)}
    dot = ops["fusion.1"]
    assert dot.flops == 2 * 16 * 64 * 32 and dot.times == 3
    assert dot.bytes == 2 * (16 * 32 + 32 * 64 + 16 * 64)  # operands + result, read/written once
    # the padded 1x8 window over an input of width 1 meets one position: 2 x out x 32 features
    assert ops["fusion.3"].flops == 2 * (4 * 16 * 8 * 64) * 32
    kern = ops["kernel.1"]
    assert (kern.kind, kern.flops, kern.bytes, kern.times) == ("kernel", 1e6, 5000, 3)
    assert kern.io == 2 * (16 * 32 * 2 + 8 * 64)
    assert "fusion.2" not in ops  # the all-reduce-scatter fusion is a collective
    peak, hbm = 1e12, 1e9
    expect = sum(o.times * max(o.flops / peak, o.bytes / hbm) for o in ops.values() if o.kind in ("xla", "kernel"))
    assert xp.compute_time(list(ops.values()), peak_flops=peak, hbm_bytes_per_s=hbm) == pytest.approx(expect)


def test_collectives_and_axes(hlo):
    colls = {c.name: c for c in xp.collectives(hlo, MESH)}
    ag = colls["all-gather.1"]
    assert (ag.kind, ag.bytes, ag.group_size, ag.axes, ag.times) == ("all-gather", 32 * 64 * 2, 4, ("fsdp",), 3)
    rs = colls["all-reduce.9"]  # inside the all-reduce-scatter fusion: a reduce-scatter of its operand
    assert (rs.kind, rs.bytes, rs.axes, rs.times) == ("reduce-scatter", 64 * 32 * 4, ("fsdp",), 1)
    ar = colls["all-reduce.2"]  # iota groups [4,2]<=[2,4]T(1,0): {0,4},{1,5},...: the data axis
    assert (ar.kind, ar.group_size, ar.axes) == ("all-reduce", 2, ("data",))
    ag3 = colls["all-gather-start.3"]  # async: the result element of the start tuple
    assert (ag3.bytes, ag3.group_size, ag3.axes) == (128 * 32 * 2, 8, ("data", "fsdp"))
    assert colls["all-to-all.4"].axes == ("fsdp",) and colls["all-to-all.4"].group_size == 4
    assert colls["collective-permute.5"].kind == "collective-permute"
    assert colls["collective-permute.5"].axes == ("fsdp",)
    assert "all-gather-done.3" not in colls


def test_groups_to_axes():
    assert xp.axes_of_group([0, 1, 2, 3], MESH) == ["fsdp"]
    assert xp.axes_of_group([1, 5], MESH) == ["data"]
    assert xp.axes_of_group(list(range(8)), MESH) == ["data", "fsdp"]
    assert xp._iota_transposed([2, 4], [1, 0]) == [0, 4, 1, 5, 2, 6, 3, 7]


def test_ring_times_and_bandwidth():
    ici = {"chip_bidirectional_gbps": 800.0, "ports": 4, "torus_dims": 2, "devices_per_chip": 1}
    link = xp.link_bytes_per_s(ici)
    assert link == 100e9  # one direction of one v6e link
    assert xp.axis_bandwidth(ici, 2) == 400e9 and xp.axis_bandwidth(ici, 1) == 200e9
    c = xp.Collective("c", "all-gather", 1e9, 4, ("fsdp",), 1)
    assert xp.collective_time(c, 400e9, link) == pytest.approx(0.75 * 1e9 / 400e9)
    assert xp.collective_time(c, 400e9, link, n=256) == pytest.approx(255 / 256 * 1e9 / 400e9)
    ar = xp.Collective("a", "all-reduce", 1e9, 4, ("fsdp",), 1)
    assert xp.collective_time(ar, 400e9, link) == pytest.approx(2 * 0.75 * 1e9 / 400e9)
    a2a = xp.Collective("t", "all-to-all", 1e9, 8, ("fsdp",), 1)
    assert xp.collective_time(a2a, 200e9, link) == pytest.approx(7 / 8 * 1e9 * 2 / 200e9)  # ring: n/4 hops
    assert xp.mean_hops(256, 2) == pytest.approx(8.0)  # 16 x 16 torus: 4 + 4
    assert xp.mean_hops(512, 3, devices_per_chip=2) == pytest.approx(3 * 256 ** (1 / 3) / 4)
    perm = xp.Collective("p", "collective-permute", 1e9, 2, ("fsdp",), 1)
    assert xp.collective_time(perm, 400e9, link) == pytest.approx(1e9 / link)
    single = xp.Collective("s", "all-gather", 1e9, 1, ("fsdp",), 1)
    assert xp.collective_time(single, 400e9, link) == 0.0


def test_comm_by_axis(hlo):
    ici = {"chip_bidirectional_gbps": 800.0, "ports": 4, "torus_dims": 2, "devices_per_chip": 1}
    comm = xp.comm_by_axis(xp.collectives(hlo, MESH), ici=ici, axis_dims={"data": 1, "fsdp": 1})
    assert set(comm) == {"fsdp", "data", "data+fsdp"}
    ag = 3 * 0.75 * 32 * 64 * 2 / 200e9  # the loop's all-gather, 3 trips, one torus dim
    rs = 0.75 * 64 * 32 * 4 / 200e9
    a2a = 0.75 * 16 * 32 * 2 * 1.0 / 200e9  # 4 devices on one dim: mean hops max(4/4, 1)
    perm = 16 * 32 * 2 / 100e9  # 0->1->2->3->0 on 8 devices: not one ring step, charged in full
    assert comm["fsdp"] == pytest.approx(ag + rs + a2a + perm)
    assert comm["data"] == pytest.approx(2 * 0.5 * 16 * 32 * 4 / 200e9)
    assert comm["data+fsdp"] == pytest.approx(7 / 8 * 128 * 32 * 2 / 400e9)  # two dims: both links


def test_bound_never_above_100():
    peak = 1e12
    r = xp.bound(compute_s=0.5, comm_s=0.3, model_flops=0.8e12, peak_flops=peak)  # compute below the model's
    assert r["compute_s"] == 0.8  # floored at model FLOPs / peak
    assert r["step_exposed_s"] == pytest.approx(1.1) and r["step_overlapped_s"] == pytest.approx(0.8)
    assert r["mfu_overlapped_pct"] == pytest.approx(100.0) and r["mfu_exposed_pct"] == pytest.approx(100 * 0.8 / 1.1)
    r = xp.bound(compute_s=1.0, comm_s=2.0, model_flops=0.5e12, peak_flops=peak)
    assert r["step_overlapped_s"] == 2.0 and r["mfu_overlapped_pct"] == pytest.approx(25.0)
    assert math.isclose(r["mfu_exposed_pct"], 100 * 0.5 / 3.0)


def test_ici_table_is_sourced():
    ici = xp.load_ici()
    assert set(ici) >= {"v5e", "v5p", "v6e", "v7x"}
    for gen, row in ici.items():
        assert row["source"].startswith("Cloud TPU docs"), gen
        assert row["chip_bidirectional_gbps"] > 0 and row["ports"] in (4, 6) and row["torus_dims"] in (2, 3)
    assert ici["v7x"]["devices_per_chip"] == 2


def test_no_entry_is_an_error():
    with pytest.raises(ValueError):
        xp.parse_hlo("HloModule m\n")


def test_suite_bound_from_two_programs(tmp_path):
    """scripts/mfu_suite.py's hlo_bound (tools/mfu_projection.py): the 1- and 2-layer programs' times
    extrapolated to the recipe's layers, both ways, MFU never above 100 %."""
    from tools import mfu_projection as suite

    one = tmp_path / "one.txt"
    one.write_text(HLO)
    # the 2-layer program: the loop runs 6 times instead of 3
    two = tmp_path / "two.txt"
    two.write_text(HLO.replace('"known_trip_count":{"n":"3"}', '"known_trip_count":{"n":"6"}'))
    ici = xp.load_ici()["v6e"]
    costs = [
        {"hlo": str(p), "devices": 8, "tokens": 100.0, "kernel_cost": {"flops": 0.0, "bytes": 0.0}} for p in (one, two)
    ]
    kw = dict(
        generation="v6e", peak=1e12, hbm=1e9, flops_per_token={"palm": 2.0, "causal": 1.0}, target_devices=256, ici=ici
    )
    a = suite.program_times(costs[0], peak=1e12, hbm=1e9, ici=ici, target_devices=256)
    b = suite.program_times(costs[1], peak=1e12, hbm=1e9, ici=ici, target_devices=256)
    r = suite.hlo_bound(*costs, n_layers=5, model_flops=1.0, **kw)
    per_layer = b["compute_s"] - a["compute_s"]
    assert per_layer > 0 and r["hlo_compute_raw_s"] == pytest.approx(a["compute_s"] + 4 * per_layer)
    comm = sum(a["comm"].values()) + 4 * (sum(b["comm"].values()) - sum(a["comm"].values()))
    assert r["comm_s"] == pytest.approx(comm)
    assert r["step_exposed_s"] == pytest.approx(r["hlo_compute_s"] + comm)
    assert r["step_overlapped_s"] == pytest.approx(max(r["hlo_compute_s"], comm))
    # the scheduled prediction: each program walked in its order, the FLOPs at MXU_EFFICIENCY,
    # extrapolated the same way
    assert b["step_scheduled_s"] > a["step_scheduled_s"] > 0
    step = a["step_scheduled_s"] + 4 * (b["step_scheduled_s"] - a["step_scheduled_s"])
    assert r["step_scheduled_s"] == pytest.approx(step)
    assert r["mfu_causal_scheduled"] == pytest.approx(100 * 1.0 / (1e12 * step))
    big = suite.hlo_bound(*costs, n_layers=5, model_flops=1e15, **kw)  # model FLOPs above the HLO's
    assert big["mfu_causal_overlapped"] <= 100.0 + 1e-9 and big["mfu_palm_overlapped"] <= 100.0


COUNTED_LOOP = r"""
HloModule windowed

%wbody (wp: (bf16[8,8], u32[])) -> (bf16[8,8], u32[]) {
  %wp = (bf16[8,8]{1,0}, u32[]) parameter(0)
  %x = bf16[8,8]{1,0} get-tuple-element(%wp), index=0
  %c = u32[] get-tuple-element(%wp), index=1
  %two = u32[] constant(2)
  %next = u32[] add(%c, %two)
  %ag = bf16[32,8]{1,0} all-gather(%x), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %t = (bf16[8,8]{1,0}, u32[]) tuple(%x, %next)
}

%wcond (cp: (bf16[8,8], u32[])) -> pred[] {
  %cp = (bf16[8,8]{1,0}, u32[]) parameter(0)
  %limit = u32[] constant(7)
  %cc = u32[] get-tuple-element(%cp), index=1
  ROOT %lt = pred[] compare(%limit, %cc), direction=GT
}

ENTRY %m (p: bf16[8,8]) -> bf16[8,8] {
  %p = bf16[8,8]{1,0} parameter(0)
  %start = u32[] constant(1)
  %init = (bf16[8,8]{1,0}, u32[]) tuple(%p, %start)
  %loop = (bf16[8,8]{1,0}, u32[]) while(%init), condition=%wcond, body=%wbody
  ROOT %out = bf16[8,8]{1,0} get-tuple-element(%loop), index=0
}
"""


def test_trip_count_read_off_a_counted_loop():
    """No known_trip_count (XLA:TPU's windowed-einsum loops): counter from 1, += 2, while 7 > it:
    1, 3, 5 -> 3 trips; the all-gather inside runs 3 times."""
    hlo = xp.parse_hlo(COUNTED_LOOP)
    loop = hlo.computations["m"].by_name["loop"]
    assert xp.trip_count(loop) is None  # not in the backend config
    assert xp.trip_count(loop, hlo, hlo.computations["m"]) == 3
    unknown: list = []
    runs = {c.name: t for c, t in xp.executed(hlo, unknown=unknown)}
    assert runs["wbody"] == 3 and unknown == []
    (ag,) = xp.collectives(hlo, {"fsdp": 4})
    assert ag.times == 3


def test_ring_permutes_in_opposite_directions_overlap():
    ici = {"chip_bidirectional_gbps": 800.0, "ports": 4, "torus_dims": 2, "devices_per_chip": 1}
    fwd = xp.Collective("f", "collective-permute", 1e9, 2, ("fsdp",), 3, direction=1)
    back = xp.Collective("b", "collective-permute", 2e9, 2, ("fsdp",), 1, direction=-1)
    comm = xp.comm_by_axis([fwd, back], ici=ici, axis_dims={"fsdp": 2})
    assert comm["fsdp"] == pytest.approx(3e9 / 100e9)  # max(3 x 1e9, 2e9) over one link direction
    hlo = xp.parse_hlo(
        HLO.replace(
            "source_target_pairs={{0,1},{1,2},{2,3},{3,0}}",
            "source_target_pairs={{0,7},{1,0},{2,1},{3,2},{4,3},{5,4},{6,5},{7,6}}",
        )
    )
    perm = next(c for c in xp.collectives(hlo, MESH) if c.kind == "collective-permute")
    assert perm.direction == -1


# ------------------------------------------------------------------------------ placement and the EP program


def test_group_facts_hops_on_rings_and_lines():
    """Mean hops between distinct members, per chip axis, the wraparound taken where the slice has it."""
    ring8 = [(i, 0, 0, 0) for i in range(8)]
    # on a wrapped ring of 8: distances 1,2,3,4,3,2,1 from each member -> 16 / 7
    f = xp.group_facts(ring8, (8, 1, 1), (True, False, False))
    assert f == {"n": 8, "torus_dims": 1, "mean_hops": pytest.approx(16 / 7), "per_chip": 1}
    # the same 8 chips on a line (no wraparound): sum |i - j| over i != j = 168, over 56 pairs
    assert xp.group_facts(ring8, (8, 1, 1), (False, False, False))["mean_hops"] == pytest.approx(3.0)
    # half of a 16-ring (the EP group of 8 on a v6e pod row): the wrap is never shorter there
    assert xp.group_facts(ring8, (16, 1, 1), (True, False, False))["mean_hops"] == pytest.approx(3.0)
    # two cores of each of 2 chips: 2 x 2 pairs on the same chip (0 hops) of 12 ordered pairs
    cores = [(0, 0, 0, 0), (0, 0, 0, 1), (1, 0, 0, 0), (1, 0, 0, 1)]
    f = xp.group_facts(cores, (2, 1, 1), (False, False, False))
    assert f["per_chip"] == 2 and f["torus_dims"] == 1 and f["mean_hops"] == pytest.approx(8 / 12)
    # a 2-D group, a 4 x 4 torus: per axis, ring distances 0,1,2,1 between the 4 values (16 in
    # all), each value held by 4 members -> 16 x 16 per axis, two axes, over 16 x 15 pairs
    grid = [(x, y, 0, 0) for x in range(4) for y in range(4)]
    assert xp.group_facts(grid, (4, 4, 1), (True, True, False))["mean_hops"] == pytest.approx(2 * 16 * 16 / 240)


def test_placement_groups_follow_the_mesh_axes():
    # 2 x 4 mesh over 8 chips in a line: a1 (inner) = neighbours, a0 = stride 4
    p = xp.Placement(radices=[2, 4], coords=[(i, 0, 0, 0) for i in range(8)], chips=(8, 1, 1), wrap=(False,) * 3)
    assert p.mesh == {"a0": 2, "a1": 4}
    assert p.group(("a1",)) == [(i, 0, 0, 0) for i in range(4)]
    assert p.group(("a0",)) == [(0, 0, 0, 0), (4, 0, 0, 0)]
    assert len(p.group(("a0", "a1"))) == 8
    assert p.facts(("a0",))["mean_hops"] == pytest.approx(4.0)


def test_placement_of_is_the_trainers_layout():
    """placement_of without a compile = torch-tpu's layout (map_mesh) refined into the program's axes."""
    import planner
    from parallelisms.tpu_topology import topology_of

    topo = topology_of(planner.parse_target("v6e-256"))
    p = xp.placement_of(topo, (1, 256, 1, 1), [32, 8])
    assert len(set(p.coords)) == 256 and p.coords[0] == (0, 0, 0, 0)
    ep = p.facts(("a1",))  # 8 consecutive devices of the FSDP ring: a line of 8 chips on one axis
    assert ep["n"] == 8 and ep["torus_dims"] == 1 and ep["mean_hops"] == pytest.approx(3.0)
    assert p.facts(("a0", "a1"))["torus_dims"] == 2
    v7x = xp.placement_of(topology_of(planner.parse_target("v7x-32")), (1, 32, 1, 1), [2, 16])
    assert v7x.facts(("a1",))["per_chip"] == 2  # the EP group holds both cores of its chips


def test_all_to_all_on_the_placement():
    """An all-to-all: the busiest link's bytes over one link direction (`all_to_all_load`); ring
    collectives as before with the group's torus dims."""
    ici = xp.load_ici()["v7x"]
    link = xp.link_bytes_per_s(ici)
    coords = [(c // 2, 0, 0, c % 2) for c in range(8)]  # 4 chips x 2 cores on a line
    p = xp.Placement(radices=[8], coords=coords, chips=(4, 1, 1), wrap=(False,) * 3)
    a2a = xp.Collective("a", "all-to-all", 8e9, 8, ("a0",), 2.0)
    ag = xp.Collective("g", "all-gather", 8e9, 8, ("a0",), 1.0)
    comm = xp.comm_on_placement([a2a, ag], ici=ici, placement=p)
    # the middle link of the line: 4 devices on each side, 1/8 of the buffer per pair: 4 x 4 / 8 = 2
    # buffers cross it each way (the mean-hops price of the code before was 7/8 x 10/7 = 1.25)
    assert comm["a0"] == pytest.approx(2.0 * 2.0 * 8e9 / link + 7 / 8 * 8e9 / (2 * link))


def _blocks(torus: tuple[int, int, int], block: tuple[int, int, int], cores: int) -> list[tuple[int, ...]]:
    """Device coordinates, row-major over (block index, position in the block, core): the mesh's
    inner axis is one block (torch-tpu's compact EP groups)."""
    nb = [t // b for t, b in zip(torus, block)]
    out = []
    for bz in range(nb[2]):
        for by in range(nb[1]):
            for bx in range(nb[0]):
                for z in range(block[2]):
                    for y in range(block[1]):
                        for x in range(block[0]):
                            for core in range(cores):
                                out.append((bx * block[0] + x, by * block[1] + y, bz * block[2] + z, core))
    return out


def test_all_to_all_load_rings_lines_and_blocks():
    """The busiest directed link's bytes per byte of each device's buffer, worked by hand (n devices,
    1/n of the buffer per ordered pair; a cut's load = the pairs across it / the links across it)."""
    wrap1 = (True, False, False)
    # a wrapped ring of 8 chips: the bisection is crossed by 4 x 4 pairs / 8 = 2 buffers over 2 links
    # per direction: 1.0 (what the mean-hops price gave: 7/8 x 16/7 / 2 links)
    ring8 = [[(i, 0, 0, 0) for i in range(8)]]
    assert xp.all_to_all_load(ring8, (8, 1, 1), wrap1) == pytest.approx(1.0)
    # the same 8 chips without the wraparound: the middle link carries 4 x 4 / 8 = 2.0
    assert xp.all_to_all_load(ring8, (8, 1, 1), (False,) * 3) == pytest.approx(2.0)
    # half of a wrapped 16-ring: a line again (the way round is longer), 2.0
    assert xp.all_to_all_load(ring8, (16, 1, 1), wrap1) == pytest.approx(2.0)
    # two interleaved groups on a wrapped ring of 8 ({0,2,4,6} and {1,3,5,7}): each group is a ring
    # of 4 with 2-link hops, 0.5 per hop (1/4 to the next, half of the 1/4 to the opposite member
    # from each of the two members behind); every link carries one hop of each group: 1.0
    strided = [[(i, 0, 0, 0) for i in range(o, 8, 2)] for o in (0, 1)]
    assert xp.all_to_all_load(strided, (8, 1, 1), wrap1) == pytest.approx(1.0)
    assert xp.all_to_all_load(strided[:1], (8, 1, 1), wrap1) == pytest.approx(0.5)
    # a whole 4 x 8 torus: per axis the ring's L/8 (0.5 on x, 1.0 on y): the y links are the busiest
    # (the mean-hops price pooled the two axes' links: (1 + 2) / 4 = 0.75)
    torus = [[(x, y, 0, 0) for y in range(8) for x in range(4)]]
    assert xp.all_to_all_load(torus, (4, 8, 1), (True, True, False)) == pytest.approx(1.0)
    # 2x2x2-chip blocks of 2 cores (the EP 16 group of the v7x-512 recipes) in a 4x4x4 torus: per
    # axis one in-block link between the two planes, 8 devices on each side, 8 x 8 / 16 = 4 buffers
    # over the 4 links across: 1.0 (the mean-hops price: 15/16 x 8/5 x 2 / 6 links = 0.5)
    coords = _blocks((4, 4, 4), (2, 2, 2), 2)
    p = xp.Placement(radices=[8, 16], coords=coords, chips=(4, 4, 4), wrap=(True, True, True, True))
    assert p.group(("a1",)) == coords[:16]
    assert len(p.groups(("a1",))) == 8 and len(p.groups(("a0",))) == 16
    assert p.a2a_load(("a1",)) == pytest.approx(1.0)
    ici = xp.load_ici()["v7x"]
    a2a = xp.Collective("a", "all-to-all", 1e9, 16, ("a1",), 1.0)
    assert xp.comm_on_placement([a2a], ici=ici, placement=p)["a1"] == pytest.approx(1e9 / xp.link_bytes_per_s(ici))
    # devices of one chip only: no link
    assert xp.all_to_all_load([[(0, 0, 0, 0), (0, 0, 0, 1)]], (4, 4, 4), (True,) * 3) == 0.0


def test_wrapped_collectives_and_ragged_bytes():
    """XLA:TPU's custom-call wrappers around collectives are followed (their collective counted
    with the loop's trips, the wrapper not costed as an op); a ragged all-to-all moves at most its
    smaller buffer (the other is the worst-case receive buffer)."""
    text = r"""
HloModule m

%wrapped (w0: bf16[64,128], w1: bf16[512,128], w2: s32[8], w3: s32[8], w4: s32[8], w5: s32[8]) -> bf16[512,128] {
  %w0 = bf16[64,128]{1,0} parameter(0)
  %w1 = bf16[512,128]{1,0} parameter(1)
  %w2 = s32[8]{0} parameter(2)
  %w3 = s32[8]{0} parameter(3)
  %w4 = s32[8]{0} parameter(4)
  %w5 = s32[8]{0} parameter(5)
  ROOT %ragged-all-to-all.1 = bf16[512,128]{1,0} ragged-all-to-all(%w0, %w1, %w2, %w3, %w4, %w5), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}
}

%body (s: (s32[], bf16[64,128], bf16[512,128], s32[8])) -> (s32[], bf16[64,128], bf16[512,128], s32[8]) {
  %s = (s32[], bf16[64,128]{1,0}, bf16[512,128]{1,0}, s32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %x = bf16[64,128]{1,0} get-tuple-element(%s), index=1
  %buf = bf16[512,128]{1,0} get-tuple-element(%s), index=2
  %k = s32[8]{0} get-tuple-element(%s), index=3
  %cc = bf16[512,128]{1,0} custom-call(%x, %buf, %k, %k, %k, %k), custom_call_target="TODO(b/522284627)", called_computations={%wrapped}
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[64,128]{1,0}, bf16[512,128]{1,0}, s32[8]{0}) tuple(%n, %x, %cc, %k)
}

%cond (c: (s32[], bf16[64,128], bf16[512,128], s32[8])) -> pred[] {
  %c = (s32[], bf16[64,128]{1,0}, bf16[512,128]{1,0}, s32[8]{0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %lim = s32[] constant(5)
  ROOT %lt = pred[] compare(%ci, %lim), direction=LT
}

ENTRY %main (p0: bf16[64,128], p1: bf16[512,128], p2: s32[8]) -> bf16[512,128] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[512,128]{1,0} parameter(1)
  %p2 = s32[8]{0} parameter(2)
  %z = s32[] constant(0)
  %init = (s32[], bf16[64,128]{1,0}, bf16[512,128]{1,0}, s32[8]{0}) tuple(%z, %p0, %p1, %p2)
  %loop = (s32[], bf16[64,128]{1,0}, bf16[512,128]{1,0}, s32[8]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %r = bf16[512,128]{1,0} get-tuple-element(%loop), index=2
}
"""
    s = xp.summarize(text, mesh={"a0": 8})
    (c,) = s["collectives"]
    assert c.kind == "all-to-all" and c.times == 5 and c.bytes == 64 * 128 * 2 and c.axes == ("a0",)
    assert not [o for o in s["ops"] if o.opcode == "custom-call"]
