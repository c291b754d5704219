#!/usr/bin/env python
"""Sweep the Pallas kernels' tiles per TPU generation and write the table they read.

    python scripts/bench/sweep_kernel_tiles.py --mode list    [--generation GEN ...] [--kernel gmm|fused_ce ...]
    python scripts/bench/sweep_kernel_tiles.py --mode compile [--generation GEN ...] [--out FILE]   (no TPU)
    python scripts/bench/sweep_kernel_tiles.py --mode time    [--out FILE]                         (on a TPU VM)

For each kernel, generation and shape (the recipes' by default: the MoE experts' K x N at
`--gmm-rows` token copies and `--groups` experts; the loss heads' hidden sizes at `--ce-rows`
rows and `--vocab`), the candidates are every combination of power-of-two tiles from 128 up
(gmm: tm to 1024, tk/tn to 2048; loss: block_n to 1024, block_v to 2048) that the kernel
accepts (tk, tn whole dimensions or dividing them) and whose working-set estimate fits the
generation's VMEM budget (titan_kernels/tpu/tiles.py: the same estimate and budget the kernels use).
- `list`: print the candidates and what the filter dropped; with `--out`, write the rule's
  pick (the roofline model for gmm, the largest row block for the loss) as the table. Pure
  Python (no jax): runs anywhere.
- `compile`: compile each candidate's forward + backward deviceless for the generation's
  compile-only topology with the installed libtpu; a candidate that does not compile (scoped
  VMEM) is dropped; the pick among those that compile is the rule's. The dry run of `time`.
- `time`: on a TPU (the generation is the local one), run each candidate's forward + backward
  `--repeats` times and keep the fastest median; record the times beside the table.
`--out` (default: print only) merges the picks into a table file in tiles.toml's format,
keeping entries for other generations and shapes, and records each generation's source.
`--max-candidates N` keeps the N best by the model (a quick sweep). Bad arguments: one `error:`
line, exit 2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
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

KERNELS = ("gmm", "fused_ce")
GMM_SHAPES = ((2048, 768), (768, 2048), (4096, 1536), (1536, 4096))
"""K x N of Qwen3-30B-A3B's and Qwen3-235B-A22B's expert projections (gate/up, down)."""
CE_DIMS = (4096, 5120, 8192)
"""Hidden sizes of the recipes' loss heads (Llama 3 8B, Qwen 3 32B, Llama 3 70B)."""


class UsageError(Exception):
    pass


def _powers(lo: int, hi: int) -> list[int]:
    out, t = [], lo
    while t <= hi:
        out.append(t)
        t *= 2
    return out


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


def model_rank(kernel: str, gen: str, shape: dict, cand: tuple) -> tuple:
    """Lower is better: gmm's roofline time, then the larger K tile (fewer grid steps); the
    loss' bytes per FLOP (1 / block_n), then the larger vocab block."""
    if kernel == "gmm":
        cost = tiles.gmm_cost(*cand, shape["m"], shape["k"], shape["groups"], tiles.hardware(gen).ridge)
        return (round(cost, 9), -cand[1])
    return (1 / cand[0], -cand[1])


def shapes(kernel: str, args) -> list[dict]:
    if kernel == "gmm":
        return [{"m": args.gmm_rows, "k": k, "n": n, "groups": args.groups, "class": f"{k}x{n}"} for k, n in GMM_SHAPES]
    return [{"n": args.ce_rows, "vocab": args.vocab, "dim": d, "class": f"d{d}"} for d in CE_DIMS]


def candidates(kernel: str, gen: str, shape: dict) -> tuple[list[tuple], list[tuple]]:
    if kernel == "gmm":
        return gmm_candidates(gen, shape["m"], shape["k"], shape["n"], shape["groups"])
    return ce_candidates(gen, shape["n"], shape["vocab"], shape["dim"])


