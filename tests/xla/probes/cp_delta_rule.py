"""Context parallelism's delta-rule wrapper over the TPU kernel, without a TPU.

`interpret [seq]` (xla venv): `parallelisms.context_parallel_linear.cp_gated_delta_rule` at cp 1 (no collective: the rank's two
chunks are the sequence's two halves, so the state still passes from the first to the second
through the wrapper's `[v | 0]` / `[0 | I]` call and fold) with the op as a TPU run composes it
(tests/xla/probes/delta_rule.py `kernel_impl`: torch `_prepare`, then the Pallas forward and
backward kernels interpreted), against the same op on the whole sequence. dk = dv = 128, Qwen 3.5's
widths, so the kernel runs at 256 value columns under the wrapper; a document reset in the first
half; decays ~0.99 per token so the second half carries the first's state. Outputs, final state and
the gradients of q, k, v, g, beta, relative to max|whole|, and the control: the second half alone
from a zero state.

`compile GEN...` (tpuc venv, no torch): the kernel's forward and forward + backward (tests/xla/probes/
delta_rule.py's programs) compiled deviceless at the widths the wrapper calls it with on a cp rank
of Qwen 3.5 9B: the two local chunks as a batch of 2, 32 value heads, dk = 128 and dv + dk = 256
value columns, chunks of 4096 tokens (cp 4 at 32k, cp 16 at 128k). Mosaic calls, the compiler's
temporaries and arguments, the kernel's VMEM estimate against the scoped limit.

Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def compile_(generations: list[str]) -> dict:
    """tests/xla/probes/delta_rule.py's compile at a cp rank's widths: the two local chunks as a
    batch of 2, dv + dk = 256 value columns. That probe is loaded under its own name: in its
    compile, `delta_rule` is the kernel's module (titan_kernels/tpu/delta_rule.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("delta_rule_probe", Path(__file__).with_name("delta_rule.py"))
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    return probe.compile_(generations, b=2, dv=256)


def interpret(seq: int) -> dict:
    sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]
    import torch
    import torch.nn.functional as F
    from delta_rule import kernel_impl

    from parallelisms.context_parallel import CPGroup
    from parallelisms.context_parallel_linear import cp_gated_delta_rule

    b, s, hk, hv, dk, dv = 1, seq, 1, 2, 128, 128

    def leaves():
        g = torch.Generator().manual_seed(1)
        q, k = torch.randn(b, s, hk, dk, generator=g), torch.randn(b, s, hk, dk, generator=g)
        v = torch.randn(b, s, hv, dv, generator=g)
        gate = -F.softplus(torch.randn(b, s, hv, generator=g)) * 0.01
        beta = torch.rand(b, s, hv, generator=g)
        return [t.requires_grad_() for t in (q, k, v, gate, beta)]

    reset = torch.zeros(b, s, dtype=torch.bool)
    reset[0, 40] = True
    w_out = torch.randn(b, s, hv, dv, generator=torch.Generator().manual_seed(2))
    w_state = torch.randn(b, hv, dk, dv, generator=torch.Generator().manual_seed(3))
    results, seconds = {}, {}
    wrapper = cp_gated_delta_rule(CPGroup(None, 1, 0), kernel_impl)
    for name, fn in (("whole", kernel_impl), ("cp_wrapper", wrapper)):
        x, start = leaves(), time.perf_counter()
        out, state = fn(*x, chunk_size=64, qk_l2norm=True, reset=reset, output_final_state=True)
        ((out * w_out).sum() + (state * w_state).sum()).backward()
        results[name] = [out.detach(), state.detach()] + [t.grad for t in x]
        seconds[name] = round(time.perf_counter() - start, 1)
    names = ("out", "state", "dq", "dk", "dv", "dg", "dbeta")
    rel = {
        n: ((got - ref).abs().max() / ref.abs().max()).item()
        for n, got, ref in zip(names, results["cp_wrapper"], results["whole"])
    }
    half = [t[:, s // 2 :] for t in leaves()]
    alone, _ = kernel_impl(*half, chunk_size=64, qk_l2norm=True, reset=reset[:, s // 2 :])
    whole_out = results["whole"][0]
    control = ((alone.detach() - whole_out[:, s // 2 :]).abs().max() / whole_out.abs().max()).item()
    shape = {"b": b, "s": s, "k_heads": hk, "v_heads": hv, "dk": dk, "dv": dv}
    return {"shape": shape, "rel_to_max": rel, "control_second_half_from_zero": control, "seconds": seconds}


def main() -> None:
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "interpret":
        result = interpret(int(rest[0]) if rest else 256)
    elif mode == "compile":
        result = compile_(rest)
    else:
        raise SystemExit(f"error: mode {mode!r}: allowed: interpret, compile")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
