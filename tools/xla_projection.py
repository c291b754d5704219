"""Step-time bound of a compiled per-device XLA:TPU program: compute + the collectives it holds.

Plain text in, numbers out; no jax, no torch. The input is the optimized HLO text of one
per-device program (the `*.after_optimizations.txt` that `XLA_FLAGS=--xla_dump_to=DIR
--xla_dump_hlo_as_text` writes for a deviceless compile, or jax's `compiled.as_text()`).

    hlo = parse_hlo(text)
    ops = compute_ops(hlo)              # per executed op: FLOPs, HBM bytes, times it runs
    colls = collectives(hlo)            # per collective: kind, bytes, group size, mesh axes, times it runs
    proj = project(compute=..., collectives=..., ...)  # step time both ways, MFU bound both ways

What is counted (docs/benchmarks.md, "Projections"):
- Executed ops are the instructions of ENTRY, of `while` bodies (times the loop's
  `known_trip_count`: XLA's own cost analysis counts a loop body once), and of computations
  run by `call`, `conditional` (every branch, once) and `async-start`. A fusion is one op: its
  FLOPs are the dots and convolutions inside it (2 per multiply-add), its HBM bytes its operands
  and results outside on-chip memory (layouts marked `S(n)`, n > 0, are VMEM/SMEM and not
  counted). Op time = max(FLOPs / peak, bytes / HBM bandwidth); compute time = the sum.
- Mosaic (Pallas) custom calls: the `cost_estimate` their kernel attached (megablox gmm/tgmm)
  where the HLO carries one; the others are counted as `kernel_calls_without_estimate` and the
  caller adds their FLOPs and bytes from its own model (titan_kernels/tpu/capture.py).
- Collectives: all-gather, reduce-scatter (also XLA:TPU's `all-reduce-scatter` fusions: an
  all-reduce whose result is sliced), all-reduce, all-to-all, collective-permute, sync or
  async (`*-start`). Bytes per device: the gathered result of an all-gather, the unscattered
  operand of a reduce-scatter, the buffer of an all-reduce / all-to-all / permute. Replica groups
  (explicit `{{..}}`, iota `[G,S]<=[..]`, or `mesh[...] {axes}`) map to the compile's logical
  mesh axes.

Time of a collective on a ring of n devices along an axis whose per-device ICI bandwidth is B
(both directions of every link the axis spans, `axis_bandwidth`): all-gather and reduce-scatter
(n-1)/n * bytes / B, all-reduce twice that, all-to-all (n-1)/n * bytes * hops / B (hops: the mean
distance on the axis's torus, a quarter of each dim's length: n/4 on one ring),
collective-permute bytes / one link direction (ring permutes in opposite directions run at once:
per axis the larger direction's sum). Ideal rings at the links' rated bandwidth: a lower bound on the time, so the MFU that follows is an
upper bound.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

ANCHORS = Path(__file__).resolve().parents[1] / "assets" / "anchors.toml"

_ITEMSIZE = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "token": 0,
}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\](\{[^}]*\})?")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*")
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s")
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")
_NO_COST = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "after-all",
    "partition-id",
    "replica-id",
    "while",
    "call",
    "conditional",
    "async-start",
    "async-update",
    "async-done",
    "copy-start",
    "copy-done",
    "opt-barrier",
    "optimization-barrier",
    "iota",
}


# ------------------------------------------------------------------------------ parsing


def _itemsize(dtype: str) -> float:
    if dtype.startswith("f8"):
        return 1
    return _ITEMSIZE.get(dtype, 0)


def array_bytes(shape: str, *, hbm_only: bool = False) -> float:
    """Bytes of a shape string (an array or a tuple of arrays). hbm_only: leave out arrays whose
    layout puts them in a memory space other than 0 (`S(1)`: VMEM on a TPU)."""
    total = 0.0
    for dtype, dims, layout in _ARRAY.findall(shape):
        if hbm_only and layout and re.search(r"S\([1-9]", layout):
            continue
        total += _itemsize(dtype) * math.prod(int(d) for d in dims.split(",") if d)
    return total


def array_dims(shape: str) -> list[int]:
    """Dims of the first array in a shape string."""
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _balanced(text: str, start: int, open_ch: str, close_ch: str) -> int:
    """Index just past the bracket that closes the one at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c == open_ch:
            depth += 1
        elif c == close_ch:
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


@dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    root: bool = False
    args: str = ""  # the text between the opcode's parentheses (a constant's value)

    def attr(self, key: str) -> str | None:
        """The value of `key=...` in the attributes (a {...} or [...] group taken whole)."""
        m = re.search(r"(?:^|[,\s])" + re.escape(key) + r"=", self.attrs)
        if not m:
            return None
        i = m.end()
        if i < len(self.attrs) and self.attrs[i] in "{[":
            open_ch = self.attrs[i]
            return self.attrs[i : _balanced(self.attrs, i, open_ch, "}" if open_ch == "{" else "]")]
        end = re.search(r",\s*[\w.\-]+=|$", self.attrs[i:])
        return self.attrs[i : i + end.start()].strip()


@dataclass
class Computation:
    name: str
    entry: bool
    instrs: list[Instr] = field(default_factory=list)
    by_name: dict[str, Instr] = field(default_factory=dict)


