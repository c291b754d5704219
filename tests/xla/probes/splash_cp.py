"""Probe: splash attention for context parallelism (titan_kernels/tpu/splash.py `splash_cp_attention`).

    python splash_cp.py interpret                       # xla venv: Pallas interpreter vs the dense reference
    python splash_cp.py [--csv FILE] compile CASE...    # ttpu venv (libtpu 0.0.52): deviceless XLA:TPU compiles

`interpret`: for cp 2 and 4, every rank, with and without document segment ids, float32: the
rank's output and the VJP (dq, and dk / dv of the gathered keys) of the interpreted kernels
against the dense reference (`cp_reference`) evaluated in float64 (the "exact" value); also the
ranks' outputs, put back in global order, against the single-device causal attention
(`splash.reference`). Prints {"cases": [{"case", "n", "d", "outputs": {name: {"err", "scale"}}}],
"global": {case: {"err", "scale"}}}.

`compile`: one attention sublayer of a 128k recipe at its per-device shapes, forward and
backward, in a `shard_map` over a `cp` mesh axis of a compile-only TPU topology
(`jax.experimental.topologies`, this venv's libtpu): x [b, s/cp, dim] -> q, k, v projections (the
weights as SimpleFSDP gathers them, bf16) -> k, v all-gathered over cp (`lax.all_gather`, put in
global order) -> `splash_cp_attention` (Mosaic; each rank's own two kernels, picked by
`lax.axis_index` through `lax.switch`) -> output projection; `jax.grad` of a weighted sum, so the
backward holds the splash backward kernels and the all-gather's transpose (a reduce-scatter).
CASE is name:topology:cp:seq:dim:heads:kv_heads:head_dim (e.g.
llama3_8b_128k_v6e:v6e:2x2:4:131072:4096:32:8:128 -- the topology is gen:shape). Prints per case the
compiler's memory analysis per device (arguments, outputs, temporaries, bytes), the compile
seconds and the counts of all-gather, reduce-scatter and Mosaic (`tpu_custom_call`) ops in the
compiled HLO (or the lowered StableHLO where the compiled text cannot be printed).
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only libtpu next to other probes

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "titan_kernels" / "tpu"))
import splash  # noqa: E402

RNG = np.random.default_rng(0)
DUMP = os.environ.get("SPLASH_CP_DUMP")
"""A folder to write each compiled program's HLO text to (compile mode)."""


