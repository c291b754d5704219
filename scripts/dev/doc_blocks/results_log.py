"""docs/results.md's benchmark tables, each read from its CSV in docs/results/ (`RESULTS_LOG`: block
name -> renderer). The words of a table that no CSV holds (what a variant ran, a row's caveat) are
written here beside the CSV's name; every number comes from the CSV, so a table cannot drift from it
(tests/unit/test_docs.py). Tables with no CSV behind them stay hand-written in the page and say so."""

from __future__ import annotations

import csv
from collections.abc import Callable
from decimal import ROUND_HALF_UP, Decimal

from .results import MOE_BALANCE_COLUMNS, ROOT, csv_columns


def _rows(name: str) -> list[dict]:
    return list(csv.DictReader((ROOT / "docs" / "results" / name).read_text().splitlines()))


def _n(value: str | float, digits: int = 0) -> str:
    """A number as the page prints it: thousands grouped, `digits` decimals, rounded half up from the
    CSV's decimal text (2924.5 -> 2,925, 7.395 -> 7.40: as a reader rounds what the CSV shows)."""
    exact = Decimal(str(value)).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP)
    return f"{exact:,.{digits}f}"


def _tok_range(r: dict, bold: bool = False, key: str = "tokens_per_sec") -> str:
    """tokens/s (min..max over the repeats), in bold where the page marks the row."""
    tok = _n(r[key])
    return f"{f'**{tok}**' if bold else tok} ({_n(r[key + '_min'])}..{_n(r[key + '_max'])})"


def _table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(out + ["| " + " | ".join(cells).replace("|  |", "| |") + " |" for cells in rows])


# ------------------------------------------------------------------------ the trainer, CPU and H200


def render_ttshape_kernel() -> str:
    """TorchTitan's debug shape, CPU attention kernel vs SDPA (2026-11-30, 18cde08)."""
    words = {  # variant -> attention, kv heads, tok/s in bold
        "eager": ("CPU kernel", "4 (our debugmodel)", True),
        "compile": ("CPU kernel", "4", True),
        "eager_sdpa": ("SDPA (ATen flash)", "4", False),
        "eager_mha": ("CPU kernel", "16 (TorchTitan's)", True),
        "eager_mha_sdpa": ("SDPA (ATen flash)", "16", False),
    }
    header = ["variant", "attention", "kv heads", "tok/s (min..max)", "TFLOP/s", "MFU % (PaLM)", "MFU % (causal)"]
    rows = [
        [r["variant"], *words[r["variant"]][:2], _tok_range(r, words[r["variant"]][2]), *_rate(r), _n(r["mem_gib"], 2)]
        for r in _rows("cpu_torchtitan_shape_kernel_2026-11-30_18cde08.csv")
    ]
    return _table([*header, "peak RSS GiB"], rows)


def _rate(r: dict) -> list[str]:
    """TFLOP/s, MFU % PaLM and causal of a scripts/benchmark.py row."""
    return [_n(r["tflops"], 3), _n(r["mfu_pct"], 1), _n(r["mfu_pct_causal"], 1)]


def _per_process(r: dict) -> list[str]:
    """Processes, tok/s per process and tok/s in all of a scripts/benchmark.py row."""
    return [r["nproc"], _n(r["tokens_per_sec"]), _n(r["tokens_per_sec_total"])]


def render_ttshape_graph() -> str:
    """The same shape in graph mode (2026-11-30, c8830c1)."""
    rows = [
        [r["variant"], _tok_range(r, r["variant"] == "graph"), *_rate(r), _n(r["mem_gib"], 2), _n(r["compile_s"])]
        for r in _rows("cpu_torchtitan_shape_graph_kernel_2026-11-30_c8830c1.csv")
    ]
    header = ["variant", "tok/s (min..max)", "TFLOP/s", "MFU % (PaLM)", "MFU % (causal)", "peak RSS GiB", "compile s"]
    return _table(header, rows)


def render_torchtitan_reference() -> str:
    """TorchTitan 0.2.2 by hand on the same machine, one run before and one after (2026-11-30, 18cde08)."""
    rows = []
    for run, r in zip(("before", "after"), _rows("cpu_torchtitan_reference_2026-11-30_18cde08.csv"), strict=True):
        model = (
            f"TorchTitan {r['impl'].split()[-1]} debugmodel (dim 256, 6 layers, 16 heads, no GQA, vocab 2048, "
            f"{int(r['params']) / 1e6:.2f}M params), seq {r['seq_len']}, batch {r['batch']}"
        )
        rows.append([run, model if run == "before" else "same", _tok_range(r, key="tok_s"), _n(r["step_s"], 2)])
    return _table(["run", "model", "tok/s (min..max over steps)", "step s"], rows)


