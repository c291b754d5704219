"""tools/xla_schedule.py: the step time of a scheduled HLO, walked in its order. Small hand-written
scheduled programs, each instruction's cost given by name (compute `f*` 1 s, a transfer 2 s), so
the expected step is arithmetic on the schedule: what a start/done pair with compute between hides,
what a done right after its start exposes, two transfers on one link one after the other, a loop
body's schedule trip-count times, a transfer the loop carries into its next trip."""

from __future__ import annotations

import pytest

from tools.xla_hlo import parse_hlo
from tools.xla_schedule import Cost, simulate

HEAD = "HloModule m, is_scheduled=true\n\n"


def entry(body: str) -> str:
    return HEAD + "ENTRY %main (x: bf16[8,8]) -> bf16[8,8] {\n  %x = bf16[8,8]{1,0} parameter(0)\n" + body + "}\n"


def by_name(compute: float = 1.0, transfer: float = 2.0, resource_of=None):
    """Cost by name: `f...` computes `compute` s; a `*-start` or `sync*` moves for `transfer` s on
    resource_of(name) (default one link, `ici`)."""

    def cost(comp, ins):
        if ins.name.startswith("f"):
            return Cost(compute=compute)
        if ins.opcode.endswith("-start") or ins.name.startswith("sync"):
            return Cost(resource=(resource_of or (lambda n: "ici"))(ins.name), seconds=transfer)
        return None

    return cost


def fusions(names: list[str]) -> str:
    return "".join(f"  %{n} = bf16[8,8]{{1,0}} fusion(%x), kind=kLoop, calls=%fc\n" for n in names)


def test_compute_between_start_and_done_hides_the_transfer():
    text = entry(
        "  %ags = (bf16[8,8]{1,0}, bf16[64,8]{1,0}) all-gather-start(%x), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}\n"
        + fusions(["f1", "f2", "f3"])
        + "  ROOT %agd = bf16[64,8]{1,0} all-gather-done(%ags)\n"
    )
    s = simulate(parse_hlo(text), by_name())
    # 2 s of transfer behind 3 s of compute: nothing exposed
    assert s.step_s == pytest.approx(3.0) and s.exposed_s == 0.0
    assert s.busy_s == {"ici": pytest.approx(2.0)} and s.unmatched_done == 0


def test_done_right_after_start_exposes_the_transfer():
    text = entry(
        "  %ags = (bf16[8,8]{1,0}, bf16[64,8]{1,0}) all-gather-start(%x), dimensions={0}\n"
        "  %agd = bf16[64,8]{1,0} all-gather-done(%ags)\n" + fusions(["f1", "f2", "f3"]) + "  ROOT %t = tuple(%agd)\n"
    )
    s = simulate(parse_hlo(text), by_name())
    assert s.step_s == pytest.approx(5.0) and s.exposed_s == pytest.approx(2.0)
    assert s.exposed_by == {"ici": pytest.approx(2.0)}
    # one compute op between: 1 of the 2 s hidden
    text = entry(
        "  %ags = (bf16[8,8]{1,0}, bf16[64,8]{1,0}) all-gather-start(%x), dimensions={0}\n"
        + fusions(["f1"])
        + "  %agd = bf16[64,8]{1,0} all-gather-done(%ags)\n"
        + fusions(["f2", "f3"])
        + "  ROOT %t = tuple(%agd)\n"
    )
    s = simulate(parse_hlo(text), by_name())
    assert s.step_s == pytest.approx(4.0) and s.exposed_s == pytest.approx(1.0)