def _normal(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _shard(x: np.ndarray, dim: int, rank: int, cp: int) -> np.ndarray:
    chunks = np.split(x, 2 * cp, axis=dim)
    return np.concatenate([chunks[rank], chunks[2 * cp - 1 - rank]], axis=dim)


def interpret() -> dict:
    jax.config.update("jax_enable_x64", True)
    cases, global_check = [], {}
    b, hq, hkv, d = 1, 4, 2, 128
    for cp, seq in ((2, 512), (4, 1024)):
        for segmented in (False, True):
            q_full, k_full, v_full = _normal(b, hq, seq, d), _normal(b, hkv, seq, d), _normal(b, hkv, seq, d)
            seg_full = None
            if segmented:  # three documents, boundaries off the chunk and block edges
                seg_full = np.zeros((b, seq), np.int32)
                seg_full[:, seq // 3 :] = 1
                seg_full[:, (3 * seq) // 4 + 5 :] = 2
            outs = []
            for rank in range(cp):
                q = _shard(q_full, 2, rank, cp)
                seg = None if seg_full is None else _shard(seg_full, 1, rank, cp)
                cot = _normal(*q.shape)
                fn = functools.partial(splash.splash_cp_attention, cp_rank=rank, cp_size=cp, interpret=True)
                ref = functools.partial(splash.cp_reference, cp_rank=rank, cp_size=cp)
                args32 = [jnp.asarray(q), jnp.asarray(k_full), jnp.asarray(v_full)]
                t0 = time.perf_counter()
                out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg, seg_full), *args32)
                grads = vjp(jnp.asarray(cot))
                seconds = time.perf_counter() - t0
                args64 = [jnp.asarray(x, jnp.float64) for x in (q, k_full, v_full)]
                ex_out, ex_vjp = jax.vjp(lambda q, k, v: ref(q, k, v, seg, seg_full), *args64)
                ex_grads = ex_vjp(jnp.asarray(cot, jnp.float64))
                result = {}
                for name, got, exact in zip(("out", "dq", "dk", "dv"), (out, *grads), (ex_out, *ex_grads)):
                    got, exact = np.asarray(got, np.float64), np.asarray(exact, np.float64)
                    result[name] = {"err": float(np.abs(got - exact).max()), "scale": float(np.abs(exact).max())}
                name = f"cp{cp}_s{seq}_rank{rank}{'_segments' if segmented else ''}"
                cases.append({"case": name, "n": seq, "d": d, "outputs": result, "seconds": round(seconds, 2)})
                print(f"{name}: {json.dumps(result)} {seconds:.1f} s", file=sys.stderr, flush=True)
                outs.append(np.asarray(out, np.float64))
            # The ranks' rows, back in global order, are the single-device causal attention.
            gathered = np.concatenate(
                [o[:, :, : seq // (2 * cp)] for o in outs] + [o[:, :, seq // (2 * cp) :] for o in outs[::-1]], axis=2
            )
            whole = np.asarray(
                splash.reference(
                    *(jnp.asarray(x, jnp.float64) for x in (q_full, k_full, v_full)),
                    None if seg_full is None else jnp.asarray(seg_full),
                )
            )
            global_check[f"cp{cp}_s{seq}{'_segments' if segmented else ''}"] = {
                "err": float(np.abs(gathered - whole).max()),
                "scale": float(np.abs(whole).max()),
            }
    return {"jax": jax.__version__, "cases": cases, "global": global_check}


def _rank_major_to_global(x, cp: int, axis: int):
    """[.., cp * s_local, ..] gathered rank-major -> global order (context_parallel.py's reorder)."""
    x = jnp.moveaxis(x, axis, 0)
    total = x.shape[0]
    chunk = total // (2 * cp)
    blocks = x.reshape(cp, 2, chunk, *x.shape[1:])
    out = jnp.concatenate([blocks[:, 0], blocks[:, 1][::-1]]).reshape(total, *x.shape[1:])
    return jnp.moveaxis(out, 0, axis)


def attention_sublayer(cp: int, heads: int, kv_heads: int, head_dim: int):
    """The per-device function inside shard_map (see the module docstring)."""

    def layer(x, wq, wk, wv, wo):
        b, s_local, _ = x.shape
        q = (x @ wq).reshape(b, s_local, heads, head_dim).transpose(0, 2, 1, 3)
        k = (x @ wk).reshape(b, s_local, kv_heads, head_dim).transpose(0, 2, 1, 3)
        v = (x @ wv).reshape(b, s_local, kv_heads, head_dim).transpose(0, 2, 1, 3)
        k_all = _rank_major_to_global(jax.lax.all_gather(k, "cp", axis=2, tiled=True), cp, 2)
        v_all = _rank_major_to_global(jax.lax.all_gather(v, "cp", axis=2, tiled=True), cp, 2)
        branches = [functools.partial(splash.splash_cp_attention, cp_rank=r, cp_size=cp) for r in range(cp)]
        out = jax.lax.switch(jax.lax.axis_index("cp"), branches, q, k_all, v_all)
        return out.transpose(0, 2, 1, 3).reshape(b, s_local, heads * head_dim) @ wo

    return layer


def compile_case(spec: str) -> dict:
    from jax.experimental import topologies
    from jax.experimental.shard_map import shard_map
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    name, gen, shape, cp, seq, dim, heads, kv_heads, head_dim = spec.split(":")
    cp, seq, dim, heads, kv_heads, head_dim = map(int, (cp, seq, dim, heads, kv_heads, head_dim))
    devices = topologies.get_topology_desc(topology_name=f"{gen}:{shape}", platform="tpu").devices
    mesh = Mesh(np.array(devices[:cp]), ("cp",))
    layer = attention_sublayer(cp, heads, kv_heads, head_dim)
    specs = (P(None, "cp", None), P(), P(), P(), P())
    sharded = shard_map(layer, mesh=mesh, in_specs=specs, out_specs=P(None, "cp", None), check_rep=False)

    def step(x, wq, wk, wv, wo, cot):
        def loss(x, wq, wk, wv, wo):
            return jnp.sum((sharded(x, wq, wk, wv, wo) * cot).astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(x, wq, wk, wv, wo)

    bf16 = jnp.bfloat16
    S = jax.ShapeDtypeStruct
    seq_sharding = NamedSharding(mesh, P(None, "cp", None))
    rep = NamedSharding(mesh, P())
    avals = [
        S((1, seq, dim), bf16, sharding=seq_sharding),
        S((dim, heads * head_dim), bf16, sharding=rep),
        S((dim, kv_heads * head_dim), bf16, sharding=rep),
        S((dim, kv_heads * head_dim), bf16, sharding=rep),
        S((heads * head_dim, dim), bf16, sharding=rep),
        S((1, seq, dim), bf16, sharding=seq_sharding),
    ]
    entry = {
        "case": name,
        "topology": f"{gen}:{shape}",
        "device_kind": devices[0].device_kind,
        "cp": cp,
        "seq": seq,
        "tokens_per_device": seq // cp,
    }
    t0 = time.perf_counter()
    lowered = jax.jit(step).lower(*avals)
    entry["lower_s"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    compiled = lowered.compile()
    entry["compile_s"] = round(time.perf_counter() - t0, 1)
    mem = compiled.memory_analysis()
    for field in (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "temp_size_in_bytes",
        "alias_size_in_bytes",
        "generated_code_size_in_bytes",
    ):
        entry[field] = int(getattr(mem, field, 0) or 0)
    lowered_text = lowered.as_text()
    # What the program asks for (StableHLO), then what the compiler made of it (its HLO: the
    # all-gather's transpose may be scheduled as a reduce-scatter or an all-reduce + slice).
    entry["stablehlo_all_gather"] = len(re.findall(r"stablehlo\.all_gather", lowered_text))
    entry["stablehlo_reduce_scatter"] = len(re.findall(r"stablehlo\.reduce_scatter", lowered_text))
    try:
        text, entry["counted_in"] = compiled.as_text(), "compiled HLO"
    except Exception as e:  # jaxlib 0.10.2 cannot always print what libtpu compiled (kernels_compile.py)
        text, entry["counted_in"] = lowered_text, f"lowered StableHLO ({type(e).__name__})"
    for op in ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all"):
        entry[op.replace("-", "_")] = len(re.findall(rf"\s{op}(?:-start)?\(", text))
    entry["mosaic_calls"] = len(re.findall(r"tpu_custom_call", text))
    if DUMP:
        Path(DUMP).mkdir(parents=True, exist_ok=True)
        (Path(DUMP) / f"{name}.hlo.txt").write_text(text)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    entry["xla_flops"] = float((cost or {}).get("flops", 0.0))
    return entry


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("interpret", "compile"))
    parser.add_argument("--csv")
    parser.add_argument("cases", nargs="*")
    args = parser.parse_args()
    if args.mode == "interpret":
        print(json.dumps(interpret()))
        return
    rows = []
    for spec in args.cases:
        try:
            row = compile_case(spec)
        except Exception as e:  # report; the test asserts
            row = {"case": spec.split(":")[0], "error": f"{type(e).__name__}: {e}"[:3000]}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    if args.csv:
        fields = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
    print(json.dumps({"jax": jax.__version__, "compiles": rows}))


if __name__ == "__main__":
    main()