def render_debug_recipe_kernel() -> str:
    """The debug recipe on 1 and 2 processes, kernel vs SDPA (2026-11-30, 18cde08)."""
    attention = {"eager": "CPU kernel (auto)", "eager_sdpa": "SDPA"}
    rows = [
        [attention[r["variant"]], *_per_process(r), _n(r["mfu_pct"], 1), _n(r["mem_gib"], 2)]
        for r in _rows("cpu_debug_recipe_kernel_2026-11-30_18cde08.csv")
    ]
    header = ["attention", "processes", "tok/s per process", "tok/s total", "MFU %", "peak RSS GiB per process"]
    return _table(header, rows)


def _variant_tok_mfu(name: str, first: str) -> str:
    """variant, tok/s and MFU % (PaLM) of a scripts/benchmark.py CSV; `first`: the first column's header."""
    rows = [[r["variant"], _n(r["tokens_per_sec"]), _n(r["mfu_pct"], 1)] for r in _rows(name)]
    return _table([first, "tok/s", "MFU % (PaLM)"], rows)


def render_debug_seq2048() -> str:
    """Before the CPU kernel: seq 2048, one process (2026-11-29, ae9f9e7)."""
    return _variant_tok_mfu("cpu_debug_seq2048_2026-11-29_ae9f9e7.csv", "variant (seq 2048, 1 process)")


def render_debug_nproc() -> str:
    """Before the CPU kernel: 1, 2 and 4 processes at seq 512 (2026-11-29, ae9f9e7)."""
    rows = [
        [
            r["nproc"] + (" (overcommitted: 4 processes on 2 cores)" if r["nproc"] == "4" else ""),
            _n(r["tokens_per_sec"]),
            _n(r["tokens_per_sec_total"]),
        ]
        for r in _rows("cpu_debug_nproc_2026-11-29_ae9f9e7.csv")
    ]
    return _table(["processes (seq 512)", "tok/s per process", "tok/s total"], rows)


def render_h200_llama8b() -> str:
    """Llama 3 8B shapes with 4 layers on the H200 (2026-11-29, 9c669ae)."""
    label = {
        "eager": "eager",
        "compile": "compile (per block)",
        "graph": "graph (one FX graph per step)",
        "graph_scan": "graph + scan",
    }
    rows = [
        [
            label[r["variant"]],
            _n(r["tokens_per_sec"]),
            _n(r["tflops"]),
            f"**{_n(r['mfu_pct'], 1)}**" if r["variant"] == "graph" else _n(r["mfu_pct"], 1),
            _n(r["mfu_pct_causal"], 1),
            _n(r["mem_gib"], 1),
            _n(r["compile_s"], 1) if r["compile_s"] else "-",
        ]
        for r in _rows("h200_llama8b_l4_gpu_2026-11-29_9c669ae.csv")
    ]
    header = ["variant", "tok/s/dev", "TFLOP/s/dev", "MFU % (PaLM)", "MFU % (causal)", "peak mem GiB"]
    return _table([*header, "capture + compile s"], rows)


def render_h200_debug() -> str:
    """The debug model on the H200 (2026-11-29, 9c669ae)."""
    return _variant_tok_mfu("h200_debug_gpu_2026-11-29_9c669ae.csv", "variant")


# ------------------------------------------------------------------------ kernels, suites, peers


def render_attention_speedup() -> str:
    """The CPU attention kernel over ATen's flash kernel by dtype and head_dim (2026-11-30, 18cde08)."""
    rows = _rows("cpu_attention_kernel_2026-11-30_18cde08.csv")
    dims = list(dict.fromkeys(r["head_dim"] for r in rows))
    out = []
    for dtype, short in (("bfloat16", "bf16"), ("float32", "fp32")):
        by_dim = {r["head_dim"]: r for r in rows if r["dtype"] == dtype}
        out.append([f"{short} speedup over ATen flash", *(f"{float(by_dim[d]['speedup']):.2f}x" for d in dims)])
    return _table([f"dtype (seq {rows[0]['seq']}, 16 heads)", f"head_dim {dims[0]}", *dims[1:]], out)


def render_mfu_suite_cpu() -> str:
    """The MFU suite's measured rows (2026-12-01, 95f2fb4; its projections were skipped, see the CSV)."""
    rows = [
        [r["mode"], *_per_process(r), _n(r["mfu_pct"], 2), _n(r["mfu_pct_causal"], 2)]
        for r in _rows("mfu_suite_cpu_2026-12-01_95f2fb4.csv")
        if r["mode"] != "projection"
    ]
    return _table(["mode", "nproc", "tok/s/dev", "tok/s total", "MFU % palm", "MFU % causal"], rows)