def test_two_transfers_on_one_resource_serialize_on_two_run_at_once():
    text = entry(
        "  %a-start = (bf16[8,8]{1,0}, bf16[64,8]{1,0}) all-gather-start(%x), dimensions={0}\n"
        "  %b-start = (bf16[8,8]{1,0}, bf16[8,8]{1,0}) collective-permute-start(%x), source_target_pairs={{0,1}}\n"
        + fusions(["f1", "f2", "f3"])
        + "  %a-done = bf16[64,8]{1,0} all-gather-done(%a-start)\n"
        "  %b-done = bf16[8,8]{1,0} collective-permute-done(%b-start)\n"
        "  ROOT %t = tuple(%a-done, %b-done)\n"
    )
    # one link: the second runs 2-4 s, behind 3 s of compute: 1 s exposed
    one = simulate(parse_hlo(text), by_name())
    assert one.step_s == pytest.approx(4.0) and one.exposed_s == pytest.approx(1.0)
    assert one.busy_s["ici"] == pytest.approx(4.0)
    # two links (the all-gather on one mesh axis, the permute on another): both hidden
    two = simulate(parse_hlo(text), by_name(resource_of=lambda n: n[0]))
    assert two.step_s == pytest.approx(3.0) and two.exposed_s == 0.0


def test_sync_collective_blocks_and_waits_for_its_link():
    text = entry(
        "  %a-start = (bf16[8,8]{1,0}, bf16[64,8]{1,0}) all-gather-start(%x), dimensions={0}\n"
        "  %sync = bf16[8,8]{1,0} all-reduce(%x), to_apply=%add\n"
        + fusions(["f1"])
        + "  ROOT %a-done = bf16[64,8]{1,0} all-gather-done(%a-start)\n"
    )
    # the all-reduce waits for the link (free at 2 s), runs 2-4 s, blocking; then 1 s compute
    s = simulate(parse_hlo(text), by_name())
    assert s.step_s == pytest.approx(5.0) and s.exposed_s == pytest.approx(4.0)


LOOP = """HloModule m, is_scheduled=true

%cond (p: (s32[], bf16[8,8])) -> pred[] {
  %p = (s32[], bf16[8,8]{1,0}) parameter(0)
  %limit = s32[] constant(TRIPS)
  ROOT %lt = pred[] compare(%p#0, %limit), direction=LT
}

%body (q: (s32[], bf16[8,8])) -> (s32[], bf16[8,8]) {
  %q = (s32[], bf16[8,8]{1,0}) parameter(0)
  %one = s32[] constant(1)
  %next = s32[] add(%q#0, %one)
  %ags = (bf16[8,8]{1,0}, bf16[64,8]{1,0}) all-gather-start(%q#1), dimensions={0}
BETWEEN  %agd = bf16[64,8]{1,0} all-gather-done(%ags)
  %f2 = bf16[8,8]{1,0} fusion(%agd), kind=kLoop, calls=%fc
  ROOT %t = (s32[], bf16[8,8]{1,0}) tuple(%next, %f2)
}

ENTRY %main (x: bf16[8,8]) -> bf16[8,8] {
  %x = bf16[8,8]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[8,8]{1,0}) tuple(%zero, %x)
  %loop = (s32[], bf16[8,8]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = bf16[8,8]{1,0} copy(%loop#1)
}
"""


@pytest.mark.parametrize("trips", [1, 2, 7, 40])
def test_a_loop_body_runs_its_schedule_trip_count_times(trips):
    # per trip: the transfer (2 s) exposed behind nothing, then 1 s compute: 3 s a trip
    s = simulate(parse_hlo(LOOP.replace("TRIPS", str(trips)).replace("BETWEEN", "")), by_name())
    assert s.step_s == pytest.approx(3.0 * trips) and s.exposed_s == pytest.approx(2.0 * trips)
    assert s.busy_s["ici"] == pytest.approx(2.0 * trips) and s.compute_s == pytest.approx(1.0 * trips)
    # 3 s of compute between start and done: 4 s a trip, nothing exposed
    between = "".join(f"  %f1{k} = bf16[8,8]{{1,0}} fusion(%q#1), kind=kLoop, calls=%fc\n" for k in range(3))
    s = simulate(parse_hlo(LOOP.replace("TRIPS", str(trips)).replace("BETWEEN", between)), by_name())
    assert s.step_s == pytest.approx(4.0 * trips) and s.exposed_s == 0.0