def _jax_step(kernel: str, shape: dict, cand: tuple, gen: str):
    """(fn, ShapeDtypeStruct args) of the candidate's forward + backward, bf16."""
    import fused_ce
    import gmm
    import jax
    import jax.numpy as jnp

    s, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    if kernel == "gmm":
        m, k, n, g = shape["m"], shape["k"], shape["n"], shape["groups"]

        def fn(x, w, sizes, dy):
            out, vjp = jax.vjp(lambda x, w: gmm.grouped_mm(x, w, sizes, transpose_rhs=True, tiling=cand), x, w)
            return out, vjp(dy)

        return fn, [s((m, k), bf16), s((g, n, k), bf16), s((g,), jnp.int32), s((m, n), bf16)]
    n, vocab, dim = shape["n"], shape["vocab"], shape["dim"]

    def fn(h, w, labels):
        loss = lambda h, w: fused_ce.linear_cross_entropy(
            h,
            w,
            labels,
            block_n=cand[0],
            block_v=cand[1],  # noqa: E731
            generation=gen,
        )
        return jax.value_and_grad(loss, argnums=(0, 1))(h, w)

    return fn, [s((n, dim), bf16), s((vocab, dim), bf16), s((n,), jnp.int32)]


def compile_ok(kernel: str, gen: str, shape: dict, cand: tuple) -> tuple[bool, float, str]:
    import jax
    from jax.experimental import topologies

    device = topologies.get_topology_desc(topology_name=tiles.GENERATIONS[gen].topology, platform="tpu").devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    fn, avals = _jax_step(kernel, shape, cand, gen)
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in avals]
    start = time.perf_counter()
    try:
        jax.jit(fn).lower(*placed).compile()
        return True, time.perf_counter() - start, ""
    except Exception as e:  # a candidate that does not compile is dropped, with the reason
        return False, time.perf_counter() - start, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def time_candidate(kernel: str, gen: str, shape: dict, cand: tuple, repeats: int) -> float:
    """Median seconds of one forward + backward on the local TPU."""
    import jax
    import numpy as np

    fn, avals = _jax_step(kernel, shape, cand, gen)
    rng = np.random.default_rng(0)
    args = []
    for a in avals:
        if a.dtype == np.int32 and kernel == "gmm":  # group sizes: equal groups summing to m
            g = a.shape[0]
            sizes = np.full(g, shape["m"] // g, np.int32)
            sizes[-1] += shape["m"] - sizes.sum()
            args.append(jax.numpy.asarray(sizes))
        elif a.dtype == np.int32:
            args.append(jax.numpy.asarray(rng.integers(0, shape["vocab"], a.shape), dtype=a.dtype))
        else:
            args.append(jax.numpy.asarray(rng.standard_normal(a.shape) * 0.1, dtype=a.dtype))
    step = jax.jit(fn)
    jax.block_until_ready(step(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def write_table(path: Path, picks: dict, sources: dict) -> None:
    """Merge {kernel: {gen: {class: tiles}}} into the table at `path` (tiles.toml's format)."""
    table = {}
    if path.exists():
        with open(path, "rb") as f:
            table = tomllib.load(f)
    if not table:
        with open(tiles.TABLE, "rb") as f:
            table = tomllib.load(f)
    for kernel, per_gen in picks.items():
        for gen, entries in per_gen.items():
            table.setdefault(kernel, {}).setdefault(gen, {}).update(entries)
    table.setdefault("source", {}).update(sources)
    tiles.check_table(table)
    lines = [
        "# Block sizes of the Pallas kernels per TPU generation (read by titan_kernels/tpu/tiles.py; the rule",
        "# for shapes not listed is in its docstring). Written by scripts/bench/sweep_kernel_tiles.py.",
        '# gmm: shape class "KxN" -> [tm, tk, tn]; fused_ce: "d<dim>" -> [block_n, block_v].',
        "",
        "[source]",
    ]
    lines += [f"{gen} = {json.dumps(text)}" for gen, text in table["source"].items()]
    for kernel in KERNELS:
        for gen, entries in table.get(kernel, {}).items():
            lines += ["", f"[{kernel}.{gen}]"]
            ordered = ["default", *sorted(c for c in entries if c != "default")]
            lines += [f"{json.dumps(c) if c != 'default' else c} = {json.dumps(list(entries[c]))}" for c in ordered]
    path.write_text("\n".join(lines) + "\n")
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
    p.add_argument("--kernel", action="append", help="gmm or fused_ce (repeatable; default both)")
    p.add_argument("--gmm-rows", type=int, default=65536)
    p.add_argument("--groups", type=int, default=128)
    p.add_argument("--ce-rows", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--shape-class", action="append", help="only these shape classes (e.g. 2048x768, d4096)")
    p.add_argument("--max-candidates", type=int, default=0, help="keep the N best by the model (0: all)")
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


def main(argv: list[str]) -> int:
    try:
        args = parse(argv)
    except UsageError as e:
        cli.error_line(str(e))
        return cli.BAD_INPUT_EXIT_CODE
    if args.mode == "time":
        import jax

        kind = jax.devices()[0].device_kind
        gen = tiles.generation_of(kind)
        if jax.devices()[0].platform != "tpu" or gen is None:
            cli.error_line(
                f"--mode time: needs a TPU of a known generation; this host's device is {kind!r} "
                "(use --mode compile without one)"
            )
            return cli.BAD_INPUT_EXIT_CODE
        gens = [gen]
    else:
        gens = args.generation or list(tiles.GENERATIONS)
    kernels = args.kernel or list(KERNELS)
    results, picks, sources = [], {}, {}
    for kernel in kernels:
        for gen in gens:
            for shape in shapes(kernel, args):
                if args.shape_class and shape["class"] not in args.shape_class:
                    continue
                kept, dropped = candidates(kernel, gen, shape)
                kept.sort(key=lambda c: model_rank(kernel, gen, shape, c))
                if args.max_candidates:
                    kept = kept[: args.max_candidates]
                rows = [{"tiles": list(c), "model": model_rank(kernel, gen, shape, c)[0]} for c in kept]
                if args.mode == "compile":
                    for row in rows:
                        row["compiled"], row["compile_s"], row["error"] = compile_ok(
                            kernel, gen, shape, tuple(row["tiles"])
                        )
                        row["compile_s"] = round(row["compile_s"], 2)
                    usable = [r for r in rows if r["compiled"]]
                elif args.mode == "time":
                    for row in rows:
                        try:
                            row["seconds"] = time_candidate(kernel, gen, shape, tuple(row["tiles"]), args.repeats)
                        except Exception as e:  # does not compile or run: dropped
                            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    usable = sorted((r for r in rows if "seconds" in r), key=lambda r: r["seconds"])
                else:
                    usable = rows
                pick = usable[0]["tiles"] if usable else None
                if pick:
                    picks.setdefault(kernel, {}).setdefault(gen, {})[shape["class"]] = pick
                results.append(
                    {
                        "kernel": kernel,
                        "generation": gen,
                        "shape": shape,
                        "kept": len(kept),
                        "dropped_by_vmem": len(dropped),
                        "pick": pick,
                        "candidates": rows,
                    }
                )
                print(
                    f"{kernel} {gen} {shape['class']}: {len(kept)} candidates, {len(dropped)} over the VMEM budget, "
                    f"pick {pick}",
                    file=sys.stderr,
                    flush=True,
                )
        for gen in gens:
            how = {
                "list": "the rule's model pick (not compiled, not timed)",
                "compile": "compiled deviceless, the model's pick among those that compile (not timed)",
                "time": "timed on this TPU, fastest median",
            }[args.mode]
            sources[gen] = f"sweep_kernel_tiles.py --mode {args.mode}: {how}"
    if args.out:
        write_table(Path(args.out), picks, sources)
    if args.json:
        print(json.dumps({"mode": args.mode, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, sys.argv[1:]))
