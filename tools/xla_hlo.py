"""Reading a compiled per-device XLA:TPU program: the optimized HLO text parsed, the computations
that run (and how often), and the compute cost of each executed op (tools/xla_projection.py prices
them and the collectives; docs/benchmarks.md, "Projections").

Plain text in, numbers out; no jax, no torch.

- Executed ops are the instructions of ENTRY, of `while` bodies (times the loop's
  `known_trip_count`: XLA's own cost analysis counts a loop body once), and of computations
  run by `call`, `conditional` (every branch, once) and `async-start`. A fusion is one op: its
  FLOPs are the dots and convolutions inside it (2 per multiply-add), its HBM bytes its operands
  and results outside on-chip memory (layouts marked `S(n)`, n > 0, are VMEM/SMEM and not
  counted). Op time = max(FLOPs / peak, bytes / HBM bandwidth); compute time = the sum.
- Mosaic (Pallas) custom calls: the `cost_estimate` their kernel attached (megablox gmm/tgmm)
  where the HLO carries one; the others are counted as `kernel_calls_without_estimate` and the
  caller adds their FLOPs and bytes from its own model (titan_kernels/tpu/capture.py). The Mosaic
  calls XLA:TPU emits itself for a `ragged-dot` (`is_xla_ragged_dot`) are XLA ops at their estimate.
- Low-precision dots: `mxu_flops` with `peak_rates` (assets/anchors.toml) charges a dot of float8
  / int8 operands at the chip's rate for them (v7x float8, v6e int8: twice bf16's); `Op.flops`
  stays the FLOPs executed.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field

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


def _tuple_parts(shape: str) -> list[str]:
    """The element shapes of a tuple shape `(a, b, ...)` (nested brackets kept whole)."""
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
    # `%t#2`: newer XLA's shorthand for element 2 of tuple %t (a get-tuple-element; `_tuple_refs`)
    operands = re.findall(r"%([\w.\-]+(?:#\d+)?)", rest[op.end() : end - 1])
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
            if current is not None:
                _tuple_refs(current)
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


def _tuple_refs(comp: Computation) -> None:
    """Give every `name#k` operand (newer XLA's shorthand for a tuple element, e.g. a while loop's
    `compare(%cond_param#0, %limit)`) an entry in `by_name`: a get-tuple-element of `name` with the
    element's shape and `index=k` (not added to `instrs`: no op runs for it)."""
    for ins in list(comp.instrs):
        for ref in ins.operands:
            if "#" not in ref or ref in comp.by_name:
                continue
            base, k = ref.rsplit("#", 1)
            tup = comp.by_name.get(base)
            parts = _tuple_parts(tup.shape) if tup is not None and tup.shape.startswith("(") else []
            shape = re.sub(r"/\*.*?\*/", "", parts[int(k)]).strip() if int(k) < len(parts) else ""
            comp.by_name[ref] = Instr(ref, shape, "get-tuple-element", [base], f"index={k}")


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
            # the k of that range with base + k * rhs_dilate a multiple of lhs_dilate: one residue
            # class modulo lhs_dilate / gcd, counted in closed form (a loop over the window took
            # minutes on MaxText's MoE program, whose convolutions have windows of thousands)
            lo = 0 if base >= 0 else (-base + rhs_dilate - 1) // rhs_dilate
            hi = min(window - 1, (last - base) // rhs_dilate) if last >= base else -1
            g = math.gcd(rhs_dilate, lhs_dilate)
            if hi < lo or base % g:
                continue
            period = lhs_dilate // g
            k0 = (-base // g) * pow(rhs_dilate // g, -1, period) % period if period > 1 else 0
            first = lo + (k0 - lo) % period
            total += max(0, (hi - first) // period + 1) if first <= hi else 0
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
                    total += _fusion_flops(hlo, c, seen) * masked_share(ins)
    return total


def cost_estimate(ins: Instr) -> dict | None:
    """A Mosaic call's `cost_estimate` (flops, bytes_accessed, transcendentals), if it has one."""
    m = re.search(r'\\?"cost_estimate\\?"\s*:\s*\{([^}]*)\}', ins.attrs)
    if not m:
        return None
    vals = dict(re.findall(r'\\?"(\w+)\\?"\s*:\s*\\?"?([0-9.eE+\-]+)', m.group(1)))
    return {k: float(v) for k, v in vals.items()}


def masked_share(ins: Instr) -> float:
    """The share of a fusion's dot work XLA:TPU runs when the fusion skips the iterations its mask
    leaves empty (`mask_aggregator_config` with `ITERATION_SKIPPER_MODE_GROUP_STARTS`: how it lowers
    a ragged dot's contracting mode, the grouped weight gradient, as one convolution over every group's
    copy of the rows, [G, M, ...], masked to each group's own rows). The mask's [G, M] maps to two
    iteration dims (G groups, the rows in `chunks`); with the rows split evenly over the groups an
    iteration runs when its chunk holds rows of its group: chunks + G - 1 of the G x chunks (a chunk
    can straddle two groups). Where the config leaves the iteration bounds to the emitter (the pod
    programs' ragged dots: `"is_ragged_dot":true,"num_groups_in_ragged_dot":"G"`, in a fusion nested
    in the one the schedule runs), 1 / G. 1.0 for any other op."""
    if "ITERATION_SKIPPER_MODE_GROUP_STARTS" not in ins.attrs:
        return 1.0
    m = re.search(r'"mask_dim_to_iteration_index"\s*:\s*\[([^\]]*)\]', ins.attrs)
    b = re.search(r'"iteration_bounds"\s*:\s*\[([^\]]*)\]', ins.attrs)
    dims = [int(x) for x in re.findall(r"\d+", m.group(1))] if m else []
    bounds = [int(x) for x in re.findall(r"\d+", b.group(1))] if b else []
    if len(dims) == 2 and bounds and max(dims) < len(bounds):
        groups, chunks = bounds[dims[0]], bounds[dims[1]]
        if groups >= 2 and chunks >= 1:
            return min(1.0, (chunks + groups - 1) / (groups * chunks))
    # the iteration space left to the emitter (no bounds in the config): each row's work once, in
    # the one group it belongs to (the windows that straddle two groups not counted: at the pod
    # programs' 81,920 rows per device in 128-row windows, under 1 % more)
    g = re.search(r'"num_groups_in_ragged_dot"\s*:\s*"?(\d+)', ins.attrs)
    return 1.0 / int(g.group(1)) if g and int(g.group(1)) >= 2 else 1.0


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
                flops = sum(_fusion_flops(hlo, c) for c in called) * masked_share(ins)
                fused = hlo.computations.get(called[0]) if len(called) == 1 else None
                ops.append(Op(ins.name, "fusion", flops, fusion_bytes(comp, ins, fused, hlo) if fused else io, times))
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
            elif is_xla_ragged_dot(ins):
                # XLA's own lowering of a ragged dot (and its group metadata): an XLA op, priced by
                # the estimate XLA attached, not one of the program's kernels
                est = cost_estimate(ins) or {}
                ops.append(Op(ins.name, "ragged-dot", est.get("flops", 0.0), est.get("bytes_accessed", io), times))
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


def _read_bytes(
    name: str, users: dict[str, list[Instr]], hlo: Hlo | None = None, shapes: dict[str, str] | None = None
) -> float | None:
    """The bytes a fused computation reads of value `name` when it reads part of it: every use a
    dynamic-slice or slice of it (their results' bytes), the buffer of an in-place
    dynamic-update-slice (nothing read), a bitcast / reshape passing it on to such uses, or (with
    `hlo` and the computation's `shapes`) a nested fusion that reads its parameter so, or a
    one-operand nested fusion of the same elements (a tiling change, a convert) whose result is read
    so (it computes only the elements read). The layer scan's backward matmul fusions of the
    trainer's programs take the stacked [L, ...] residuals through such inner fusions to a
    dynamic-slice of one layer. None when some use reads it whole."""
    total = 0.0
    for user in users.get(name, []):
        if user.opcode in ("dynamic-slice", "slice") and user.operands[:1] == [name]:
            total += array_bytes(user.shape)
        elif user.opcode == "dynamic-update-slice" and user.operands[:1] == [name] and name not in user.operands[1:]:
            continue
        elif user.opcode in _PASS_THROUGH:
            sub = _read_bytes(user.name, users, hlo, shapes)
            if sub is None:
                return None
            total += sub
        elif user.opcode == "fusion" and hlo is not None:
            sub = _nested_read_bytes(hlo, user, name)
            src = (shapes or {}).get(name, "")
            if sub is None and user.operands == [name] and src and _elements(src) == _elements(user.shape):
                out = _read_bytes(user.name, users, hlo, shapes)
                if out is not None:
                    sub = out * array_bytes(src) / max(array_bytes(user.shape), 1.0)
            if sub is None:
                return None
            total += sub
        else:
            return None
    return total


def _elements(shape: str) -> int:
    n = 1
    for d in array_dims(shape):
        n *= d
    return n


def _uses(comp: Computation) -> tuple[dict[str, list[Instr]], dict[str, str], dict[int, Instr]]:
    """A fused computation's users per value, shapes per value and parameters by number."""
    users: dict[str, list[Instr]] = {}
    params = {}
    for i in comp.instrs:
        for o in i.operands:
            users.setdefault(o, []).append(i)
        m = re.match(r"\s*(\d+)", i.args) if i.opcode == "parameter" else None
        if m:
            params[int(m.group(1))] = i
    return users, {i.name: i.shape for i in comp.instrs}, params


def _nested_read_bytes(hlo: Hlo, user: Instr, name: str) -> float | None:
    """The bytes a nested fusion `user` reads of its operand `name` (`_read_bytes` on the parameters
    it is passed as); None when it reads it whole or the fused computation is unknown."""
    called = _names(user.attr("calls"))
    inner = hlo.computations.get(called[0]) if len(called) == 1 else None
    if inner is None:
        return None
    users, shapes, params = _uses(inner)
    total = 0.0
    for k, operand in enumerate(user.operands):
        if operand != name:
            continue
        if k not in params:
            return None
        sub = _read_bytes(params[k].name, users, hlo, shapes)
        if sub is None:
            return None
        total += sub
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


def fusion_bytes(comp: Computation, ins: Instr, fused: Computation, hlo: Hlo | None = None) -> float:
    """HBM bytes of a fusion: each operand in HBM read whole, or only the part the fused
    computation reads (`_read_bytes`: XLA's scan loops slice one layer of a stacked [L, ...]
    buffer and update one layer of another in place, so charging the whole buffer per trip
    counted L times the traffic); the result in HBM written whole, or only an in-place update's
    slice."""
    users, shapes, params = _uses(fused)
    total = 0.0
    for k, operand in enumerate(ins.operands):
        whole = array_bytes(_operand_shape(comp, operand), hbm_only=True)
        if not whole:
            continue  # on chip (or empty)
        part = _read_bytes(params[k].name, users, hlo, shapes) if k in params else None
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


# ------------------------------------------------------------------------------ MXU tiles


def _pad(n: int, tile: int) -> int:
    return -(-n // tile) * tile


def mxu_utilization(comp: Computation, ins: Instr, tile: int) -> float:
    """The share of a `tile` x `tile` MXU a dot keeps busy: one operand's [K, N] block stays in
    the array while the other's rows stream through it, so the contracted size K and the stationary
    operand's free size fill it (each padded up to a whole tile); the free size of the other operand
    streams, unpadded. The better of the two operand orders: K / pad(K) x max(N / pad(N), M / pad(M)).
    1.0 for anything not a dot (convolutions included)."""
    if ins.opcode != "dot" or len(ins.operands) < 2:
        return 1.0
    lhs = array_dims(_operand_shape(comp, ins.operands[0]))
    rhs = array_dims(_operand_shape(comp, ins.operands[1]))
    if not lhs or not rhs:
        return 1.0

    def dims(key: str) -> list[int]:
        return [int(d) for d in re.findall(r"\d+", ins.attr(key) or "")]

    lc, rc, lb, rb = (
        dims("lhs_contracting_dims"),
        dims("rhs_contracting_dims"),
        dims("lhs_batch_dims"),
        dims("rhs_batch_dims"),
    )
    k = math.prod(lhs[d] for d in lc if d < len(lhs)) or 1
    m = math.prod(n for d, n in enumerate(lhs) if d not in lc and d not in lb) or 1
    n = math.prod(x for d, x in enumerate(rhs) if d not in rc and d not in rb) or 1
    return (k / _pad(k, tile)) * max(n / _pad(n, tile), m / _pad(m, tile))


def _dtype(shape: str) -> str:
    m = _ARRAY.search(shape)
    return m.group(1) if m else ""


def operand_dtypes(comp: Computation, ins: Instr) -> list[str]:
    """The element types of a dot's or convolution's two operands as the MXU reads them (the
    operands' own shapes: a convert fused in front of the dot has already made them float8 / int8)."""
    return [_dtype(_operand_shape(comp, o)) for o in ins.operands[:2]]


def mxu_rate(dtypes: list[str], rates: dict[str, float] | None) -> float:
    """The MXU's rate for a dot of these operand types over its bf16 rate (`rates`: dtype -> peak
    over the bf16 peak, `peak_rates`): the slower operand's; 1.0 for a type `rates` does not name
    (bf16, f32) or without `rates`. A float8 x bf16 dot runs at the bf16 rate."""
    if not rates or not dtypes:
        return 1.0
    return min(rates.get(d, 1.0) for d in dtypes)


def peak_rates(anchors: dict, generation: str) -> dict[str, float]:
    """{operand dtype: MXU peak over the bf16 peak} of a chip from the `[mxu_peak_tflops_per_chip]`
    table of assets/anchors.toml (v7x: float8 2x; v6e: int8 2x, float8 1x); {} for a chip the table
    does not list (every dot at the bf16 rate)."""
    table = anchors.get("mxu_peak_tflops_per_chip", {}).get(generation, {})
    bf16 = table.get("bf16")
    return {d: v / bf16 for d, v in table.items() if d != "bf16"} if bf16 else {}


def is_xla_ragged_dot(ins: Instr) -> bool:
    """A Mosaic call XLA:TPU emits itself for a `ragged-dot` (`lax.ragged_dot`: `ragged-dot-*` in
    its metadata, or its `ragged_dot_tiling`), not a Pallas kernel of the program's."""
    return ins.opcode == "custom-call" and ("ragged_dot_tiling" in ins.attrs or op_source(ins).startswith("ragged-dot"))


def mxu_flops(hlo: Hlo, tile: int, rates: dict[str, float] | None = None) -> dict[str, float]:
    """Per executed dot or fusion (by instruction name): its dots' FLOPs over their MXU utilization
    (`mxu_utilization`): the FLOPs the MXU spends, padding included. With `rates` (`peak_rates`:
    operand dtype -> the MXU's rate over bf16), each dot's FLOPs are divided by its operands' rate
    (`mxu_rate`): bf16-equivalent FLOPs, what the op takes at the bf16 peak (a float8 dot on a v7x
    half its FLOPs). XLA's own ragged-dot calls (`is_xla_ragged_dot`) count their `cost_estimate`'s
    FLOPs at their operands' rate."""
    out: dict[str, float] = {}

    def one(comp: Computation, ins: Instr) -> float:
        rate = mxu_rate(operand_dtypes(comp, ins), rates)
        return dot_flops(comp, ins) / max(mxu_utilization(comp, ins, tile), 1e-9) / rate

    def inside(name: str, seen: set) -> float:
        comp = hlo.computations.get(name)
        total = 0.0
        for ins in comp.instrs if comp is not None else []:
            if ins.opcode in ("dot", "convolution"):
                total += one(comp, ins)
            elif ins.opcode == "fusion":
                for c in _names(ins.attr("calls")):
                    if c not in seen:
                        seen.add(c)
                        total += inside(c, seen) * masked_share(ins)
        return total

    for comp, _ in executed(hlo):
        for ins in comp.instrs:
            if ins.opcode in ("dot", "convolution"):
                out[ins.name] = one(comp, ins)
            elif ins.opcode == "fusion":
                f = sum(inside(c, set()) for c in _names(ins.attr("calls"))) * masked_share(ins)
                if f:
                    out[ins.name] = f
            elif is_xla_ragged_dot(ins):
                est = cost_estimate(ins) or {}
                dtypes = [d for d in (_dtype(_operand_shape(comp, o)) for o in ins.operands) if d in _DOT_TYPES]
                if est.get("flops"):
                    out[ins.name] = est["flops"] / mxu_rate(dtypes[-2:], rates)
    return out


_DOT_TYPES = {"bf16", "f16", "f32", "s8", "u8", "f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3fnuz", "f8e5m2fnuz"}
"""The element types a ragged dot's matrix operands can have (its other operands are s32 group
metadata)."""


def dot_flops_by_type(hlo: Hlo) -> dict[str, float]:
    """The FLOPs per step the program's dots execute (every executed dot and convolution, in
    fusions too, times its runs; XLA's ragged dots at their estimate), by their operands' types
    (`"f8e4m3fn x f8e5m2"`): how much of a low-precision program's matmul work is low precision."""
    out: dict[str, float] = {}

    def add(comp: Computation, ins: Instr, flops: float, times: float) -> None:
        key = " x ".join(operand_dtypes(comp, ins))
        out[key] = out.get(key, 0.0) + flops * times

    def inside(name: str, times: float, seen: set) -> None:
        comp = hlo.computations.get(name)
        for ins in comp.instrs if comp is not None else []:
            if ins.opcode in ("dot", "convolution"):
                add(comp, ins, dot_flops(comp, ins), times)
            elif ins.opcode == "fusion":
                for c in _names(ins.attr("calls")):
                    if c not in seen:
                        seen.add(c)
                        inside(c, times * masked_share(ins), seen)

    for comp, times in executed(hlo):
        for ins in comp.instrs:
            if ins.opcode in ("dot", "convolution"):
                add(comp, ins, dot_flops(comp, ins), times)
            elif ins.opcode == "fusion":
                if any(_has_collective(hlo, c) for c in _names(ins.attr("calls"))):
                    continue
                for c in _names(ins.attr("calls")):
                    inside(c, times * masked_share(ins), set())
            elif is_xla_ragged_dot(ins):
                est = cost_estimate(ins) or {}
                if est.get("flops"):
                    dtypes = [d for d in (_dtype(_operand_shape(comp, o)) for o in ins.operands) if d in _DOT_TYPES]
                    key = " x ".join(dtypes[-2:])
                    out[key] = out.get(key, 0.0) + est["flops"] * times
    return out