PIPELINED = """HloModule m, is_scheduled=true

%cond (p: (s32[], bf16[8,8], (bf16[8,8], bf16[64,8]))) -> pred[] {
  %p = (s32[], bf16[8,8]{1,0}, (bf16[8,8]{1,0}, bf16[64,8]{1,0})) parameter(0)
  %limit = s32[] constant(10)
  ROOT %lt = pred[] compare(%p#0, %limit), direction=LT
}

%body (q: (s32[], bf16[8,8], (bf16[8,8], bf16[64,8]))) -> (s32[], bf16[8,8], (bf16[8,8], bf16[64,8])) {
  %q = (s32[], bf16[8,8]{1,0}, (bf16[8,8]{1,0}, bf16[64,8]{1,0})) parameter(0)
  %one = s32[] constant(1)
  %next = s32[] add(%q#0, %one)
  %prev = (bf16[8,8]{1,0}, bf16[64,8]{1,0}) get-tuple-element(%q), index=2
  %agd = bf16[64,8]{1,0} all-gather-done(%prev)
  %ags = (bf16[8,8]{1,0}, bf16[64,8]{1,0}) all-gather-start(%q#1), dimensions={0}
  %f1 = bf16[8,8]{1,0} fusion(%agd), kind=kLoop, calls=%fc
  ROOT %t = (s32[], bf16[8,8]{1,0}, (bf16[8,8]{1,0}, bf16[64,8]{1,0})) tuple(%next, %f1, %ags)
}

ENTRY %main (x: bf16[8,8]) -> bf16[8,8] {
  %x = bf16[8,8]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %s0 = (bf16[8,8]{1,0}, bf16[64,8]{1,0}) all-gather-start(%x), dimensions={0}
  %init = (s32[], bf16[8,8]{1,0}, (bf16[8,8]{1,0}, bf16[64,8]{1,0})) tuple(%zero, %x, %s0)
  %loop = (s32[], bf16[8,8]{1,0}, (bf16[8,8]{1,0}, bf16[64,8]{1,0})) while(%init), condition=%cond, body=%body
  %last = (bf16[8,8]{1,0}, bf16[64,8]{1,0}) get-tuple-element(%loop), index=2
  ROOT %out = bf16[64,8]{1,0} all-gather-done(%last)
}
"""


def test_a_transfer_carried_into_the_next_trip_overlaps_that_trip():
    """XLA's pipelined collectives: the start of trip i is carried in the loop tuple and waited for
    in trip i + 1. Found through the tuple: each 2 s transfer overlaps one 3 s trip of compute."""
    s = simulate(parse_hlo(PIPELINED), by_name(compute=3.0))
    # the first (before the loop) is waited for at once: 2 s; then each trip 3 s, its transfer hidden;
    # the last, carried out of the loop, waited for at the end: hidden behind the last trip
    assert s.unmatched_done == 0
    assert s.step_s == pytest.approx(2.0 + 10 * 3.0) and s.exposed_s == pytest.approx(2.0)
    assert s.busy_s["ici"] == pytest.approx(11 * 2.0)
    # with 1 s of compute per trip each carried transfer is exposed for 1 s: the first trip ends at
    # 3 s, each later one 2 s after (1 s waiting, 1 s compute), the last transfer ends 1 s later
    s = simulate(parse_hlo(PIPELINED), by_name(compute=1.0))
    assert s.step_s == pytest.approx(3.0 + 9 * 2.0 + 1.0) and s.exposed_s == pytest.approx(2.0 + 9 + 1.0)


PRICED = """HloModule m, is_scheduled=true

%fc (a: bf16[1024,1024], b: bf16[1024,1024]) -> bf16[1024,1024] {
  %a = bf16[1024,1024]{1,0} parameter(0)
  %b = bf16[1024,1024]{1,0} parameter(1)
  ROOT %d = bf16[1024,1024]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: bf16[1024,1024], w: bf16[1024,1024]) -> bf16[1024,1024] {
  %x = bf16[1024,1024]{1,0} parameter(0)
  %w = bf16[1024,1024]{1,0} parameter(1)
  %ag = (bf16[1024,1024]{1,0}, bf16[4096,1024]{1,0}) all-gather-start(%w), replica_groups={{0,1,2,3}}, dimensions={0}
  %off = (bf16[1024,1024]{1,0:S(5)}, bf16[1024,1024]{1,0}, u32[]) copy-start(%x)
  %f = bf16[1024,1024]{1,0} fusion(%x, %w), kind=kOutput, calls=%fc
  %agd = bf16[4096,1024]{1,0} all-gather-done(%ag)
  %offd = bf16[1024,1024]{1,0:S(5)} copy-done(%off)
  ROOT %t = (bf16[1024,1024]{1,0}, bf16[4096,1024]{1,0}) tuple(%f, %agd)
}
"""


