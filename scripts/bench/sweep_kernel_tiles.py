#!/usr/bin/env python
"""Sweep the Pallas kernels' tiles per TPU generation and write the table they read.

    python scripts/bench/sweep_kernel_tiles.py --mode list    [--generation GEN ...] [--kernel gmm|fused_ce|splash ...]
    python scripts/bench/sweep_kernel_tiles.py --mode compile [--generation GEN ...] [--out FILE]   (no TPU)
    python scripts/bench/sweep_kernel_tiles.py --mode time    [--out FILE]                         (on a TPU VM)

Shapes: each shipped recipe's (`RECIPES`, checked against configs/*_v6e.toml and *_v7x.toml and
the model flavors by tests/unit/test_kernel_tiles_sweep.py), per generation: gmm at the recipe's
tokens x top-k rows per device and experts / ep groups, both expert matmuls (shape class "KxN");
the fused loss at its tokens per device, vocabulary and hidden size ("d<dim>"); splash at its
sequence, GQA group and head widths ("s<seq>d<head_dim>"; recipes without context parallelism:
the CP kernels keep their own rule). A class used by several recipes is costed at each and the
costs summed. A generation without a recipe (v4, v5e, v5p) gets the fixed shapes (`--shapes
fixed`: `GMM_SHAPES` at `--gmm-rows` / `--groups`, `CE_DIMS` at `--ce-rows` / `--vocab`,
`SPLASH_SHAPES`).

Candidates: power-of-two tiles from 128 up (gmm: tm to 1024, tk/tn to 2048; loss: block_n to
1024, block_v to 2048; splash: block_q, block_kv to 2048) that the kernel accepts (dividing the
dimension, or all of it) and whose working-set estimate fits the generation's VMEM budget
(titan_kernels/tpu/tiles.py; splash: none, the compile decides). They are ordered by the rule's
model (gmm: roofline `tiles.gmm_cost`; loss: bytes per FLOP; splash: fewer grid steps), with
today's pick (what the kernels use at that shape from the current table) first;
`--max-candidates N` keeps the first N.
- `list`: print the candidates; with `--out`, write the rule's model pick. Pure Python.
- `compile`: compile each candidate's program deviceless for the generation's compile-only
  topology with the installed libtpu and pick the one with the lowest compiled cost (below);
  a candidate that does not compile (scoped VMEM) is dropped.
- `time`: on a TPU (the generation is the local one), run each candidate's forward + backward
  `--repeats` times and pick the fastest median.

The compiled cost is libtpu's static LLO profile (`--xla_jf_dump_static_llo_profile_to`): an
`estimated_cycles` per HLO op of the compiled program, Mosaic kernels included (their final
bundle schedule times the grid's trip counts; it depends on the tiles), summed over the ops.
What the compiler does not give: `compiled.cost_analysis()` reports `flops`, `bytes accessed`
and `optimal_seconds`, but for a Mosaic call those come from the kernel's own `pl.CostEstimate`
(megablox attaches one; splash and the loss none), a roofline of the author's formula, not the
compiler's. The program per kernel: gmm forward + backward (gmm, dx gmm, dw tgmm), with
megablox's data-dependent grid size fixed to the balanced routing's tile count while compiling
(`static_gmm_grid`: the estimator counts an unknown trip count as a constant, so without it
the row tile's effect on the number of steps would be invisible); the loss forward + backward;
splash forward and its backward compiled apart (one KV head, the recipe's group of query heads),
so its forward and backward blocks are picked separately.
`--out` (default: print only) merges the picks into a table file in tiles.toml's format,
keeping entries for other generations and shapes, and records each generation's source (mode,
libtpu version, date, commit). Bad arguments: one `error:` line, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "titan_kernels" / "tpu"))
sys.path.insert(1, str(ROOT))
import tiles  # noqa: E402  (pure Python; the kernels import it the same way in the probes)

from trainer.runtime import cli  # noqa: E402  (standard library only: runs in the jax venvs)

KERNELS = ("gmm", "fused_ce", "splash")
GMM_SHAPES = ((2048, 768), (768, 2048), (4096, 1536), (1536, 4096))
"""Fixed shapes (generations without a recipe): K x N of Qwen3-30B-A3B's and Qwen3-235B-A22B's
expert projections (gate/up, down)."""
CE_DIMS = (4096, 5120, 8192)
"""Fixed shapes: hidden sizes of loss heads (Llama 3 8B, Qwen 3 32B, Llama 3 70B)."""
SPLASH_SHAPES = ((8192, 4, 128, 128),)
"""Fixed shapes: (sequence, query heads per KV head, q/k and v head widths) of Llama 3 8B."""

RECIPES = {
    # recipe: generation, tokens per sequence, sequences per device, cp, model dims, MoE dims, ep
    "llama3_8b_v6e": dict(gen="v6e", seq=8192, batch=1, cp=1, dim=4096, vocab=128256, heads=32, kv_heads=8, head_dim=128),
    "llama3_8b_128k_v6e": dict(gen="v6e", seq=131072, batch=1, cp=4, dim=4096, vocab=128256, heads=32, kv_heads=8, head_dim=128),
    "llama3_70b_v6e": dict(gen="v6e", seq=8192, batch=1, cp=1, dim=8192, vocab=128256, heads=64, kv_heads=8, head_dim=128),
    "qwen3_8b_v6e": dict(gen="v6e", seq=4096, batch=2, cp=1, dim=4096, vocab=151936, heads=32, kv_heads=8, head_dim=128),
    "qwen3_32b_v6e": dict(gen="v6e", seq=4096, batch=2, cp=1, dim=5120, vocab=151936, heads=64, kv_heads=8, head_dim=128),
    "qwen3_32b_128k_v6e": dict(gen="v6e", seq=131072, batch=1, cp=8, dim=5120, vocab=151936, heads=64, kv_heads=8, head_dim=128),
    "qwen3_30b_a3b_v6e": dict(gen="v6e", seq=4096, batch=8, cp=1, dim=2048, vocab=151936, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8, moe_hidden=768, ep=8, dropless=dict(batch=2, ep=8)),
    "llama3_8b_128k_v7x": dict(gen="v7x", seq=131072, batch=1, cp=2, dim=4096, vocab=128256, heads=32, kv_heads=8, head_dim=128),
    "llama3_405b_v7x": dict(gen="v7x", seq=8192, batch=1, cp=1, dim=16384, vocab=128256, heads=128, kv_heads=8, head_dim=128),
    "qwen3_32b_128k_v7x": dict(gen="v7x", seq=131072, batch=1, cp=2, dim=5120, vocab=151936, heads=64, kv_heads=8, head_dim=128),
    "qwen3_235b_a22b_v7x": dict(gen="v7x", seq=4096, batch=8, cp=1, dim=4096, vocab=151936, heads=64, kv_heads=4, head_dim=128, experts=128, top_k=8, moe_hidden=1536, ep=16, dropless=dict(batch=2, ep=16)),
    "deepseek_v3_671b_v7x": dict(gen="v7x", seq=4096, batch=4, cp=1, dim=7168, vocab=129280, heads=128, kv_heads=128, head_dim=192, v_head_dim=128, experts=256, top_k=8, moe_hidden=2048, ep=64, dropless=dict(batch=2, ep=4)),
    "kimi_k2_v7x": dict(gen="v7x", seq=4096, batch=4, cp=1, dim=7168, vocab=163840, heads=64, kv_heads=64, head_dim=192, v_head_dim=128, experts=384, top_k=8, moe_hidden=2048, ep=64, dropless=dict(batch=2, ep=4)),
}  # fmt: skip
"""The shipped TPU recipes' kernel shapes (FLUX uses none of these kernels). MLA (DeepSeek-V3,
Kimi K2): q/k heads 192 wide (128 + 64 rope), v 128, as many KV heads as query heads. MoE: the
recipes ship the capacity dispatch (`[moe] capacity_factor` 1.25), whose experts run batched
matmuls, not gmm; gmm serves the dropless dispatch (capacity_factor = 0), at the batch and ep
each recipe's header gives for it (`dropless`)."""


