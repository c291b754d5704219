"""Probe (ttpu venv): the start-up self-check at a run's widths with the real kernels, no TPU.

    python selfcheck_widths.py [fallback] [numerics]

`fallback`: the fused loss at Llama 3 70B's head (hidden 8192, vocab 128256, 8192 rows per
device) through the self-check as `titan_kernels._select_tpu` runs it, with
`titan_kernels/tpu/compile_check.py`'s compile-only check for v4 (deviceless XLA:TPU compile for
the `v4:2x2x1` topology, libtpu 0.0.52) and for v6e, and the tile rule alone (generation None);
the numeric part runs the real kernel in Pallas' interpreter (bf16). Records each compile
check's answer, the verdict, the banner lines `_register_tpu` prints and what then serves
`linear_cross_entropy`: {"fallback": {"v4"|"v6e"|"none": {"compile": [ok, note], "ok", "reason",
"worst", "banner": [lines], "serves": "kernel"|"reference"}}}.
`numerics`: the self-check's worst error (of scale) with the real kernels in interpret mode at
recipe widths: splash at head width 128 and at MLA's q/k 192 with v 128 (what DeepSeek-V3 / Kimi K2
hand the op, unpadded); gmm at Qwen3-235B-A22B's experts (4096 -> 1536 -> 4096); the loss at
hidden 8192; CP splash (register.build_cp's `splash.cp_forward/cp_backward`) for cp 2 rank 1 and
cp 4 rank 0, and at MLA's widths for cp 2 rank 1:
{"numerics": {label: {"ok", "worst", "reason", "checked", "seconds"}}}.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(Path(__file__).resolve().parent))

import kernels_interpret  # noqa: E402  (the real kernels in interpret mode as torch functions)
import torch  # noqa: E402

import titan_kernels  # noqa: E402
from models.common import ops  # noqa: E402
from titan_kernels.tpu import compile_check, selfcheck, splash  # noqa: E402

BF16 = torch.bfloat16
CPU = torch.device("cpu")
LLAMA3_70B = selfcheck.KernelShapes(hidden=8192, vocab=128256, qk_head_dim=128, v_head_dim=128, tokens=8192)


def fallback() -> dict:
    impl = kernels_interpret._interpret_impls()["linear_cross_entropy"]
    out = {}
    for gen in ("v4", "v6e", None):
        start = time.perf_counter()
        answer = compile_check.compile_kernel("linear_cross_entropy", LLAMA3_70B, gen)
        compile_s = time.perf_counter() - start
        saved = {op: ops.register(op, None) for op in ops.OPS}
        err = io.StringIO()
        try:
            passed, verdicts = selfcheck.run(
                {"linear_cross_entropy": impl},
                device=CPU,
                dtype=BF16,
                shapes=LLAMA3_70B,
                compile_check=lambda op: answer,
            )
            with contextlib.redirect_stderr(err):
                line = titan_kernels._register_tpu("auto", passed, verdicts, saved=[])
            serves = "kernel" if ops.implementation("linear_cross_entropy") is impl else "reference"
        finally:
            for op, fn in saved.items():
                ops.register(op, fn)
        (v,) = verdicts
        out[gen or "none"] = {
            "compile": list(answer),
            "compile_s": round(compile_s, 2),
            "ok": v.ok,
            "reason": v.reason,
            "worst": v.worst,
            "checked": v.checked,
            "banner": err.getvalue().strip().splitlines(),
            "line": line,
            "serves": serves,
        }
        print(f"fallback {gen}: {answer[0]} {v.ok} {v.reason[:160]}", file=sys.stderr, flush=True)
    return out


def _cp_impl(cp_rank: int, cp_size: int):
    fn = kernels_interpret._as_torch_op(
        lambda q, k, v, *seg: splash.splash_cp_attention(
            q, k, v, *(seg or (None, None)), cp_rank=cp_rank, cp_size=cp_size, interpret=True
        ),
        3,
    )

    def attention(q, k_all, v_all, segment_ids=None, segment_ids_all=None):
        if segment_ids is None:
            return fn(q, k_all, v_all)
        return fn(q, k_all, v_all, segment_ids.to(torch.int32), segment_ids_all.to(torch.int32))

    return attention


def numerics() -> dict:
    impls = kernels_interpret._interpret_impls()
    runs = {
        "splash d128": (
            "causal_attention",
            impls["causal_attention"],
            selfcheck.KernelShapes(qk_head_dim=128, v_head_dim=128),
        ),
        "splash MLA 192/128": (
            "causal_attention",
            impls["causal_attention"],
            selfcheck.KernelShapes(qk_head_dim=192, v_head_dim=128),
        ),
        "gmm qwen3-235b 4096/1536": (
            "grouped_mm",
            impls["grouped_mm"],
            selfcheck.KernelShapes(hidden=4096, expert_hidden=1536),
        ),
        "fused CE hidden 8192": ("linear_cross_entropy", impls["linear_cross_entropy"], LLAMA3_70B),
        "CP splash cp2 rank1 d128": (
            "cp_attention",
            _cp_impl(1, 2),
            selfcheck.KernelShapes(qk_head_dim=128, v_head_dim=128, cp=2, cp_rank=1),
        ),
        "CP splash cp4 rank0 d128": (
            "cp_attention",
            _cp_impl(0, 4),
            selfcheck.KernelShapes(qk_head_dim=128, v_head_dim=128, cp=4, cp_rank=0),
        ),
        "CP splash cp2 rank1 MLA 192/128": (
            "cp_attention",
            _cp_impl(1, 2),
            selfcheck.KernelShapes(qk_head_dim=192, v_head_dim=128, cp=2, cp_rank=1),
        ),
    }
    out = {}
    for label, (op, impl, shapes) in runs.items():
        start = time.perf_counter()
        v = selfcheck.check(op, impl, device=CPU, dtype=BF16, shapes=shapes)
        out[label] = {
            "op": op,
            "ok": v.ok,
            "worst": v.worst,
            "reason": v.reason,
            "checked": v.checked,
            "seconds": round(time.perf_counter() - start, 1),
        }
        print(f"numerics {label}: {v.ok} {v.worst:.4f} {v.reason[:120]}", file=sys.stderr, flush=True)
    return out


def main() -> None:
    runners = {"fallback": fallback, "numerics": numerics}
    print(json.dumps({name: runners[name]() for name in sys.argv[1:]}))


if __name__ == "__main__":
    main()