def render_peer_ttshape_4fdaa22() -> str:
    """TorchTitan 0.3.0's own trainer beside ours at its debug shape (2026-12-01, 4fdaa22)."""
    rows = {r["variant"]: r for r in _rows("cpu_peer_ttshape_2026-12-01_4fdaa22.csv")}
    label = {
        "torchtitan": "TorchTitan 0.3.0's own trainer",
        "eager": "ours eager bf16",
        "graph": "ours graph bf16",
        "graph_scan": "ours graph + scan bf16",
        "eager_fp32": "ours eager fp32",
    }
    peer = float(rows["torchtitan"]["tokens_per_sec"])
    out = [[text, _tok_range(rows[v]), f"{float(rows[v]['tokens_per_sec']) / peer:.2f}x"] for v, text in label.items()]
    return _table(["run", "tok/s", "vs TorchTitan (defaults vs defaults)"], out)


# ------------------------------------------------------------------------ context parallelism, optimizers, MoE


def render_cp_attention() -> str:
    """CP attention fwd + bwd on the CPU, two runs side by side (2026-12-03, 5ed00df; run 2 has CPU time)."""
    run2 = {(r["seq"], r["variant"]): r for r in _rows("cpu_context_parallel_cputime_2026-12-03_5ed00df.csv")}
    words = {
        ("8192", "cp1_causal"): "cp1_causal (SDPA is_causal, one process)",
        ("8192", "cp1_masked"): "cp1_masked (CP code path, one process)",
        ("8192", "cp2"): "cp2 (2 gloo processes)",
    }
    out = []
    for r in _rows("cpu_context_parallel_2026-12-03_5ed00df.csv"):
        key = (r["seq"], r["variant"])
        r2 = run2[key]
        wall1 = _n(r["fwd_bwd_ms"]) + (" (load 4+)" if key == ("16384", "cp2") else "")
        gather = f"{_n(r['gather_ms'])} / {_n(r2['gather_ms'])}" if r["gather_ms"] else ""
        cells = [_n(r2["fwd_bwd_ms"]), _n(r2["cpu_ms"]), gather, _n(r["peak_mib"])]
        out.append([r["seq"], words.get(key, r["variant"]), wall1, *cells])
    header = ["seq", "variant", "wall ms run 1", "wall ms run 2", "CPU ms run 2", "k+v gather ms"]
    return _table([*header, "peak MiB / process (run 1)"], out)


def render_cp_train() -> str:
    """Context parallelism in the trainer's step (2026-12-03, 8b161d8)."""
    out = [
        [
            r["seq"],
            r["cp"],
            _n(r["step_s"], 2),
            _n(r["cpu_s"], 2),
            _n(r["tokens_per_s"]),
            _n(r["tokens_per_s_per_process"]),
            r["peak_mib_per_process"],
            r["step_mib_per_process"],
        ]
        for r in _rows("cpu_context_parallel_train_2026-12-03_8b161d8.csv")
    ]
    header = ["seq", "cp", "step wall s", "CPU s / process", "tokens/s (job)", "tokens/s / process"]
    return _table([*header, "peak RSS MiB / process", "step memory MiB / process"], out)


def render_muon_vs_adamw_b4c417e() -> str:
    """Muon vs AdamW on the Llama 3 debug model (2026-12-03, b4c417e)."""
    out = [
        [
            r["optimizer"],
            f"{float(r['lr']):.0e}".replace("e-0", "e-"),
            _n(r["final_train_loss_avg10"], 3),
            _n(r["val_loss"], 3),
            _n(r["tokens_per_s"]),
            _n(r["optimizer_step_ms"], 1),
        ]
        for r in _rows("muon_vs_adamw_2026-12-03_b4c417e.csv")
    ]
    header = ["optimizer", "lr", "train loss (last 10 steps)", "val loss", "tokens/s", "optimizer step ms"]
    return _table(header, out)


def render_moe_balance_109159f() -> str:
    """MoE load balancing, bias vs auxiliary losses (2026-12-04, 109159f): the CSV's columns as printed."""
    return csv_columns("moe_balance_2026-12-04_109159f.csv", MOE_BALANCE_COLUMNS)


RESULTS_LOG: dict[str, Callable[[], str]] = {
    "results_ttshape_kernel": render_ttshape_kernel,
    "results_ttshape_graph": render_ttshape_graph,
    "results_torchtitan_reference": render_torchtitan_reference,
    "results_debug_recipe_kernel": render_debug_recipe_kernel,
    "results_debug_seq2048": render_debug_seq2048,
    "results_debug_nproc": render_debug_nproc,
    "results_h200_llama8b": render_h200_llama8b,
    "results_h200_debug": render_h200_debug,
    "results_attention_speedup": render_attention_speedup,
    "results_mfu_suite_cpu": render_mfu_suite_cpu,
    "results_peer_ttshape_4fdaa22": render_peer_ttshape_4fdaa22,
    "results_cp_attention": render_cp_attention,
    "results_cp_train": render_cp_train,
    "results_muon_vs_adamw": render_muon_vs_adamw_b4c417e,
    "results_moe_balance": render_moe_balance_109159f,
}
"""docs/results.md's generated blocks, in the page's order."""