def test_the_projector_prices_collectives_on_their_axis_and_host_copies_on_the_host_link():
    from tools import xla_projection as xp

    hlo = parse_hlo(PRICED)
    place = xp.Placement(
        radices=[4], coords=[(i, 0, 0, 0) for i in range(4)], chips=(4, 1, 1), wrap=(True, False, False)
    )
    ici = {"chip_bidirectional_gbps": 400.0, "ports": 4, "torus_dims": 2, "devices_per_chip": 1}
    colls = xp.collectives(hlo, place.mesh)
    assert [(c.name, c.kind, c.axes) for c in colls] == [("ag", "all-gather", ("a0",))]
    assert xp.host_transfer(hlo, hlo.computations["main"], hlo.computations["main"].by_name["off"]) == ("d2h", 2**21)
    s = xp.scheduled(hlo, colls=colls, ici=ici, placement=place, seconds={"f": 1e-3}, host_bytes_per_s=1e9)
    # all-gather of 8 MiB on a ring of 4 over one torus dim (both directions of two 50 GB/s links):
    # 3/4 x 8 MiB / 100 GB/s = 63 us, behind the 1 ms fusion; the 2 MiB host copy at 1 GB/s: 2.1 ms,
    # 1.1 ms of it exposed
    assert s.busy_s["ici:a0"] == pytest.approx(0.75 * 2**23 / 1e11)
    assert s.busy_s["host:d2h"] == pytest.approx(2**21 / 1e9)
    assert s.exposed_by == {"host:d2h": pytest.approx(2**21 / 1e9 - 1e-3)}
    assert s.step_s == pytest.approx(2**21 / 1e9) and s.compute_s == pytest.approx(1e-3)


def test_mxu_utilization_pads_the_stationary_block():
    """A 256 x 256 MXU (v6e, v7x): a dot contracting 128 (attention's head dim) fills half of it;
    one whose dims are multiples of 256 all of it; a free dim of 100 on both sides pads to 256."""
    from tools.xla_hlo import mxu_flops, mxu_utilization

    def dot(m, k, n):
        text = (
            HEAD + f"ENTRY %main (a: bf16[{m},{k}], b: bf16[{k},{n}]) -> bf16[{m},{n}] {{\n"
            f"  %a = bf16[{m},{k}]{{1,0}} parameter(0)\n  %b = bf16[{k},{n}]{{1,0}} parameter(1)\n"
            f"  ROOT %d = bf16[{m},{n}]{{1,0}} dot(%a, %b), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}\n}}\n"
        )
        hlo = parse_hlo(text)
        comp = hlo.computations["main"]
        return mxu_utilization(comp, comp.by_name["d"], 256), mxu_flops(hlo, 256)["d"]

    assert dot(2048, 4096, 1024) == (1.0, 2.0 * 2048 * 4096 * 1024)
    assert dot(2048, 128, 2048)[0] == 0.5  # Q K^T: contracting the head dim
    assert dot(2048, 2048, 128)[0] == 1.0  # P V: the [2048, 2048] block stationary, V's rows stream
    assert dot(100, 4096, 100)[0] == pytest.approx(100 / 256)


