"""One predicted step time from a scheduled XLA:TPU program: its instructions walked in the order
the compiler scheduled them, compute on one clock, transfers on their own links.

Plain text in, numbers out; no jax, no torch. The optimized TPU HLO is scheduled
(`HloModule ..., is_scheduled=true`): the instruction order of each computation is its execution
order. `simulate` walks ENTRY in that order, the bodies of `while` loops as many times as the loop
runs, and the computations `call` and `conditional` run, with

- a compute clock: every op that is neither a transfer nor bookkeeping advances it by its cost
  (`Cost.compute`: the per-op roofline of tools/xla_hlo.py, or what the caller charges);
- resources: each async transfer (`all-gather-start`, `all-reduce-start`, `collective-permute-start`,
  `copy-start`, `async-start` of a computation holding a collective or a host copy, ...) starts at
  the current clock on its resource (`Cost.transfer`: a mesh axis / link class for a collective,
  `host` for a copy between HBM and host memory) once the resource is free: two transfers on one
  resource run one after the other; on different resources at once;
- its `*-done` waits until the transfer has finished: the wait is exposed communication;
- a synchronous collective blocks the clock for its whole duration (all of it exposed).

A `*-done` finds its start through its operand: the start itself, or, for a transfer a loop carries
into its next trip (XLA's pipelined collectives), the loop tuple's element (`get-tuple-element` of the
body's parameter, of the loop's result, `%t#k`). A done whose start cannot be found waits for the
oldest transfer in flight of its kind (counted in `unmatched_done`).

A loop body is walked up to `WALKED_TRIPS` times; later trips repeat the last walked one (its
duration, waits and transfer times added per remaining trip; the resources and transfers in
flight shifted with the clock): from the second trip on, a body's schedule is the same each trip.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from tools.xla_hlo import COLLECTIVES, Computation, Hlo, Instr, _names, trip_count

LOCAL = 0
"""The key of a start that moves nothing off chip: its done waits for nothing."""

WALKED_TRIPS = 3
"""Trips of a loop body walked op by op; the rest repeat the last one."""

_BOOKKEEPING = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "optimization-barrier",
    "async-update",
    "add-dependency",
}


@dataclass
class Cost:
    """What one instruction costs: `compute` seconds on the compute clock, and/or a transfer of
    `seconds` on `resource` (async when the instruction is a start, else blocking)."""

    compute: float = 0.0
    resource: str | None = None
    seconds: float = 0.0


@dataclass
class Schedule:
    """The walk's result, per step: `step_s` (the clock at the end), `compute_s` (the clock's advance
    by compute), `exposed_s` (the clock's waits on transfers: step = compute + exposed),
    `busy_s` (transfer seconds per resource, hidden or not), `exposed_by` (the waits per resource)."""

    step_s: float = 0.0
    compute_s: float = 0.0
    exposed_s: float = 0.0
    busy_s: dict[str, float] = field(default_factory=dict)
    exposed_by: dict[str, float] = field(default_factory=dict)
    unmatched_done: int = 0
    unmatched: list[str] = field(default_factory=list)  # the first such dones' names
    unknown_trips: list[str] = field(default_factory=list)


def _base(opcode: str) -> str:
    return opcode.removesuffix("-start").removesuffix("-done")


class _Walk:
    def __init__(self, hlo: Hlo, cost: Callable[[Computation, Instr], Cost | None]):
        self.hlo, self.cost = hlo, cost
        self.clock = 0.0
        self.free: dict[str, float] = {}  # resource -> when its last transfer ends
        self.pending: dict[int, tuple[str, str, float]] = {}  # key -> (kind, resource, end)
        self.latest: dict[str, int] = {}  # start instruction name -> key of its latest launch
        self.seq = 0
        self.out = Schedule()
        self.loop_out: dict[str, dict[int, int | None]] = {}  # while name -> element -> transfer key

    # ---- accounting, kept as one flat dict so a loop's repeated trips can be added as deltas
    def totals(self) -> dict[str, float]:
        t = {"compute": self.out.compute_s, "exposed": self.out.exposed_s}
        t.update({f"busy:{k}": v for k, v in self.out.busy_s.items()})
        t.update({f"exp:{k}": v for k, v in self.out.exposed_by.items()})
        return t

    def add_totals(self, delta: dict[str, float], k: float) -> None:
        for key, v in delta.items():
            if key == "compute":
                self.out.compute_s += k * v
            elif key == "exposed":
                self.out.exposed_s += k * v
            elif key.startswith("busy:"):
                r = key[5:]
                self.out.busy_s[r] = self.out.busy_s.get(r, 0.0) + k * v
            else:
                r = key[4:]
                self.out.exposed_by[r] = self.out.exposed_by.get(r, 0.0) + k * v

    # ---- transfers
    def launch(self, name: str, kind: str, resource: str, seconds: float) -> int:
        begin = max(self.clock, self.free.get(resource, 0.0))
        end = begin + seconds
        self.free[resource] = end
        self.out.busy_s[resource] = self.out.busy_s.get(resource, 0.0) + seconds
        self.seq += 1
        self.pending[self.seq] = (kind, resource, end)
        self.latest[name] = self.seq
        return self.seq

    def wait(self, key: int | None, kind: str) -> None:
        if key == LOCAL:
            return
        if key is None or key not in self.pending:
            # the start was not found through the operand: the oldest transfer of this kind in flight
            same = [k for k, (kd, _, _) in self.pending.items() if kd == kind]
            self.out.unmatched_done += 1
            if not same:
                return
            key = min(same)
        _, resource, end = self.pending.pop(key)
        if end > self.clock:
            self.out.exposed_s += end - self.clock
            self.out.exposed_by[resource] = self.out.exposed_by.get(resource, 0.0) + end - self.clock
            self.clock = end

    def block(self, resource: str, seconds: float) -> None:
        begin = max(self.clock, self.free.get(resource, 0.0))
        end = begin + seconds
        self.free[resource] = end
        self.out.busy_s[resource] = self.out.busy_s.get(resource, 0.0) + seconds
        self.out.exposed_s += end - self.clock
        self.out.exposed_by[resource] = self.out.exposed_by.get(resource, 0.0) + end - self.clock
        self.clock = end

    def compute(self, seconds: float) -> None:
        self.clock += seconds
        self.out.compute_s += seconds

    # ---- resolving a done's operand to the transfer it waits for
    def resolve(self, comp: Computation, name: str, carried: dict[int, int | None], depth: int = 0) -> int | None:
        ins = comp.by_name.get(name)
        if ins is None or depth > 8:
            return None
        if ins.opcode.endswith("-start"):
            return self.latest.get(name)
        if ins.opcode == "get-tuple-element" and ins.operands:
            m = re.search(r"index=(\d+)", ins.attrs)
            src = comp.by_name.get(ins.operands[0])
            if m is None or src is None:
                return None
            k = int(m.group(1))
            if src.opcode == "parameter":
                return carried.get(k)
            if src.opcode == "while":
                return self.loop_out.get(src.name, {}).get(k)
            if src.opcode == "tuple" and k < len(src.operands):
                return self.resolve(comp, src.operands[k], carried, depth + 1)
            if src.opcode.endswith("-start"):
                return self.latest.get(src.name)
            return None
        if ins.opcode in ("bitcast", "copy", "opt-barrier", "optimization-barrier", "async-update") and ins.operands:
            return self.resolve(comp, ins.operands[0], carried, depth + 1)
        return None

    def tuple_keys(self, comp: Computation, name: str, carried: dict[int, int | None]) -> dict[int, int | None]:
        """Element -> transfer key of a tuple value (a loop's init or a body's root)."""
        ins = comp.by_name.get(name)
        if ins is None or ins.opcode != "tuple":
            return {}
        return {k: self.resolve(comp, o, carried) for k, o in enumerate(ins.operands)}

    # ---- the walk
    def run(self, comp: Computation, carried: dict[int, int | None], times: float = 1.0) -> None:
        for ins in comp.instrs:
            op = ins.opcode
            if op == "while":
                self.loop(comp, ins, carried)
                continue
            if op == "call":
                for c in _names(ins.attr("to_apply")):
                    if c in self.hlo.computations:
                        self.run(self.hlo.computations[c], {})
                continue
            if op == "conditional":
                for c in (
                    _names(ins.attr("branch_computations"))
                    + _names(ins.attr("true_computation"))
                    + _names(ins.attr("false_computation"))
                ):
                    if c in self.hlo.computations:
                        self.run(self.hlo.computations[c], {})
                continue
            if op in _BOOKKEEPING:
                continue
            if op.endswith("-done"):
                key = self.resolve(comp, ins.operands[0], carried) if ins.operands else None
                if key is None and len(self.out.unmatched) < 20:
                    self.out.unmatched.append(ins.name)
                self.wait(key, _base(op))
                continue
            c = self.cost(comp, ins)
            if c is not None and c.compute:
                self.compute(c.compute)
            if c is None or c.resource is None:
                if op.endswith("-start"):
                    self.latest[ins.name] = LOCAL  # no transfer (an on-chip prefetch charged as compute)
                continue
            if op.endswith("-start"):
                self.launch(ins.name, _base(op), c.resource, c.seconds)
            else:
                self.block(c.resource, c.seconds)

    def loop(self, caller: Computation, ins: Instr, carried: dict[int, int | None]) -> None:
        n = trip_count(ins, self.hlo, caller)
        if n is None:
            self.out.unknown_trips.append(ins.name)
            n = 1
        bodies = _names(ins.attr("body"))
        body = self.hlo.computations.get(bodies[0]) if bodies else None
        if body is None or n <= 0:
            return
        init = self.tuple_keys(caller, ins.operands[0], carried) if ins.operands else {}
        root = next((i for i in body.instrs if i.root), None)
        state = init
        walked = min(n, WALKED_TRIPS)
        before = self.totals()
        start = self.clock
        for _ in range(walked):
            before, start = self.totals(), self.clock
            self.run(body, state)
            state = self.tuple_keys(body, root.name, state) if root is not None else {}
        rest = n - walked
        if rest > 0:
            after = self.totals()
            delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
            trip = self.clock - start
            shift = rest * trip
            self.add_totals(delta, rest)
            self.clock += shift
            # the last trip's transfers and resources move with the clock
            for r, end in self.free.items():
                if end >= start:
                    self.free[r] = end + shift
            for k, (kind, r, end) in list(self.pending.items()):
                if end >= start:
                    self.pending[k] = (kind, r, end + shift)
        self.loop_out[ins.name] = state


def simulate(hlo: Hlo, cost: Callable[[Computation, Instr], Cost | None]) -> Schedule:
    """Walk ENTRY in its scheduled order (module docstring). `cost(computation, instruction)` says
    what an instruction costs (None: nothing). Transfers still in flight at the end of ENTRY are
    waited for (a step ends when its last transfer has)."""
    w = _Walk(hlo, cost)
    w.run(hlo.computations[hlo.entry], {})
    for key in sorted(w.pending):
        w.wait(key, w.pending[key][0])
    w.out.step_s = w.clock
    return w.out


def is_host_copy(ins: Instr, operand_shape: str) -> bool:
    """A copy between HBM and host memory: one side's layout in memory space 5 (`S(5)`, the
    host memory space of XLA:TPU's host offload)."""
    return "S(5)" in ins.shape or "S(5)" in operand_shape


def is_collective(opcode: str) -> bool:
    return _base(opcode) in COLLECTIVES
