"""Time the CPU attention kernel against ATen's CPU flash attention, forward and backward.

Each row is one (dtype, head_dim) at a fixed amount of attention work: batch x heads x seq^2 x
head_dim is that of the Llama 3 debug model at seq 2048, batch 8 (16 heads of 16). Times are
medians of --repeats calls on the same inputs, the kernels interleaved. On a CPU where the
kernel's bf16 calls take the AMX path, bf16 rows also time its AVX512-BF16 (`vdpbf16ps`) path
(TITAN_CPU_ATTN_AMX=0) in the same rounds (columns vdp_*). Prints the CPU model, a table, and
writes CSV.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench/bench_attention.py --out attention.csv
"""

import contextlib
import csv
import os
import statistics
import sys
import time

import torch

from titan_kernels import cpu_attention
from trainer.runtime import cli


def _time_s(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@contextlib.contextmanager
def _amx(on: bool):
    saved = os.environ.get("TITAN_CPU_ATTN_AMX")
    os.environ["TITAN_CPU_ATTN_AMX"] = "1" if on else "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TITAN_CPU_ATTN_AMX"]
        else:
            os.environ["TITAN_CPU_ATTN_AMX"] = saved


def _parse_args():
    """The command line."""
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16, help="fewer than --heads for GQA")
    parser.add_argument("--head-dims", default="16,32,64,128")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    return parser.parse_args()


def _inputs(dtype: torch.dtype, head_dim: int, args) -> dict:
    """One row's inputs (seed 0): q, k, v, dout in (batch, heads, seq, head_dim), the scale, and k, v
    repeated to the query heads for ATen (which has no GQA); batch keeps batch * head_dim constant."""
    batch = max(1, 8 * 16 // head_dim)  # constant batch * head_dim: same FLOPs per row
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, args.seq_len, args.heads, head_dim, generator=g).to(dtype).transpose(1, 2)
    k, v = (
        torch.randn(batch, args.seq_len, args.kv_heads, head_dim, generator=g).to(dtype).transpose(1, 2)
        for _ in range(2)
    )
    dout = torch.randn(q.shape, generator=g).to(dtype)
    rep = args.heads // args.kv_heads
    return {
        "batch": batch,
        "q": q,
        "k": k,
        "v": v,
        "dout": dout,
        "scale": head_dim**-0.5,
        "k_rep": k.repeat_interleave(rep, 1),
        "v_rep": v.repeat_interleave(rep, 1),
    }


def _time_calls(x: dict, *, repeats: int, both: bool) -> dict[str, list[float]]:
    """Seconds per call of the kernel's and ATen's forward and backward, `repeats` interleaved rounds;
    with `both`, also the kernel's vdpbf16ps path (vdp_fwd, vdp_bwd)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    q, k, v, dout, scale, k_rep, v_rep = (x[n] for n in ("q", "k", "v", "dout", "scale", "k_rep", "v_rep"))
    with torch.no_grad():
        out, lse = torch.ops.titan_cpu.attn_fwd(q, k, v, scale)
        f_out, f_lse = flash(q, k_rep, v_rep, 0.0, True, scale=scale)[:2]
        t = {"kernel_fwd": [], "kernel_bwd": [], "flash_fwd": [], "flash_bwd": []}
        if both:
            t.update(vdp_fwd=[], vdp_bwd=[])
        for _ in range(repeats):  # interleaved: drift hits all alike
            if both:
                with _amx(False):
                    t["vdp_fwd"].append(_time_s(lambda: torch.ops.titan_cpu.attn_fwd(q, k, v, scale)))
                    t["vdp_bwd"].append(_time_s(lambda: torch.ops.titan_cpu.attn_bwd(dout, q, k, v, out, lse, scale)))
            t["kernel_fwd"].append(_time_s(lambda: torch.ops.titan_cpu.attn_fwd(q, k, v, scale)))
            t["flash_fwd"].append(_time_s(lambda: flash(q, k_rep, v_rep, 0.0, True, scale=scale)))
            t["kernel_bwd"].append(_time_s(lambda: torch.ops.titan_cpu.attn_bwd(dout, q, k, v, out, lse, scale)))
            t["flash_bwd"].append(
                _time_s(lambda: flash_bwd(dout, q, k_rep, v_rep, f_out, f_lse, 0.0, True, scale=scale))
            )
    return t


def _row(t: dict[str, list[float]], *, dtype_name: str, head_dim: int, batch: int, both: bool, args) -> dict:
    """One table row: median milliseconds per call, the speedups and the causal GFLOP/s."""
    med = {name: statistics.median(ts) for name, ts in t.items()}
    kernel, aten = med["kernel_fwd"] + med["kernel_bwd"], med["flash_fwd"] + med["flash_bwd"]
    causal_flops = 3 * 2 * 2 * batch * args.heads * args.seq_len**2 * head_dim / 2  # fwd 2 GEMMs, bwd 4
    vdp = med["vdp_fwd"] + med["vdp_bwd"] if "vdp_fwd" in med else None
    return {
        "dtype": dtype_name,
        "path": "amx" if both else "vector",
        "head_dim": head_dim,
        "batch": batch,
        "heads": f"{args.heads}/{args.kv_heads}",
        "seq": args.seq_len,
        "threads": torch.get_num_threads(),
        **{
            f"{name}_ms": round(1e3 * med[name], 1) if name in med else ""
            for name in ("kernel_fwd", "kernel_bwd", "flash_fwd", "flash_bwd", "vdp_fwd", "vdp_bwd")
        },
        "vs_vdp": round(vdp / kernel, 2) if vdp else "",
        "speedup": round(aten / kernel, 2),
        "kernel_gflops": round(causal_flops / kernel / 1e9, 1),
        "flash_gflops": round(causal_flops / aten / 1e9, 1),
    }


def _write_table(rows: list[dict], out: str | None) -> None:
    """The rows as a markdown table on stdout, and as CSV at `out` when given."""
    header = list(rows[0])
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(row[h]) for h in header) + " |")
    if out:
        with open(out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=header)
            writer.writeheader()
            writer.writerows(rows)


def main() -> None:
    args = _parse_args()
    if not cpu_attention.load():
        cli.fail(f"the CPU attention kernel is unavailable: {cpu_attention.load_error()}", code=1)
    from trainer.runtime.device import cpu_model

    amx = cpu_attention.uses_amx()
    print(f"cpu: {cpu_model()}; threads {torch.get_num_threads()}; bf16 path: {'AMX tiles' if amx else 'vdpbf16ps'}")
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for head_dim in map(int, args.head_dims.split(",")):
            x = _inputs(dtype, head_dim, args)
            both = amx and dtype == torch.bfloat16
            t = _time_calls(x, repeats=args.repeats, both=both)
            rows.append(_row(t, dtype_name=dtype_name, head_dim=head_dim, batch=x["batch"], both=both, args=args))
            print(" | ".join(f"{k} {v}" for k, v in rows[-1].items()), flush=True)
    _write_table(rows, args.out)


if __name__ == "__main__":
    sys.exit(cli.run(main))