NESTED = """HloModule m, is_scheduled=true

%fc (a: bf16[1024,1024]) -> bf16[1024,1024] {
  %a = bf16[1024,1024]{1,0} parameter(0)
  ROOT %d = bf16[1024,1024]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%called_computation (p: bf16[1024,1024]) -> bf16[4096,1024] {
  %p = bf16[1024,1024]{1,0} parameter(0)
  ROOT %all-gather.1 = bf16[4096,1024]{1,0} all-gather(%p), replica_groups={{0,1,2,3}}, dimensions={0}
}

%async_computation (q: bf16[1024,1024]) -> bf16[4096,1024] {
  %q = bf16[1024,1024]{1,0} parameter(0)
  ROOT %ag.call = bf16[4096,1024]{1,0} call(%q), to_apply=%called_computation
}

ENTRY %main (x: bf16[1024,1024]) -> bf16[4096,1024] {
  %x = bf16[1024,1024]{1,0} parameter(0)
  %ag.call-start = ((bf16[1024,1024]{1,0}), bf16[4096,1024]{1,0}, u32[]) async-start(%x), calls=%async_computation
  %ag.call-update = ((bf16[1024,1024]{1,0}), bf16[4096,1024]{1,0}, u32[]) async-update(%ag.call-start)
  %f = bf16[1024,1024]{1,0} fusion(%x), kind=kOutput, calls=%fc
  ROOT %ag.call-done = bf16[4096,1024]{1,0} async-done(%ag.call-update)
}
"""


def test_a_collective_nested_in_an_async_call_is_priced_and_its_done_found_through_the_update():
    """MaxText's programs (libtpu 0.0.46) wrap a collective as async-start -> async computation ->
    call -> the all-gather, and wait on it through an async-update: the transfer is priced on its
    axis and its done is matched (not the oldest-in-flight fallback)."""
    from tools import xla_projection as xp

    hlo = parse_hlo(NESTED)
    place = xp.Placement(
        radices=[4], coords=[(i, 0, 0, 0) for i in range(4)], chips=(4, 1, 1), wrap=(True, False, False)
    )
    ici = {"chip_bidirectional_gbps": 400.0, "ports": 4, "torus_dims": 2, "devices_per_chip": 1}
    colls = xp.collectives(hlo, place.mesh)
    ag = 0.75 * 2**23 / 1e11  # 63 us, as above
    s = xp.scheduled(hlo, colls=colls, ici=ici, placement=place, seconds={"f": 1e-5}, host_bytes_per_s=1e9)
    assert s.busy_s == {"ici:a0": pytest.approx(ag)} and s.unmatched_done == 0
    # 10 us of compute between start and done: 53 us exposed
    assert s.exposed_s == pytest.approx(ag - 1e-5) and s.step_s == pytest.approx(ag)


def test_program_bound_reports_the_scheduled_step(tmp_path):
    """tools/mfu_projection.program_bound (the MFU suite's EP programs) carries the scheduled step
    beside its bounds: here the 2 MiB host copy at v6e's 32 GB/s (65.5 us) outlasts the compute and
    the all-gather, which the bounds (no host link) cannot see."""
    import planner
    from parallelisms.tpu_topology import topology_of
    from tools.mfu_projection import program_bound
    from tools.mfu_report import load_anchors

    hlo = tmp_path / "p.txt"
    hlo.write_text(PRICED.replace("{{0,1,2,3}}", "{{0,1,2,3,4,5,6,7}}").replace("bf16[4096,1024]", "bf16[8192,1024]"))
    res = {"radices": [8], "device_coords": [[i % 4, i // 4, 0, 0] for i in range(8)], "hlo": str(hlo)}
    facts = {
        "generation": "v6e",
        "peak": 918e12,
        "topology": topology_of(planner.parse_target("v6e-8")),
        "tokens": 1.0,
        "routed_rows": 0,
        "flops_per_token": {"causal": 1e9, "palm": 1.2e9},
    }
    b = program_bound(res, facts, anchors=load_anchors())
    assert b["step_scheduled_s"] == pytest.approx(2**21 / 32e9)
    assert b["step_scheduled_s"] > b["step_exposed_s"]
    assert b["mfu_causal_scheduled"] == pytest.approx(100 * 1e9 / (918e12 * 2**21 / 32e9))
    assert b["exposed_host_s"] > 0 and b["unmatched_done"] == 0