@dataclass
class Hlo:
    computations: dict[str, Computation]
    entry: str


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    rest = line[m.end() :]
    if rest.startswith("("):
        end = _balanced(rest, 0, "(", ")")
        shape, rest = rest[:end], rest[end:].lstrip()
    else:
        sp = rest.find(" ")
        shape, rest = rest[:sp], rest[sp + 1 :].lstrip()
    op = re.match(r"([a-z][a-z0-9\-]*)\(", rest)
    if not op:
        return None
    end = _balanced(rest, op.end() - 1, "(", ")")
    operands = re.findall(r"%([\w.\-]+)", rest[op.end() : end - 1])
    attrs = rest[end:].lstrip(", ")
    return Instr(
        name=m.group(2),
        shape=shape,
        opcode=op.group(1),
        operands=operands,
        attrs=attrs,
        root=bool(m.group(1)),
        args=rest[op.end() : end - 1],
    )


def parse_hlo(text: str) -> Hlo:
    """Computations and their instructions. An instruction that spans lines (kernel metadata with
    newlines) is joined first."""
    comps: dict[str, Computation] = {}
    entry = None
    current: Computation | None = None
    pending: list[str] = []

    def flush():
        if pending and current is not None:
            ins = _parse_instr(" ".join(pending))
            if ins is not None:
                current.instrs.append(ins)
                current.by_name[ins.name] = ins
        pending.clear()

    for line in text.splitlines():
        if _INSTR.match(line) and line[:1].isspace():
            flush()
            pending.append(line)
        elif line.rstrip() == "}":
            flush()
            current = None
        elif _HEADER.match(line) and line.rstrip().endswith("{"):
            flush()
            h = _HEADER.match(line)
            current = Computation(name=h.group(2), entry=bool(h.group(1)))
            comps[current.name] = current
            if current.entry:
                entry = current.name
        elif pending:
            pending.append(line.strip())
    flush()
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return Hlo(computations=comps, entry=entry)


def _names(value: str | None) -> list[str]:
    return re.findall(r"%([\w.\-]+)", value or "")


def trip_count(ins: Instr, hlo: Hlo | None = None, caller: Computation | None = None) -> int | None:
    """A while loop's trip count: its backend config's `known_trip_count`, else (with `hlo`) read
    off the loop (`infer_trip_count`), else None."""
    m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', ins.attrs)
    if m:
        return int(m.group(1))
    return infer_trip_count(ins, hlo, caller) if hlo is not None else None


def _const(comp: Computation | None, name: str) -> int | None:
    ins = comp.by_name.get(name) if comp else None
    if ins is None or ins.opcode != "constant":
        return None
    try:
        return int(ins.args.strip())
    except ValueError:
        return None