class UsageError(Exception):
    pass


def _powers(lo: int, hi: int) -> list[int]:
    out, t = [], lo
    while t <= hi:
        out.append(t)
        t *= 2
    return out


def recipe_shapes(kernel: str, gen: str) -> list[dict]:
    """The shape classes of `kernel` on `gen` from RECIPES: [{"class", "instances": [shape dicts,
    each with its "recipes"]}] (identical instances merged)."""
    classes: dict[str, dict] = {}

    def add(cls: str, shape: dict, recipe: str) -> None:
        entry = classes.setdefault(cls, {"class": cls, "instances": []})
        for inst in entry["instances"]:
            if {k: v for k, v in inst.items() if k != "recipes"} == shape:
                inst["recipes"].append(recipe)
                return
        entry["instances"].append({**shape, "recipes": [recipe]})

    for name, r in RECIPES.items():
        if r["gen"] != gen:
            continue
        tokens = r["batch"] * r["seq"] // r["cp"]
        if kernel == "fused_ce":
            add(f"d{r['dim']}", {"n": tokens, "vocab": r["vocab"], "dim": r["dim"]}, name)
        elif kernel == "gmm" and r.get("experts"):
            m, groups = r["dropless"]["batch"] * r["seq"] * r["top_k"], r["experts"] // r["dropless"]["ep"]
            for k, n in ((r["dim"], r["moe_hidden"]), (r["moe_hidden"], r["dim"])):
                add(f"{k}x{n}", {"m": m, "k": k, "n": n, "groups": groups}, name)
        elif kernel == "splash" and r["cp"] == 1:
            seq = -(-r["seq"] // 128) * 128
            shape = {
                "seq": seq,
                "group": r["heads"] // r["kv_heads"],
                "d": r["head_dim"],
                "dv": r.get("v_head_dim", r["head_dim"]),
            }
            add(f"s{seq}d{r['head_dim']}", shape, name)
    return list(classes.values())


def fixed_shapes(kernel: str, args) -> list[dict]:
    if kernel == "gmm":
        return [
            {
                "class": f"{k}x{n}",
                "instances": [{"m": args.gmm_rows, "k": k, "n": n, "groups": args.groups, "recipes": []}],
            }
            for k, n in GMM_SHAPES
        ]
    if kernel == "fused_ce":
        return [
            {"class": f"d{d}", "instances": [{"n": args.ce_rows, "vocab": args.vocab, "dim": d, "recipes": []}]}
            for d in CE_DIMS
        ]
    return [
        {"class": f"s{s}d{d}", "instances": [{"seq": s, "group": g, "d": d, "dv": dv, "recipes": []}]}
        for s, g, d, dv in SPLASH_SHAPES
    ]


def shapes(kernel: str, gen: str, args) -> list[dict]:
    if args.shapes == "recipes":
        found = recipe_shapes(kernel, gen)
        if found or not any(r["gen"] == gen for r in RECIPES.values()):
            return found or fixed_shapes(kernel, args)
        return []  # the generation's recipes do not use this kernel
    return fixed_shapes(kernel, args)


def gmm_candidates(gen: str, m: int, k: int, n: int, groups: int) -> tuple[list[tuple], list[tuple]]:
    """(kept, dropped) (tm, tk, tn) candidates for megablox at this shape on `gen`."""
    budget = tiles.BUDGET_FRACTION * tiles.hardware(gen).scoped_vmem_bytes
    tks = sorted({t for t in _powers(128, 2048) if k % t == 0} | ({k} if k <= 2048 else set()))
    tns = sorted({t for t in _powers(128, 2048) if n % t == 0} | ({n} if n <= 2048 else set()))
    kept, dropped = [], []
    for tm, tk, tn in itertools.product(_powers(128, min(1024, max(128, m))), tks, tns):
        (kept if tiles.gmm_vmem_bytes(tm, tk, tn) <= budget else dropped).append((tm, tk, tn))
    return kept, dropped


def ce_candidates(gen: str, n: int, vocab: int, dim: int) -> tuple[list[tuple], list[tuple]]:
    """(kept, dropped) (block_n, block_v) candidates for the fused loss at this shape on `gen`."""
    budget = tiles.BUDGET_FRACTION * tiles.ce_vmem_limit(gen)
    kept, dropped = [], []
    for bn, bv in itertools.product(_powers(128, min(1024, max(128, n))), _powers(128, min(2048, max(128, vocab)))):
        (kept if tiles.ce_vmem_bytes(bn, bv, dim) <= budget else dropped).append((bn, bv))
    return kept, dropped


def splash_candidates(seq: int) -> tuple[list[tuple], list[tuple]]:
    """(kept, []) (block_q, block_kv) candidates: powers of two 128..2048 dividing the sequence
    (no VMEM estimate: a block pair that does not fit fails its compile and is dropped)."""
    blocks = [b for b in _powers(128, 2048) if seq % b == 0]
    return list(itertools.product(blocks, blocks)), []


def model_rank(kernel: str, gen: str, inst: dict, cand: tuple) -> tuple:
    """Lower is better: gmm's roofline time, then the larger K tile (fewer grid steps); the
    loss' bytes per FLOP (1 / block_n), then the larger vocab block; splash: fewer grid steps
    (1 / block_q + 1 / block_kv), then the larger query block."""
    if kernel == "gmm":
        cost = tiles.gmm_cost(*cand, inst["m"], inst["k"], inst["groups"], tiles.hardware(gen).ridge)
        return (round(cost, 9), -cand[1])
    if kernel == "splash":
        return (1 / cand[0] + 1 / cand[1], -cand[0])
    return (1 / cand[0], -cand[1])


def current_pick(kernel: str, gen: str, inst: dict, table: dict | None = None) -> tuple:
    """What the kernels use at this shape today (the table as it is, and the rule)."""
    if kernel == "gmm":
        return tuple(tiles.gmm_tiles(gen, inst["m"], inst["k"], inst["n"], inst["groups"], table=table))
    if kernel == "fused_ce":
        return tuple(tiles.ce_blocks(gen, inst["n"], inst["vocab"], inst["dim"], table=table))
    return tuple(tiles.splash_blocks(gen, inst["seq"], inst["d"], table=table))


def candidates(kernel: str, gen: str, inst: dict) -> tuple[list[tuple], list[tuple]]:
    if kernel == "gmm":
        return gmm_candidates(gen, inst["m"], inst["k"], inst["n"], inst["groups"])
    if kernel == "fused_ce":
        return ce_candidates(gen, inst["n"], inst["vocab"], inst["dim"])
    return splash_candidates(inst["seq"])


def ordered_candidates(kernel: str, gen: str, cls: dict, limit: int) -> tuple[list[tuple], int, tuple]:
    """(candidates in the model's order with today's pick first, number dropped by the VMEM
    estimate, today's pick) for a shape class; candidates common to all its instances."""
    first = cls["instances"][0]
    kept, dropped = candidates(kernel, gen, first)
    for inst in cls["instances"][1:]:
        other = set(candidates(kernel, gen, inst)[0])
        kept = [c for c in kept if c in other]
    kept.sort(key=lambda c: model_rank(kernel, gen, first, c))
    before = current_pick(kernel, gen, first)
    heads = [before[:2], before[2:]] if kernel == "splash" else [before]
    kept = list(dict.fromkeys([*(h for h in heads if h in kept), *kept]))  # today's first, if a candidate
    if limit:
        kept = kept[:limit]
    return kept, len(dropped), before


def pick_by_cost(rows: list[dict], key: str = "cycles") -> list | None:
    """The tiles of the row with the lowest `key` among those that compiled (a row: {"tiles",
    "compiled", key}); ties keep the earlier row (the model's order). None if none compiled."""
    best = None
    for row in rows:
        if row.get("compiled") and row.get(key) is not None and (best is None or row[key] < best[key]):
            best = row
    return list(best["tiles"]) if best else None


def splash_pick(rows: list[dict]) -> list | None:
    """[block_q, block_kv, block_q_dkv, block_kv_dkv]: the forward pair with the lowest forward
    cost and the backward pair with the lowest backward cost (compiled apart, so independent)."""
    fwd = pick_by_cost([{**r, "compiled": r.get("fwd_compiled")} for r in rows], "fwd_cycles")
    bwd = pick_by_cost([{**r, "compiled": r.get("bwd_compiled")} for r in rows], "bwd_cycles")
    return [*fwd, *bwd] if fwd and bwd else None


# --- the compiled cost (libtpu's static LLO profile) ---------------------------------------------

PROFILE_FLAG = "--xla_jf_dump_static_llo_profile_to"


def enable_profile(folder: Path) -> None:
    """Ask libtpu (before it loads) to write each compiled op's estimated cycles into `folder`."""
    os.environ["LIBTPU_INIT_ARGS"] = f"{os.environ.get('LIBTPU_INIT_ARGS', '')} {PROFILE_FLAG}={folder}".strip()


def read_profile(folder: Path) -> dict[str, int]:
    """{op: estimated cycles x equivalent ops} of the programs compiled since the last call
    (the files are removed)."""
    out = {}
    for f in folder.glob("*.textproto"):
        text = f.read_text()
        for name, cycles, same in re.findall(
            r'hlo_op_name: "([^"]+)"\s+estimated_cycles: (\d+)(?:\s+num_equivalent_hlos: (\d+))?', text
        ):
            out[name] = out.get(name, 0) + int(cycles) * int(same or 1)
        f.unlink()
    return out


def parse_profile_text(text: str) -> dict[str, int]:
    """{op: cycles} of one profile file's text (tests)."""
    return {
        name: int(c) * int(same or 1)
        for name, c, same in re.findall(
            r'hlo_op_name: "([^"]+)"\s+estimated_cycles: (\d+)(?:\s+num_equivalent_hlos: (\d+))?', text
        )
    }


def balanced_active_tiles(m: int, tm: int, groups: int) -> int:
    """megablox's grid size along the rows (m-tiles visited, one per tile and group touching it)
    for `groups` equal groups of m / groups rows (the last takes the remainder)."""
    size = m // groups
    bounds = [i * size for i in range(groups)] + [m]
    return sum(-(-bounds[i + 1] // tm) - bounds[i] // tm for i in range(groups) if bounds[i + 1] > bounds[i])


@contextlib.contextmanager
def static_gmm_grid(m: int, groups: int):
    """While compiling: megablox's row-grid size (`num_tiles`, computed on the device from the
    group sizes) replaced by the balanced routing's count, so the grid is static and the static
    profile counts its steps. The kernel body and tiles are unchanged."""
    mod = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
    original = mod.make_group_metadata

    def fixed(*, group_sizes, m, tm, start_group, num_nonzero_groups, visit_empty_groups=True):
        meta, _ = original(
            group_sizes=group_sizes,
            m=m,
            tm=tm,
            start_group=start_group,
            num_nonzero_groups=num_nonzero_groups,
            visit_empty_groups=visit_empty_groups,
        )
        return meta, balanced_active_tiles(m, tm, groups)

    mod.make_group_metadata = fixed
    try:
        yield
    finally:
        mod.make_group_metadata = original


def gmm_scale(m: int, groups: int) -> int:
    """The factor f by which the compiled gmm shape is cut (m / f rows, groups / f groups: the
    same rows per group, so the same tile pattern per group, 1 / f of the grid steps; the cost
    is multiplied back by f): the largest power of two dividing `groups` that leaves at least
    4096 rows. The static profile walks the grid, and at 65536 rows a forward + backward took
    minutes per candidate on this host."""
    f = 1
    while groups % (2 * f) == 0 and m // (2 * f) >= 4096:
        f *= 2
    return f


CE_COMPILED_ROWS, CE_COMPILED_VOCAB = 2048, 8192


def compiled_instance(kernel: str, inst: dict, cand: tuple) -> tuple[dict, float]:
    """(the shape compiled for the cost, the factor its cycles are multiplied by): the static
    profile walks every grid step (minutes per candidate at the recipes' full shapes on this
    host), so each kernel is compiled at a cut of its shape with the same per-step work and the
    cost scaled by the ratio of grid steps:
    - gmm: m / f rows in groups / f groups (`gmm_scale`: same rows per group, so the same tile
      pattern per group), times f;
    - the loss: at most CE_COMPILED_ROWS rows and CE_COMPILED_VOCAB vocabulary (the same hidden
      size), times ceil(n / bn) ceil(V / bv) over the compiled shape's steps (padding counted);
    - splash: one query head per KV head (the heads are an outer grid axis), times the group."""
    if kernel == "gmm":
        f = gmm_scale(inst["m"], inst["groups"])
        return {**inst, "m": inst["m"] // f, "groups": inst["groups"] // f}, float(f)
    if kernel == "fused_ce":
        bn, bv = cand
        n, vocab = min(inst["n"], CE_COMPILED_ROWS), min(inst["vocab"], CE_COMPILED_VOCAB)
        steps = -(-inst["n"] // bn) * -(-inst["vocab"] // bv)
        return {**inst, "n": n, "vocab": vocab}, steps / (-(-n // bn) * -(-vocab // bv))
    return {**inst, "group": 1}, float(inst["group"])


def _device(gen: str):
    import jax
    from jax.experimental import topologies

    device = topologies.get_topology_desc(topology_name=tiles.GENERATIONS[gen].topology, platform="tpu").devices[0]
    return jax.sharding.SingleDeviceSharding(device)


def _programs(kernel: str, inst: dict, cand: tuple, gen: str) -> list[tuple]:
    """[(label, fn, ShapeDtypeStruct args)]: the candidate's programs, bf16 (gmm and the loss:
    forward + backward; splash: forward, backward from residuals)."""
    import fused_ce
    import gmm
    import jax
    import jax.numpy as jnp
    import splash

    s, bf16, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    if kernel == "gmm":
        m, k, n, g = inst["m"], inst["k"], inst["n"], inst["groups"]

        def fn(x, w, sizes, dy):
            out, vjp = jax.vjp(lambda x, w: gmm.grouped_mm(x, w, sizes, transpose_rhs=True, tiling=cand), x, w)
            return out, vjp(dy)

        return [("fwd+bwd", fn, [s((m, k), bf16), s((g, n, k), bf16), s((g,), jnp.int32), s((m, n), bf16)])]
    if kernel == "fused_ce":
        n, vocab, dim = inst["n"], inst["vocab"], inst["dim"]

        def loss_fn(h, w, labels):
            def loss(h, w):
                return fused_ce.linear_cross_entropy(h, w, labels, block_n=cand[0], block_v=cand[1], generation=gen)

            return jax.value_and_grad(loss, argnums=(0, 1))(h, w)

        return [("fwd+bwd", loss_fn, [s((n, dim), bf16), s((vocab, dim), bf16), s((n,), jnp.int32)])]
    seq, group, d, dv = inst["seq"], inst["group"], inst["d"], inst["dv"]
    blocks = (*cand[:2], *cand[:2])
    q, kv, vv = s((1, group, seq, d), bf16), s((1, 1, seq, d), bf16), s((1, 1, seq, dv), bf16)

    def fwd(q, k, v):
        return splash.forward(q, k, v, blocks=blocks)

    def bwd(q, k, v, out, lse, dout):
        return splash.backward(q, k, v, None, out, lse, dout, blocks=blocks)

    out, lse = s((1, group, seq, dv), bf16), s((1, group, seq), f32)
    return [("fwd", fwd, [q, kv, vv]), ("bwd", bwd, [q, kv, vv, out, lse, out])]


_COMPILED: dict = {}
"""(kernel, generation, compiled shape, tiles) -> {label: result}: instances that cut to the same
compiled shape are compiled once."""


def compile_cost(kernel: str, gen: str, inst: dict, cand: tuple, folder: Path) -> dict:
    """{label: {"compiled", "compile_s", "cycles", "top_ops", "error"}} per program of the
    candidate, compiled deviceless for `gen` at `compiled_instance`'s shape; cycles from the
    static profile (`enable_profile` must have run before jax loaded libtpu), scaled."""
    inst, scale = compiled_instance(kernel, inst, cand)
    key = (kernel, gen, json.dumps({k: v for k, v in inst.items() if k != "recipes"}, sort_keys=True), tuple(cand))
    if key not in _COMPILED:
        _COMPILED[key] = _compile_programs(kernel, gen, inst, cand, folder)
    out = {}
    for label, r in _COMPILED[key].items():
        out[label] = {**r, "cycles": r["cycles"] * scale if r.get("cycles") is not None else None, "scale": scale}
    return out


def _compile_programs(kernel: str, gen: str, inst: dict, cand: tuple, folder: Path) -> dict:
    import jax

    sharding = _device(gen)
    read_profile(folder)  # start clean
    out = {}
    for label, fn, avals in _programs(kernel, inst, cand, gen):
        placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in avals]
        start = time.perf_counter()
        try:
            if kernel == "gmm":
                with static_gmm_grid(inst["m"], inst["groups"]):
                    jax.jit(fn).lower(*placed).compile()
            else:
                jax.jit(fn).lower(*placed).compile()
        except Exception as e:  # a candidate that does not compile is dropped, with the reason
            read_profile(folder)
            out[label] = {
                "compiled": False,
                "compile_s": round(time.perf_counter() - start, 2),
                "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}",
            }
            continue
        ops = read_profile(folder)
        jax.clear_caches()  # the compiled programs are not run: keep the host memory flat
        top = sorted(ops.items(), key=lambda kv: -kv[1])[:3]
        out[label] = {
            "compiled": bool(ops),
            "compile_s": round(time.perf_counter() - start, 2),
            "cycles": sum(ops.values()) if ops else None,
            "top_ops": dict(top),
            "error": "" if ops else f"no static profile in {folder} (was {PROFILE_FLAG} set before jax loaded?)",
        }
    return out


def libtpu_version() -> str:
    try:
        from importlib import metadata

        return metadata.version("libtpu")
    except Exception:  # not installed under that name
        return "unknown"


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:  # not a checkout
        return "unknown"


def time_candidate(kernel: str, gen: str, inst: dict, cand: tuple, repeats: int) -> dict:
    """{label: median seconds} of the candidate's programs on the local TPU."""
    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    out = {}
    for label, fn, avals in _programs(kernel, inst, cand, gen):
        args = []
        for a in avals:
            if a.dtype == np.int32 and kernel == "gmm":  # group sizes: equal groups summing to m
                g = a.shape[0]
                sizes = np.full(g, inst["m"] // g, np.int32)
                sizes[-1] += inst["m"] - sizes.sum()
                args.append(jax.numpy.asarray(sizes))
            elif a.dtype == np.int32:
                args.append(jax.numpy.asarray(rng.integers(0, inst["vocab"], a.shape), dtype=a.dtype))
            else:
                args.append(jax.numpy.asarray(rng.standard_normal(a.shape) * 0.1, dtype=a.dtype))
        step = jax.jit(fn)
        jax.block_until_ready(step(*args))  # compile + warm up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(step(*args))
            times.append(time.perf_counter() - start)
        out[label] = statistics.median(times)
    return out


HEADER = [
    "# Block sizes of the Pallas kernels per TPU generation (read by titan_kernels/tpu/tiles.py; the rule",
    "# for shapes not listed is in its docstring). Written by scripts/bench/sweep_kernel_tiles.py;",
    "# `source` says where each generation's entries came from.",
    '# gmm: shape class "KxN" -> [tm, tk, tn]; fused_ce: "d<dim>" -> [block_n, block_v];',
    '# splash: "s<seq>d<head_dim>" -> [block_q, block_kv, block_q_dkv, block_kv_dkv].',
]


def render_table(table: dict) -> str:
    lines = [*HEADER, "", "[source]"]
    lines += [f"{gen} = {json.dumps(text)}" for gen, text in table["source"].items()]
    for kernel in KERNELS:
        for gen, entries in table.get(kernel, {}).items():
            lines += ["", f"[{kernel}.{gen}]"]
            ordered = ["default", *sorted(c for c in entries if c != "default")]
            lines += [f"{json.dumps(c) if c != 'default' else c} = {json.dumps(list(entries[c]))}" for c in ordered]
    return "\n".join(lines) + "\n"


def write_table(path: Path, picks: dict, sources: dict) -> None:
    """Merge {kernel: {gen: {class: tiles}}} into the table at `path` (tiles.toml's format;
    a kernel new to the table gets the unknown generation's default for each generation)."""
    table = {}
    if path.exists():
        with open(path, "rb") as f:
            table = tomllib.load(f)
    if not table:
        with open(tiles.TABLE, "rb") as f:
            table = tomllib.load(f)
    for kernel, per_gen in picks.items():
        for gen, entries in per_gen.items():
            table.setdefault(kernel, {}).setdefault(gen, {"default": [512] * 4} if kernel == "splash" else {})
            table[kernel][gen].update(entries)
    if "splash" in table:
        table["splash"].setdefault("unknown", {"default": [512] * 4})
    for gen, text in sources.items():
        old = table.setdefault("source", {}).get(gen, "")
        kept = [part for part in old.split("; ") if part and not part.startswith(text.split(":")[0])]
        table["source"][gen] = "; ".join([*kept, text])
    tiles.check_table(table)
    path.write_text(render_table(table))
    tiles.load_table.cache_clear()
    tiles.load_table(str(path))  # reads back


def parse(argv: list[str]):
    p = cli.ArgumentParser(description=__doc__.split("\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("list", "compile", "time"), default="list")
    p.add_argument(
        "--generation",
        action="append",
        help=f"one of {', '.join(tiles.GENERATIONS)} (repeatable; "
        "default: all for list/compile, the local TPU for time)",
    )
    p.add_argument("--kernel", action="append", help=f"one of {', '.join(KERNELS)} (repeatable; default all)")
    p.add_argument("--shapes", choices=("recipes", "fixed"), default="recipes")
    p.add_argument("--gmm-rows", type=int, default=65536)
    p.add_argument("--groups", type=int, default=128)
    p.add_argument("--ce-rows", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--shape-class", action="append", help="only these shape classes (e.g. 2048x768, d4096, s8192d128)")
    p.add_argument(
        "--max-candidates", type=int, default=0, help="keep the first N (today's pick, then the model's order; 0: all)"
    )
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", help="merge the picks into this table file")
    p.add_argument("--json", action="store_true", help="print the results as one JSON line")
    args = p.parse_args(argv)
    for gen in args.generation or []:
        if gen not in tiles.GENERATIONS:
            raise UsageError(f"--generation: {gen!r} is not known; allowed: {', '.join(tiles.GENERATIONS)}")
    for kernel in args.kernel or []:
        if kernel not in KERNELS:
            raise UsageError(f"--kernel: {kernel!r} is not known; allowed: {', '.join(KERNELS)}")
    for name in ("gmm_rows", "groups", "ce_rows", "vocab", "repeats"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}: {getattr(args, name)} must be >= 1")
    if args.max_candidates < 0:
        raise UsageError("--max-candidates: must be >= 0")
    if args.out and not Path(args.out).parent.is_dir():
        raise UsageError(f"--out: folder {Path(args.out).parent} does not exist")
    return args


def measure(kernel: str, gen: str, cls: dict, cand: tuple, args, folder: Path | None) -> dict:
    """One candidate's row: its cost summed over the class's instances (compile or time mode)."""
    row = {"tiles": list(cand)}
    if args.mode == "list":
        row["model"] = model_rank(kernel, gen, cls["instances"][0], cand)[0]
        return row
    per_label: dict[str, dict] = {}
    for inst in cls["instances"]:
        if args.mode == "compile":
            got = compile_cost(kernel, gen, inst, cand, folder)
        else:
            got = {}
            for label, secs in time_candidate(kernel, gen, inst, cand, args.repeats).items():
                got[label] = {"compiled": True, "cycles": secs}
        for label, r in got.items():
            acc = per_label.setdefault(label, {"compiled": True, "cycles": 0, "compile_s": 0.0, "error": ""})
            acc["compiled"] = acc["compiled"] and r["compiled"]
            acc["cycles"] = acc["cycles"] + r["cycles"] if acc["compiled"] else None
            acc["compile_s"] = round(acc["compile_s"] + r.get("compile_s", 0.0), 2)
            acc["error"] = acc["error"] or r.get("error", "")
            acc.setdefault("top_ops", r.get("top_ops"))
    unit = "cycles" if args.mode == "compile" else "seconds"
    if kernel == "splash":
        for label in ("fwd", "bwd"):
            r = per_label.get(label, {"compiled": False})
            row[f"{label}_compiled"], row[f"{label}_cycles"] = r["compiled"], r.get("cycles")
            row[f"{label}_error"] = r.get("error", "")
        row["compiled"] = row["fwd_compiled"] or row["bwd_compiled"]
    else:
        (r,) = per_label.values()
        row.update(compiled=r["compiled"], cycles=r["cycles"], error=r["error"], top_ops=r.get("top_ops"))
    row["unit"] = unit
    row["compile_s"] = round(sum(r.get("compile_s", 0.0) for r in per_label.values()), 2)
    return row


def cost_of(kernel: str, rows: list[dict], tiles_: list | None) -> float | None:
    """The cost of `tiles_` in `rows` (splash: forward pair's forward + backward pair's backward)."""
    if tiles_ is None:
        return None
    if kernel != "splash":
        return next((r["cycles"] for r in rows if r["tiles"] == list(tiles_) and r.get("compiled")), None)
    fwd = next((r["fwd_cycles"] for r in rows if r["tiles"] == list(tiles_[:2]) and r.get("fwd_compiled")), None)
    bwd = next((r["bwd_cycles"] for r in rows if r["tiles"] == list(tiles_[2:]) and r.get("bwd_compiled")), None)
    return fwd + bwd if fwd is not None and bwd is not None else None


def _generations(args) -> list[str] | None:
    """The generations to sweep: `--mode time` the local TPU's (None, with one error line, off a
    TPU of a known generation), else `--generation` or all."""
    if args.mode != "time":
        return args.generation or list(tiles.GENERATIONS)
    import jax

    kind = jax.devices()[0].device_kind
    gen = tiles.generation_of(kind)
    if jax.devices()[0].platform != "tpu" or gen is None:
        cli.error_line(
            f"--mode time: needs a TPU of a known generation; this host's device is {kind!r} "
            "(use --mode compile without one)"
        )
        return None
    return [gen]


def _pick(kernel: str, gen: str, cls: dict, rows: list[dict], mode: str):
    """The chosen tiles among the measured rows: the rule's model pick in `list` mode, else the lowest cost."""
    if mode != "list":
        return splash_pick(rows) if kernel == "splash" else pick_by_cost(rows)
    order = sorted(rows, key=lambda r: model_rank(kernel, gen, cls["instances"][0], tuple(r["tiles"])))
    pick = order[0]["tiles"] if order else None
    if pick and kernel == "splash":
        pick = pick * 2
    return pick


def _sweep_class(kernel: str, gen: str, cls: dict, args, folder: Path | None) -> dict:
    """Measure one shape class's candidates and pick; its result record (one summary line on stderr)."""
    kept, n_dropped, before = ordered_candidates(kernel, gen, cls, args.max_candidates)
    rows = []
    for c in kept:
        rows.append(measure(kernel, gen, cls, c, args, folder))
        if args.mode != "list":
            cost = rows[-1].get("cycles", rows[-1].get("fwd_cycles"))
            print(f"  {kernel} {gen} {cls['class']} {list(c)}: {cost}", file=sys.stderr, flush=True)
    pick = _pick(kernel, gen, cls, rows, args.mode)
    cost_before, cost_after = cost_of(kernel, rows, list(before)), cost_of(kernel, rows, pick)
    ratio = f", cost {cost_after / cost_before:.3f} of today's" if cost_before and cost_after else ""
    print(
        f"{kernel} {gen} {cls['class']}: {len(kept)} candidates, {n_dropped} over the VMEM budget, "
        f"today {list(before)}, pick {pick}{ratio}",
        file=sys.stderr,
        flush=True,
    )
    return {
        "kernel": kernel,
        "generation": gen,
        "class": cls["class"],
        "instances": cls["instances"],
        "kept": len(kept),
        "dropped_by_vmem": n_dropped,
        "before": list(before),
        "pick": pick,
        "cost_before": cost_before,
        "cost_pick": cost_after,
        "candidates": rows,
    }


def _sources(gens: list[str], picks: dict, mode: str) -> dict[str, str]:
    """Each swept generation's source line for the table: mode, kernels, how picked, date and commit."""
    stamp = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}, commit {git_commit()}"
    how = {
        "list": "the rule's model pick (not compiled, not timed)",
        "compile": f"lowest compiled cost (libtpu {libtpu_version() if mode == 'compile' else ''} static LLO "
        "profile, estimated cycles of forward + backward at the recipes' shapes; not timed)",
        "time": "timed on this TPU, fastest median",
    }[mode]
    sources = {}
    for gen in gens:
        done = sorted(k for k in picks if gen in picks[k])
        if done:
            sources[gen] = f"sweep_kernel_tiles.py --mode {mode} ({', '.join(done)}): {how}, {stamp}"
    return sources


def main(argv: list[str]) -> int:
    try:
        args = parse(argv)
    except UsageError as e:
        cli.error_line(str(e))
        return cli.BAD_INPUT_EXIT_CODE
    folder = None
    if args.mode == "compile":
        folder = Path(tempfile.mkdtemp(prefix="titan-tiles-profile-"))
        enable_profile(folder)  # before jax loads libtpu
    gens = _generations(args)
    if gens is None:
        return cli.BAD_INPUT_EXIT_CODE
    results, picks = [], {}
    for kernel in args.kernel or list(KERNELS):
        for gen in gens:
            for cls in shapes(kernel, gen, args):
                if args.shape_class and cls["class"] not in args.shape_class:
                    continue
                results.append(_sweep_class(kernel, gen, cls, args, folder))
                if results[-1]["pick"]:
                    picks.setdefault(kernel, {}).setdefault(gen, {})[cls["class"]] = results[-1]["pick"]
    sources = _sources(gens, picks, args.mode)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
    if args.out:
        write_table(Path(args.out), picks, sources)
    if args.json:
        print(json.dumps({"mode": args.mode, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, sys.argv[1:]))
