"""A `delta_chunk_size` the TPU delta-rule kernel does not run is said at start-up (issue 54).

titan_kernels/tpu/register.py hands every call with a chunk other than the kernel's (64) to the
torch reference. Before, a Qwen 3.5 run with another `delta_chunk_size` took the reference in every
block without a word; now the kernel selection drops the kernel for the run with the same banner
line a kernel that fails its self-check gets, and the start-up line lists it as failed.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

import models
import titan_kernels
from models.common import gated_delta, ops
from titan_kernels.tpu import selfcheck

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def test_the_chunk_is_the_kernels():
    """The constant the check compares with is delta_rule.py's CHUNK (read from the source: the
    kernel module imports jax, which this process does not)."""
    source = (ROOT / "titan_kernels/tpu/delta_rule.py").read_text()
    assert int(re.search(r"^CHUNK = (\d+)$", source, re.M).group(1)) == selfcheck.DELTA_KERNEL_CHUNK == 64


def test_kernel_shapes_carry_the_models_chunk():
    args = models.get_model_family("qwen3_5").get_args("debugmodel")
    assert selfcheck.KernelShapes.of(args).delta_chunk == 64
    assert selfcheck.delta_chunk_verdict(selfcheck.KernelShapes.of(args)) is None
    odd = selfcheck.KernelShapes.of(dataclasses.replace(args, delta_chunk_size=32))
    verdict = selfcheck.delta_chunk_verdict(odd)
    assert odd.delta_chunk == 32 and verdict is not None and not verdict.ok
    assert "delta_chunk_size = 32" in verdict.reason and "chunks of 64" in verdict.reason, verdict
    # no delta rule in the model: nothing to say whatever the field
    assert selfcheck.delta_chunk_verdict(dataclasses.replace(odd, delta_heads=0)) is None
    assert selfcheck.delta_chunk_verdict(None) is None


def test_select_on_tpu_says_the_reference_serves_another_chunk(monkeypatch, capsys):
    from titan_kernels import tpu

    def kernel(*a, chunk_size=64, **kw):  # agrees with the reference: passes its self-check at 64
        return gated_delta.recurrent_gated_delta_rule(*a, **kw)

    monkeypatch.setattr(tpu, "load", lambda: {"gated_delta_rule": kernel})
    monkeypatch.setattr(tpu, "saved_ops", lambda: [])
    monkeypatch.setattr(tpu, "compile_checker", lambda shapes, attached=False: lambda op: None)
    shapes = selfcheck.KernelShapes(delta_k_dim=16, delta_v_dim=8, delta_heads=4, delta_chunk=128)
    try:
        line = titan_kernels._select_tpu("sdpa", device=CPU, dtype=torch.bfloat16, head_dim=None, shapes=shapes)
        assert ops.implementation("gated_delta_rule") is ops.torch_gated_delta_rule
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            "titan-tpu: kernel self-check: delta rule (gated_delta_rule) failed, the torch reference serves it: "
            "model.delta_chunk_size = 128: the kernel runs chunks of 64 tokens only "
            "(set delta_chunk_size = 64 for the kernel)"
        ], err
        assert "self-check failed: delta rule" in line and "chunked gated delta rule" not in line, line
        # the kernel's own chunk: checked and registered, no banner line
        line = titan_kernels._select_tpu(
            "sdpa", device=CPU, dtype=torch.bfloat16, head_dim=None, shapes=dataclasses.replace(shapes, delta_chunk=64)
        )
        assert ops.implementation("gated_delta_rule") is kernel
        assert "chunked gated delta rule" in line and "self-check passed" in line, line
        assert capsys.readouterr().err == ""
    finally:
        ops.register("gated_delta_rule", None)
