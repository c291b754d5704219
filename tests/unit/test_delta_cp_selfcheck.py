"""The start-up self-check of the delta-rule kernel at the CP width (titan_kernels/tpu/selfcheck.py
`_delta_rule_cp_cases`; issue 54).

Under context parallelism parallelisms/context_parallel_linear.py calls the delta rule with values
`[v | 0]` at dv + dk columns from the initial state `[0 | I]` and q in float32. The self-check used
to run the kernel at dv only, so a kernel that computes dv-wide values right and wider ones wrong
(a tile or VMEM layout that only the wider call takes) passed it and trained a cp run on garbage.
With `KernelShapes.cp > 1` the check now also runs the wrapper's call, output and final state.

- The cases hold exactly the wrapper's inputs (the zero columns, the identity, float32 q).
- A kernel that is right at dv and drops the columns past dv (the `Phi^T q` part that carries
  the earlier ranks' state) passes at cp 1 and is dropped at cp 2, with the numbers.
- The token-by-token recurrence (an independent formula) passes at cp 2 within half the tolerance.
"""

from __future__ import annotations

import torch

from models.common import gated_delta
from models.qwen3_5.args import FLAVORS
from titan_kernels.tpu import selfcheck

BF16 = torch.bfloat16
CPU = torch.device("cpu")


def _recurrent(*a, chunk_size=64, **kw):
    return gated_delta.recurrent_gated_delta_rule(*a, **kw)


def _narrow(*a, chunk_size=64, **kw):
    """Right at the model's dv, wrong past it: the output's columns beyond 64 are zeros."""
    out, state = _recurrent(*a, **kw)
    out = torch.cat([out[..., :64], torch.zeros_like(out[..., 64:])], dim=-1)
    return out, state


def test_the_cp_cases_are_the_wrappers_call():
    shapes = selfcheck.KernelShapes.of(FLAVORS["debugmodel"], cp=2)
    dk, dv = shapes.delta_k_dim, shapes.delta_v_dim
    assert (dk, dv, shapes.cp) == (64, 64, 2)
    cases = selfcheck.cases("gated_delta_rule", dtype=BF16, shapes=shapes)
    assert [c.name for c in cases] == [
        "documents, output",
        "documents, final state",
        "cp width, output",
        "cp width, final state",
    ]
    q, k, v, g, beta, state, reset = cases[2].args
    assert q.dtype == torch.float32 and torch.equal(q, cases[0].args[0].float())
    assert v.shape[-1] == dv + dk and torch.equal(v[..., :dv], cases[0].args[2]) and not v[..., dv:].any()
    eye = torch.eye(dk).expand(*state.shape[:2], dk, dk)
    assert state.shape[-1] == dv + dk and not state[..., :dv].any() and torch.equal(state[..., dv:], eye)
    assert state.dtype == torch.float32
    assert shapes.describe("gated_delta_rule") == "k 64, v 64 and 128 (cp 2)"
    assert (
        len(selfcheck.cases("gated_delta_rule", dtype=BF16, shapes=selfcheck.KernelShapes.of(FLAVORS["debugmodel"])))
        == 2
    )


def test_a_kernel_wrong_only_at_the_cp_width_is_dropped_at_cp_2():
    args = FLAVORS["debugmodel"]
    one = selfcheck.check("gated_delta_rule", _narrow, device=CPU, dtype=BF16, shapes=selfcheck.KernelShapes.of(args))
    assert one.ok, one  # what the check saw before: the kernel passes at dv
    two = selfcheck.check(
        "gated_delta_rule", _narrow, device=CPU, dtype=BF16, shapes=selfcheck.KernelShapes.of(args, cp=2)
    )
    assert not two.ok and "differs from the reference" in two.reason and two.worst > selfcheck.TOLERANCE, two
    assert "cp width" in two.reason, two.reason


def test_the_recurrence_passes_at_the_cp_width():
    shapes = selfcheck.KernelShapes.of(FLAVORS["debugmodel"], cp=2)
    verdict = selfcheck.check("gated_delta_rule", _recurrent, device=CPU, dtype=BF16, shapes=shapes)
    assert verdict.ok and 0 < verdict.worst < selfcheck.TOLERANCE / 2, verdict
    assert verdict.checked == "k 64, v 64 and 128 (cp 2)"


def test_cp_chunks_shorter_than_the_convolution_halo_are_refused_at_start():
    """The other cp constraint of the linear attention: each chunk's short convolution (kernel 4)
    takes its 3-token halo from the preceding chunk only (`cp_causal_conv1d`, which asserted deep in
    the first step). Qwen 3.5 debug at cp 2: seq_len 8 makes chunks of 2 tokens: one `error:` line
    naming the key and what is allowed; seq_len 12 (chunks of 3) plans."""
    from models.errors import ConfigError
    from trainer.config import build_config
    from trainer.job import plan_job

    def plan(seq_len):
        overrides = [("parallelism.context_parallel_degree", "2"), ("training.seq_len", str(seq_len))]
        return plan_job(build_config("configs/qwen3_5_debug.toml", overrides), world_size=2, device_type="cpu")

    message = (
        "parallelism.context_parallel_degree: 2 with training.seq_len = 8 makes context-parallel chunks of "
        "seq_len / (2 * cp) = 2 tokens, fewer than the 3 tokens before each one that the linear attention's "
        "short convolution reads (passed from the preceding chunk only); allowed: a context_parallel_degree "
        "with seq_len / (2 * cp) >= 3, or 1"
    )
    try:
        plan(8)
    except ConfigError as e:
        assert str(e) == message and "\n" not in str(e)
    else:
        raise AssertionError("seq_len 8 at cp 2 planned")
    assert plan(12).step_plan is not None