def infer_trip_count(ins: Instr, hlo: Hlo, caller: Computation | None) -> int | None:
    """Trip count of a counted loop without `known_trip_count` (XLA:TPU's windowed-einsum loops):
    the condition compares tuple element k with a constant, the body adds a constant to element
    k, and the initial tuple's element k is a constant (0 when it cannot be read)."""
    conds, bodies = _names(ins.attr("condition")), _names(ins.attr("body"))
    cond = hlo.computations.get(conds[0]) if conds else None
    body = hlo.computations.get(bodies[0]) if bodies else None
    if cond is None or body is None:
        return None
    root = next((i for i in cond.instrs if i.root), None)
    if root is None or root.opcode != "compare" or len(root.operands) != 2:
        return None
    direction = (root.attr("direction") or "").strip()
    a, b = (cond.by_name.get(o) for o in root.operands)
    if a is None or b is None:
        return None
    if a.opcode == "constant":  # limit OP counter: flip the comparison
        a, b = b, a
        direction = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}.get(direction, direction)
    if a.opcode != "get-tuple-element" or b.opcode != "constant":
        return None
    k = int(re.search(r"index=(\d+)", a.attrs).group(1))
    limit = _const(cond, b.name)
    body_root = next((i for i in body.instrs if i.root), None)
    if limit is None or body_root is None or body_root.opcode != "tuple" or k >= len(body_root.operands):
        return None
    step_ins = body.by_name.get(body_root.operands[k])
    if step_ins is None or step_ins.opcode != "add":
        return None
    step = next((v for v in (_const(body, o) for o in step_ins.operands) if v is not None), None)
    init = 0
    init_tuple = caller.by_name.get(ins.operands[0]) if caller and ins.operands else None
    if init_tuple is not None and init_tuple.opcode == "tuple" and k < len(init_tuple.operands):
        init = _const(caller, init_tuple.operands[k]) or 0
    if not step or step < 0:
        return None
    if direction in ("LT", "NE"):
        return max(0, -(-(limit - init) // step))
    if direction == "LE":
        return max(0, (limit - init) // step + 1)
    return None


def executed(hlo: Hlo, *, unknown_trip: int = 1, unknown: list | None = None) -> list[tuple[Computation, float]]:
    """(computation, times it runs per step) for ENTRY and every computation it runs as ops
    (while bodies x trip count, call / conditional branches / async computations x 1). Fusion
    bodies and reducers are not in the list: they are parts of one op. Loops without a known
    trip count run `unknown_trip` times and are appended to `unknown`."""
    out: dict[str, float] = {}
    unknown = [] if unknown is None else unknown

    def visit(name: str, times: float):
        comp = hlo.computations.get(name)
        if comp is None:
            return
        out[name] = out.get(name, 0.0) + times
        for ins in comp.instrs:
            if ins.opcode == "while":
                n = trip_count(ins, hlo, comp)
                if n is None:
                    unknown.append(ins.name)
                    n = unknown_trip
                for body in _names(ins.attr("body")):
                    visit(body, times * n)
                for cond in _names(ins.attr("condition")):
                    visit(cond, times * (n + 1))
            elif ins.opcode == "call":
                for c in _names(ins.attr("to_apply")):
                    visit(c, times)
            elif ins.opcode == "conditional":
                for c in (
                    _names(ins.attr("branch_computations"))
                    + _names(ins.attr("true_computation"))
                    + _names(ins.attr("false_computation"))
                ):
                    visit(c, times)
            elif ins.opcode == "async-start":
                for c in _names(ins.attr("calls")):
                    visit(c, times)
            elif ins.opcode == "custom-call" and _wraps_collective(hlo, ins):
                # XLA:TPU wraps some collectives (the ragged all-to-all, gathers inside loops) in a
                # custom call that runs a computation holding the collective
                for c in _names(ins.attr("called_computations")):
                    visit(c, times)

    visit(hlo.entry, 1.0)
    return [(hlo.computations[n], t) for n, t in out.items()]


# ------------------------------------------------------------------------------ compute


def _operand_shape(comp: Computation, name: str) -> str:
    ins = comp.by_name.get(name)
    return ins.shape if ins else ""


def dot_flops(comp: Computation, ins: Instr) -> float:
    """2 x multiply-adds of a dot or convolution."""
    out = math.prod(array_dims(ins.shape) or [1])
    if ins.opcode == "dot":
        lhs = array_dims(_operand_shape(comp, ins.operands[0])) if ins.operands else []
        contract = [int(d) for d in re.findall(r"\d+", ins.attr("lhs_contracting_dims") or "")]
        return 2.0 * out * math.prod(lhs[d] for d in contract if d < len(lhs))
    # convolution: every output element meets the input features times the window positions that
    # land on a real input element (`window_taps`): inside the input, past the padding, and, where
    # the input is dilated, on an element rather than a hole. XLA:TPU writes some dots this way:
    # a padded window larger than the input, and a batched matmul as a window of size E, stride
    # E - 1, lhs_dilate E over the batch dim, of which one tap per output is real.
    if len(ins.operands) < 2:
        return 0.0
    lhs = array_dims(_operand_shape(comp, ins.operands[0]))
    rhs = array_dims(_operand_shape(comp, ins.operands[1]))
    outd = array_dims(ins.shape)
    m = re.match(r"([^_]*)_([^-]*)->(.*)", ins.attr("dim_labels") or "")
    if (
        not rhs
        or not lhs
        or not m
        or len(m.group(1)) != len(lhs)
        or len(m.group(2)) != len(rhs)
        or len(m.group(3)) != len(outd)
        or "i" not in m.group(2)
    ):
        return 0.0
    lhs_l, rhs_l, out_l = m.groups()
    window = _window(ins.attr("window") or "")
    per_out, spatial_out = rhs[rhs_l.index("i")], 1
    for k, label in enumerate(rhs_l):
        if not label.isdigit():
            continue
        j = int(label)

        def at(key: str, default: int) -> int:
            vals = window.get(key, [])
            return vals[j] if j < len(vals) else default

        w = at("size", rhs[k])
        if label not in lhs_l or label not in out_l:
            per_out *= w
            continue
        o = outd[out_l.index(label)]
        per_out *= window_taps(
            n=lhs[lhs_l.index(label)],
            window=w,
            out=o,
            stride=at("stride", 1),
            pad_lo=at("pad_lo", 0),
            lhs_dilate=at("lhs_dilate", 1),
            rhs_dilate=at("rhs_dilate", 1),
        )
        spatial_out *= o
    return 2.0 * (out / max(spatial_out, 1)) * per_out


def _window(attr: str) -> dict[str, list[int]]:
    """A convolution's `window={size=1x8 stride=7 pad=0_0x7_7 lhs_dilate=8 ...}` as lists per spatial
    dim (`pad` as its low sides, `pad_lo`: the high side does not move a tap)."""
    out: dict[str, list[int]] = {}
    for key, val in re.findall(r"(\w+)=([-0-9_x]+)", attr):
        if key == "pad":
            out["pad_lo"] = [int(p.split("_")[0]) for p in val.split("x")]
        else:
            out[key] = [int(v) for v in val.split("x")]
    return out


@functools.lru_cache(maxsize=4096)
def window_taps(*, n: int, window: int, out: int, stride: int, pad_lo: int, lhs_dilate: int, rhs_dilate: int) -> int:
    """Over one spatial dim of a convolution, the (output position, window tap) pairs whose tap
    lands on an input element: position o * stride + k * rhs_dilate - pad_lo inside the dilated
    input [0, (n - 1) * lhs_dilate] and a multiple of lhs_dilate."""
    last = (n - 1) * lhs_dilate
    total = 0
    for o in range(out):
        base = o * stride - pad_lo
        if lhs_dilate == 1:
            # k in [0, window) with 0 <= base + k * rhs_dilate <= last
            lo = 0 if base >= 0 else (-base + rhs_dilate - 1) // rhs_dilate
            hi = min(window - 1, (last - base) // rhs_dilate) if last >= base else -1
            total += max(0, hi - lo + 1)
        else:
            total += sum(
                1
                for k in range(window)
                if 0 <= base + k * rhs_dilate <= last and (base + k * rhs_dilate) % lhs_dilate == 0
            )
    return total


def _fusion_flops(hlo: Hlo, name: str, seen: set | None = None) -> float:
    comp = hlo.computations.get(name)
    if comp is None:
        return 0.0
    seen = seen or set()
    total = 0.0
    for ins in comp.instrs:
        if ins.opcode in ("dot", "convolution"):
            total += dot_flops(comp, ins)
        elif ins.opcode == "fusion":
            for c in _names(ins.attr("calls")):
                if c not in seen:
                    seen.add(c)
                    total += _fusion_flops(hlo, c, seen)
    return total


def cost_estimate(ins: Instr) -> dict | None:
    """A Mosaic call's `cost_estimate` (flops, bytes_accessed, transcendentals), if it has one."""
    m = re.search(r'\\?"cost_estimate\\?"\s*:\s*\{([^}]*)\}', ins.attrs)
    if not m:
        return None
    vals = dict(re.findall(r'\\?"(\w+)\\?"\s*:\s*\\?"?([0-9.eE+\-]+)', m.group(1)))
    return {k: float(v) for k, v in vals.items()}


@dataclass
class Op:
    name: str
    opcode: str
    flops: float
    bytes: float
    times: float
    kind: str = "xla"  # xla | kernel | kernel-unestimated
    io: float = 0.0  # a kernel call's operand and result bytes (what a read-once model counts)
    source: str = ""  # the metadata's op_name (jax's trace path: the ATen / titan op it came from)


def op_source(ins: Instr) -> str:
    """The op_name of an instruction's metadata ('' without one)."""
    m = re.search(r'op_name="([^"]*)"', ins.attrs)
    return m.group(1) if m else ""


def compute_ops(hlo: Hlo) -> list[Op]:
    """Every executed non-collective op with its FLOPs, HBM bytes, times per step and source."""
    ops = []
    for comp, times in executed(hlo):
        for ins in comp.instrs:
            first = len(ops)
            base = ins.opcode.removesuffix("-start").removesuffix("-done")
            if ins.opcode == "copy-start" and ins.operands:
                # an async copy between HBM and on-chip memory: HBM traffic once, if one side is HBM
                src = _operand_shape(comp, ins.operands[0])
                parts = _tuple_parts(ins.shape) if ins.shape.startswith("(") else [ins.shape]
                dst = parts[1] if len(parts) > 1 else parts[0]
                if array_bytes(src, hbm_only=True) or array_bytes(dst, hbm_only=True):
                    ops.append(Op(ins.name, "copy-start", 0.0, array_bytes(src), times))
                continue
            if ins.opcode in _NO_COST or base in COLLECTIVES:
                continue
            io = array_bytes(ins.shape, hbm_only=True) + sum(
                array_bytes(_operand_shape(comp, o), hbm_only=True) for o in ins.operands
            )
            if ins.opcode == "fusion":
                called = _names(ins.attr("calls"))
                if any(c.startswith("all-reduce-scatter") or _has_collective(hlo, c) for c in called):
                    continue  # a collective wrapped as a fusion: counted by collectives()
                flops = sum(_fusion_flops(hlo, c) for c in called)
                fused = hlo.computations.get(called[0]) if len(called) == 1 else None
                ops.append(Op(ins.name, "fusion", flops, fusion_bytes(comp, ins, fused) if fused else io, times))
            elif ins.opcode in ("dynamic-slice", "dynamic-update-slice"):
                # reads and writes the slice only (an update in place leaves the rest untouched)
                part = ins.shape if ins.opcode == "dynamic-slice" else _operand_shape(comp, ins.operands[1])
                if array_bytes(ins.shape, hbm_only=True) or array_bytes(
                    _operand_shape(comp, ins.operands[0]), hbm_only=True
                ):
                    ops.append(Op(ins.name, ins.opcode, 0.0, 2 * array_bytes(part), times))
            elif ins.opcode in ("dot", "convolution"):
                ops.append(Op(ins.name, ins.opcode, dot_flops(comp, ins), io, times))
            elif ins.opcode == "custom-call" and _wraps_collective(hlo, ins):
                continue  # a collective in a wrapper: counted by collectives()
            elif ins.opcode == "custom-call" and '"tpu_custom_call"' in ins.attrs:
                est = cost_estimate(ins)
                full_io = array_bytes(ins.shape) + sum(array_bytes(_operand_shape(comp, o)) for o in ins.operands)
                if est is not None:
                    ops.append(
                        Op(
                            ins.name,
                            "kernel",
                            est.get("flops", 0.0),
                            est.get("bytes_accessed", io),
                            times,
                            kind="kernel",
                            io=full_io,
                        )
                    )
                else:
                    ops.append(Op(ins.name, "kernel", 0.0, io, times, kind="kernel-unestimated", io=full_io))
            else:
                ops.append(Op(ins.name, ins.opcode, 0.0, io, times))
            for op in ops[first:]:
                op.source = op_source(ins)
    return ops


_PASS_THROUGH = ("bitcast", "reshape")


def _read_bytes(name: str, users: dict[str, list[Instr]]) -> float | None:
    """The bytes a fused computation reads of value `name` when it reads part of it: every use a
    dynamic-slice or slice of it (their results' bytes), the buffer of an in-place
    dynamic-update-slice (nothing read), or a bitcast / reshape passing it on to such uses.
    None when some use reads it whole."""
    total = 0.0
    for user in users.get(name, []):
        if user.opcode in ("dynamic-slice", "slice") and user.operands[:1] == [name]:
            total += array_bytes(user.shape)
        elif user.opcode == "dynamic-update-slice" and user.operands[:1] == [name] and name not in user.operands[1:]:
            continue
        elif user.opcode in _PASS_THROUGH:
            sub = _read_bytes(user.name, users)
            if sub is None:
                return None
            total += sub
        else:
            return None
    return total


def _written_bytes(fused: Computation, ins: Instr) -> float:
    """The bytes a fused computation's result `ins` writes: an in-place dynamic-update-slice (under
    bitcasts / reshapes) writes its update only; a tuple, each of its parts."""
    if ins.opcode == "tuple":
        return sum(_written_bytes(fused, fused.by_name[o]) for o in ins.operands if o in fused.by_name)
    if ins.opcode in _PASS_THROUGH and ins.operands and ins.operands[0] in fused.by_name:
        inner = fused.by_name[ins.operands[0]]
        if inner.opcode in ("dynamic-update-slice", *_PASS_THROUGH, "tuple"):
            return _written_bytes(fused, inner)
    if ins.opcode == "dynamic-update-slice" and len(ins.operands) > 1 and ins.operands[1] in fused.by_name:
        return array_bytes(fused.by_name[ins.operands[1]].shape)
    return array_bytes(ins.shape)


def fusion_bytes(comp: Computation, ins: Instr, fused: Computation) -> float:
    """HBM bytes of a fusion: each operand in HBM read whole, or only the part the fused
    computation reads (`_read_bytes`: XLA's scan loops slice one layer of a stacked [L, ...]
    buffer and update one layer of another in place, so charging the whole buffer per trip
    counted L times the traffic); the result in HBM written whole, or only an in-place update's
    slice."""
    users: dict[str, list[Instr]] = {}
    for i in fused.instrs:
        for o in i.operands:
            users.setdefault(o, []).append(i)
    params = {}
    for i in fused.instrs:
        m = re.match(r"\s*(\d+)", i.args) if i.opcode == "parameter" else None
        if m:
            params[int(m.group(1))] = i
    total = 0.0
    for k, operand in enumerate(ins.operands):
        whole = array_bytes(_operand_shape(comp, operand), hbm_only=True)
        if not whole:
            continue  # on chip (or empty)
        part = _read_bytes(params[k].name, users) if k in params else None
        total += whole if part is None else min(part, whole)
    result = array_bytes(ins.shape, hbm_only=True)
    if result:
        root = next((i for i in fused.instrs if i.root), None)
        total += result if root is None else min(_written_bytes(fused, root), result)
    return total


def _wraps_collective(hlo: Hlo, ins: Instr) -> bool:
    """A custom call whose called computations hold a collective (not a Mosaic kernel)."""
    return '"tpu_custom_call"' not in ins.attrs and any(
        _has_collective(hlo, c) for c in _names(ins.attr("called_computations"))
    )


def _has_collective(hlo: Hlo, name: str) -> bool:
    comp = hlo.computations.get(name)
    return comp is not None and any(i.opcode.removesuffix("-start") in COLLECTIVES for i in comp.instrs)


def compute_time(
    ops: list[Op], *, peak_flops: float, hbm_bytes_per_s: float, kinds: tuple[str, ...] = ("xla", "kernel")
) -> float:
    """Sum over ops of max(FLOPs / peak, bytes / HBM bandwidth), each op times its runs."""
    return sum(o.times * max(o.flops / peak_flops, o.bytes / hbm_bytes_per_s) for o in ops if o.kind in kinds)


# ------------------------------------------------------------------------------ collectives


def parse_groups(ins: Instr, n_devices: int) -> tuple[list[list[int]] | None, list[str] | None]:
    """(explicit device groups, or None) and (mesh axis names from the `mesh[...]` form, or None)."""
    raw = ins.attr("replica_groups")
    if raw is None and "replica_groups=mesh[" in ins.attrs:
        raw = ""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", ins.attrs)
    if m:
        axes = re.findall(r"'([^']+)'", m.group(2))
        return None, axes
    if raw is None or raw in ("{}", ""):
        if ins.opcode.startswith("collective-permute"):
            return None, None
        return [list(range(n_devices))], None
    if raw.startswith("["):  # iota form: [G,S]<=[dims]T(perm)
        m = re.match(
            r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", ins.attrs[ins.attrs.index("replica_groups=") + 15 :]
        )
        if not m:
            return None, None
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        perm = [int(x) for x in m.group(3).split(",")] if m.group(3) else list(range(len(dims)))
        ids = _iota_transposed(dims, perm)
        size = shape[-1]
        return [ids[i : i + size] for i in range(0, len(ids), size)], None
    return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", raw[1:-1])], None


def _iota_transposed(dims: list[int], perm: list[int]) -> list[int]:
    """Flattened iota(prod dims) reshaped to dims and transposed by perm."""
    n = math.prod(dims)
    strides = [math.prod(dims[i + 1 :]) for i in range(len(dims))]
    tdims = [dims[p] for p in perm]
    out = []
    for flat in range(n):
        idx, rem = [], flat
        for d in reversed(tdims):
            idx.append(rem % d)
            rem //= d
        idx.reverse()
        src = [0] * len(dims)
        for k, p in enumerate(perm):
            src[p] = idx[k]
        out.append(sum(s * i for s, i in zip(strides, src)))
    return out


def axes_of_group(group: list[int], mesh: dict[str, int]) -> list[str]:
    """The logical mesh axes (device ids row-major over `mesh`, the first axis outermost) along
    which the devices of `group` differ."""
    names, sizes = list(mesh), list(mesh.values())
    coords = []
    for d in group:
        c = []
        for s in reversed(sizes):
            c.append(d % s)
            d //= s
        coords.append(list(reversed(c)))
    return [names[k] for k in range(len(names)) if len({c[k] for c in coords}) > 1]


@dataclass
class Collective:
    name: str
    kind: str  # all-gather | reduce-scatter | all-reduce | all-to-all | collective-permute
    bytes: float  # per device, see the module docstring
    group_size: int
    axes: tuple[str, ...]
    times: float
    direction: int = 0  # collective-permute: +1 / -1 when every pair sends to the next / previous device


def collectives(hlo: Hlo, mesh: dict[str, int]) -> list[Collective]:
    """Every collective the program runs, with its bytes per device and the mesh axes of its
    groups (`mesh`: the compile's logical mesh, axis name -> size, first axis outermost)."""
    n_devices = math.prod(mesh.values())
    mesh_names = list(mesh)
    out = []
    runs = {c.name: t for c, t in executed(hlo)}
    # computations a fusion op runs (the collectives XLA:TPU wraps in fusions) run as often as it
    for comp, times in list(executed(hlo)):
        for ins in comp.instrs:
            if ins.opcode == "fusion":
                for c in _names(ins.attr("calls")):
                    if c.startswith("all-reduce-scatter") or _has_collective(hlo, c):
                        runs[c] = runs.get(c, 0.0) + times
    for name, times in runs.items():
        comp = hlo.computations[name]
        for ins in comp.instrs:
            base = ins.opcode.removesuffix("-start")
            if base not in COLLECTIVES or ins.opcode.endswith("-done"):
                continue
            groups, axis_names = parse_groups(ins, n_devices)
            if base.startswith("collective-permute"):
                pairs = re.findall(r"\{(\d+),(\d+)\}", ins.attr("source_target_pairs") or "")
                groups = [[int(a), int(b)] for a, b in pairs] or None
            if axis_names is not None:
                axes = tuple(
                    mesh_names[int(a.split("_")[1])]
                    if re.fullmatch(r"axis_\d+", a) and int(a.split("_")[1]) < len(mesh_names)
                    else a
                    for a in axis_names
                )
                size = (
                    math.prod(mesh.get(a, 1) for a in axes)
                    if all(a in mesh for a in axes)
                    else _mesh_sizes(ins).get(axis_names[0], n_devices)
                )
            elif groups:
                found = sorted({a for g in groups for a in axes_of_group(g, mesh)}, key=mesh_names.index)
                axes = tuple(found) or ("?",)
                size = len(groups[0])
            else:
                axes, size = ("?",), n_devices
            shape = ins.shape
            if ins.opcode.endswith("-start") and shape.startswith("("):
                # async start: (operands, results[, scratch]): the result part is the second element
                parts = _tuple_parts(shape)
                shape = parts[1] if len(parts) > 1 else shape
            kind = base
            nbytes = array_bytes(shape)
            if base == "reduce-scatter":
                nbytes *= size
            elif base == "all-reduce" and comp.name.startswith("all-reduce-scatter"):
                kind = "reduce-scatter"  # an all-reduce whose result the fusion slices: bytes = operand
            elif base == "ragged-all-to-all":
                # (operand, output, offsets and sizes): one of the two buffers is the worst-case
                # receive buffer; what moves is at most the smaller (the rows actually sent)
                kind = "all-to-all"
                bufs = [array_bytes(_operand_shape(comp, o)) for o in ins.operands[:2]]
                nbytes = min([nbytes, *[b for b in bufs if b]])
            direction = 0
            if base.startswith("collective-permute") and groups:
                steps = {(t - src) % n_devices for src, t in groups}
                direction = 1 if steps == {1} else -1 if steps == {n_devices - 1} else 0
            out.append(Collective(ins.name, kind, nbytes, size, axes, times, direction))
    return out


def _mesh_sizes(ins: Instr) -> dict[str, int]:
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]", ins.attrs)
    return {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))} if m else {}


def _tuple_parts(shape: str) -> list[str]:
    inner, parts, depth, cur = shape[1:-1], [], 0, ""
    for c in inner:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += c
    if cur.strip():
        parts.append(cur.strip())
    return parts


# ------------------------------------------------------------------------------ bandwidth and time


def load_ici(path: Path = ANCHORS) -> dict:
    """The `[ici]` table of assets/anchors.toml: per generation, per-chip bidirectional ICI GB/s,
    ports per chip, torus dims, and the source."""
    with open(path, "rb") as f:
        return tomllib.load(f)["ici"]


def link_bytes_per_s(ici: dict) -> float:
    """One direction of one ICI link: the chip's bidirectional bandwidth over its ports, halved."""
    return ici["chip_bidirectional_gbps"] * 1e9 / ici["ports"] / 2


def axis_bandwidth(ici: dict, torus_dims_spanned: int) -> float:
    """Per-device bytes/s a ring collective gets on an axis laid over `torus_dims_spanned` dims of
    the torus (with wraparound): both directions of both neighbours' links in each dim."""
    return 2 * torus_dims_spanned * link_bytes_per_s(ici)


def mean_hops(n: int, torus_dims_spanned: int, devices_per_chip: int = 1) -> float:
    """Mean hop distance between two of n devices on a torus of `torus_dims_spanned` equal dims
    with wraparound (each dim contributes a quarter of its length)."""
    chips = max(n / devices_per_chip, 1.0)
    side = chips ** (1.0 / max(torus_dims_spanned, 1))
    return max(torus_dims_spanned * side / 4, 1.0)


def collective_time(
    c: Collective, bandwidth: float, link: float, n: int | None = None, hops: float | None = None
) -> float:
    """Seconds of one run of `c` on n devices (default its group size): a ring for all-gather,
    reduce-scatter, all-reduce; all-to-all: every byte but the own share travels `hops` links
    (default n / 4, a bidirectional ring); collective-permute: one hop."""
    n = n or c.group_size
    if n <= 1:
        return 0.0
    ring = (n - 1) / n
    if c.kind in ("all-gather", "reduce-scatter"):
        return ring * c.bytes / bandwidth
    if c.kind == "all-reduce":
        return 2 * ring * c.bytes / bandwidth
    if c.kind == "all-to-all":
        return ring * c.bytes * (n / 4 if hops is None else hops) / bandwidth
    return c.bytes / link  # collective-permute: one hop


def comm_by_axis(
    colls: list[Collective], *, ici: dict, axis_dims: dict[str, int], axis_size: dict[str, int] | None = None
) -> dict[str, float]:
    """Seconds per step of the collectives, per mesh axis (axes joined by '+' when a group spans
    several). axis_dims: torus dims each logical axis spans at the target; axis_size: the axis
    size at the target (for the (n-1)/n factor and all-to-all's hops; default the compiled group
    size)."""
    out: dict[str, float] = {}
    link = link_bytes_per_s(ici)
    # Ring permutes (XLA:TPU's windowed-einsum loops pass shards to a neighbour) in the two
    # directions use the two directions of the links: they can run at once, so per axis the
    # permute time is the larger direction's, not the sum.
    ring: dict[str, list[float]] = {}
    for c in colls:
        key = "+".join(c.axes)
        if c.kind == "collective-permute" and c.direction:
            ring.setdefault(key, [0.0, 0.0])[c.direction > 0] += c.times * c.bytes / link
            continue
        dims = min(sum(axis_dims.get(a, 1) for a in c.axes), ici["torus_dims"])
        n = None
        if axis_size and all(a in axis_size for a in c.axes):
            n = math.prod(axis_size[a] for a in c.axes)
        hops = mean_hops(n or c.group_size, dims, ici.get("devices_per_chip", 1))
        out[key] = out.get(key, 0.0) + c.times * collective_time(c, axis_bandwidth(ici, dims), link, n, hops)
    for key, (back, fwd) in ring.items():
        out[key] = out.get(key, 0.0) + max(back, fwd)
    return out


# ------------------------------------------------------------------------------ placement on the torus


@dataclass
class Placement:
    """Where a compiled program's mesh sits on its slice: the mesh's axis sizes (`a0`, `a1`, ...,
    outermost first, as tools/tpu_compile.py names them) and each device's chip coordinates and
    core, row-major over the mesh (tpu_compile's `device_coords`, or `placement_of` for a layout
    that was not compiled)."""

    radices: list[int]
    coords: list[tuple[int, ...]]
    chips: tuple[int, int, int]
    wrap: tuple[bool, bool, bool]

    @property
    def mesh(self) -> dict[str, int]:
        return {f"a{i}": r for i, r in enumerate(self.radices)}

    def group(self, axes: tuple[str, ...]) -> list[tuple[int, ...]]:
        """Coordinates of the group that holds device 0 and spans `axes` (names a0, a1, ...)."""
        idx = {int(a[1:]) for a in axes if re.fullmatch(r"a\d+", a)}
        strides = [math.prod(self.radices[i + 1 :]) for i in range(len(self.radices))]
        members = [0]
        for i in sorted(idx):
            members = [m + d * strides[i] for m in members for d in range(self.radices[i])]
        return [tuple(self.coords[m]) for m in members]

    def facts(self, axes: tuple[str, ...]) -> dict:
        """n, torus_dims (chip axes the group spans), mean_hops (chip-to-chip links between two
        distinct members, shortest way round each ring, averaged over ordered pairs), per_chip
        (the group's devices on one chip: they share its links)."""
        return group_facts(self.group(axes), self.chips, self.wrap)


def group_facts(coords: list[tuple[int, ...]], chips: tuple[int, int, int], wrap: tuple[bool, ...]) -> dict:
    """See `Placement.facts`. The mean of a sum is the sum of the means, so the mean Manhattan
    distance is summed per chip axis from the histogram of the members' coordinates on it."""
    n = len(coords)
    dims = [k for k in range(3) if len({c[k] for c in coords}) > 1]
    hops = 0.0
    if n > 1:
        for k in dims:
            hist: dict[int, int] = {}
            for c in coords:
                hist[c[k]] = hist.get(c[k], 0) + 1
            length = chips[k]
            total = 0.0
            for a, na in hist.items():
                for b, nb in hist.items():
                    d = abs(a - b)
                    if wrap[k]:
                        d = min(d, length - d)
                    total += na * nb * d
            hops += total / (n * (n - 1))
    per_chip = max(
        (sum(1 for c in coords if c[:3] == chip) for chip in {c[:3] for c in coords}),
        default=1,
    )
    return {"n": n, "torus_dims": len(dims), "mean_hops": hops, "per_chip": per_chip}


def placement_of(topology, mesh_shape, radices: list[int], ep: int = 1) -> Placement:
    """The placement the trainer's mesh `mesh_shape` gets on `topology` (a
    parallelisms.tpu_topology.Topology: the trainer's layout, `trainer_layout`, torch-tpu's with
    compact EP groups), refined row-major into the program's axes `radices`: what
    tools/tpu_compile.py compiles over, without compiling."""
    from parallelisms.tpu_topology import trainer_layout

    x_size, y_size, _ = topology.chips
    per_chip = topology.devices_per_chip
    ids = list(_flat(trainer_layout(topology, tuple(mesh_shape), ep=ep).device_ids))

    def coords(dev: int) -> tuple[int, ...]:
        core, chip = dev % per_chip, dev // per_chip
        return (chip % x_size, chip // x_size % y_size, chip // (x_size * y_size), core)

    return Placement(
        radices=list(radices), coords=[coords(d) for d in ids], chips=topology.chips, wrap=topology.wrap[:3]
    )


def _flat(nested):
    if isinstance(nested, (tuple, list)):
        for x in nested:
            yield from _flat(x)
    else:
        yield nested


def comm_on_placement(colls: list[Collective], *, ici: dict, placement: Placement) -> dict[str, float]:
    """Seconds per step of the collectives per mesh axis (joined by '+'), each priced on the
    torus where `placement` puts its group: ring collectives at the bandwidth of the chip axes the
    group spans (`axis_bandwidth`; a group inside one chip gets one axis's, the die-to-die link
    not being modelled as faster); all-to-all: every device sends (n-1)/n of its buffer, each
    byte over the group's mean hop count, through its chip's links, which the group's devices on
    that chip share; ring permutes as in `comm_by_axis`."""
    out: dict[str, float] = {}
    link = link_bytes_per_s(ici)
    ring: dict[str, list[float]] = {}
    cache: dict[tuple, dict] = {}
    for c in colls:
        key = "+".join(c.axes)
        if c.kind == "collective-permute" and c.direction:
            ring.setdefault(key, [0.0, 0.0])[c.direction > 0] += c.times * c.bytes / link
            continue
        if c.axes not in cache:
            cache[c.axes] = placement.facts(c.axes)
        f = cache[c.axes]
        if f["n"] <= 1 and all(re.fullmatch(r"a\d+", a) for a in c.axes):
            continue  # a group of one device at this placement (a mesh axis of size 1): no traffic
        n = f["n"] if f["n"] > 1 else c.group_size
        bandwidth = axis_bandwidth(ici, max(f["torus_dims"], 1))
        if c.kind == "all-to-all":
            t = (n - 1) / n * c.bytes * f["mean_hops"] * f["per_chip"] / bandwidth if n > 1 else 0.0
        else:
            t = collective_time(c, bandwidth, link, n)
        out[key] = out.get(key, 0.0) + c.times * t
    for key, (back, fwd) in ring.items():
        out[key] = out.get(key, 0.0) + max(back, fwd)
    return out


def bound(*, compute_s: float, comm_s: float, model_flops: float, peak_flops: float) -> dict:
    """Step time and MFU both ways: fully exposed (compute + comm) and perfectly overlapped
    (max(compute, comm)). compute_s is floored at model_flops / peak, so neither MFU exceeds 100 %."""
    compute_s = max(compute_s, model_flops / peak_flops)
    exposed, overlapped = compute_s + comm_s, max(compute_s, comm_s)
    return {
        "compute_s": compute_s,
        "comm_s": comm_s,
        "step_exposed_s": exposed,
        "step_overlapped_s": overlapped,
        "mfu_exposed_pct": 100.0 * model_flops / (peak_flops * exposed),
        "mfu_overlapped_pct": 100.0 * model_flops / (peak_flops * overlapped),
    }


def summarize(text: str, *, mesh: dict[str, int]) -> dict:
    """One program's counts: ops, collectives, while loops without a known trip count."""
    hlo = parse_hlo(text)
    ops = compute_ops(hlo)
    colls = collectives(hlo, mesh)
    unknown: list[str] = []
    executed(hlo, unknown=unknown)
    return {"ops": ops, "collectives": colls, "unknown_trips": unknown}
