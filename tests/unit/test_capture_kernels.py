"""The capture path's kernel registry (titan_kernels/tpu/capture.py, tools/tpu_compile_capture.py;
issues 50/52/54): every Pallas kernel a TPU run calls is one opaque node of the captured step, and
the program's kernel calls are priced (`kernel_model`, what scripts/mfu_suite.py's projection adds
to the compiler's counts: libtpu counts a Mosaic call as zero FLOPs).

- The sink splash (gpt-oss, DeepSeek-V4's sliding blocks) is a capture op with shapes and autograd.
- The per-rank CP splash (`titan_program::splash_cp_*`), the sink pair and the delta rule are
  priced; before, `kernel_model` priced only splash without CP, gmm and the fused loss, so a CP
  program's attention, gpt-oss's and Qwen 3.5's kernels cost nothing in the projection.
- `compile_recipe`'s tokens per device count a CP rank's seq_len / cp tokens.

Shapes only (fake tensors, `make_fx`): no jax, no compile.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from models.common import ops
from titan_kernels.tpu import capture

B, HQ, HKV, D, DV = 2, 4, 2, 64, 32


@pytest.fixture
def installed():
    capture.install()
    yield getattr(torch.ops, capture.NAMESPACE)
    for op in (*ops.OPS, *ops.LOW_PRECISION_OPS):  # what capture.install() serves
        ops.register(op, None)


def _splash_blocks(n: int) -> int:  # splash.block_size, restated (jax is not in this venv)
    return next(b for b in (512, 256, 128) if n % b == 0)


def test_the_sink_op_keeps_shapes_and_autograd_on_fake_tensors(installed):
    """gpt-oss's `sink_attention` (a per-layer window tensor and the static `sliding_window`) is one
    `sink_fwd` node and one `sink_bwd` node, with segment ids the `_seg_` pair; the output has
    v's width, gradients reach q, k, v and the sinks (the sinks' shape theirs)."""
    with FakeTensorMode():
        q = torch.empty(B, HQ, 200, D, dtype=torch.bfloat16, requires_grad=True)
        k = torch.empty(B, HKV, 200, D, dtype=torch.bfloat16, requires_grad=True)
        v = torch.empty(B, HKV, 200, DV, dtype=torch.bfloat16, requires_grad=True)
        sinks = torch.empty(HQ, dtype=torch.float32, requires_grad=True)
        for seg in (None, torch.zeros(B, 200, dtype=torch.int64)):
            out = ops.sink_attention(q, k, v, sinks, torch.tensor(128), seg, sliding_window=128)
            assert out.shape == (B, HQ, 200, DV) and out.dtype == torch.bfloat16
            grads = torch.autograd.grad(out.float().sum(), [q, k, v, sinks])
            assert [g.shape for g in grads] == [t.shape for t in (q, k, v, sinks)]

    def step(q, k, v, sinks, seg):
        out = ops.sink_attention(q, k, v, sinks, 64, seg)  # an int window (DeepSeek-V4's blocks)
        return torch.autograd.grad(out.sum(), [q, k, v, sinks])

    args = [torch.randn(B, HQ, 256, D), torch.randn(B, HKV, 256, D), torch.randn(B, HKV, 256, DV), torch.randn(HQ)]
    gm = make_fx(step, tracing_mode="fake")(*[a.requires_grad_(True) for a in args], torch.zeros(B, 256))
    names = [n.target._schema.name for n in gm.graph.nodes if n.op == "call_function" and hasattr(n.target, "_schema")]
    assert names.count("titan_capture::sink_seg_fwd") == 1 and names.count("titan_capture::sink_seg_bwd") == 1


def _captured_ops(fn, *args) -> list[str]:
    gm = make_fx(fn, tracing_mode="fake")(*args)
    return [n.target._schema.name for n in gm.graph.nodes if n.op == "call_function" and hasattr(n.target, "_schema")]


def test_the_quantized_ops_are_the_tpus_own_nodes_not_the_emulation(installed):
    """`[quantize]`'s ops in the capture (issue 51): the dense linear, the grouped experts (dropless)
    and the capacity layout's batched experts are each one forward and one backward node of the
    TPU's op (lowered to qmatmul / qgmm), with the gradients' shapes; no matmul of the emulation
    is left in the graph (before, the capture held `emulated_linear`'s float32 mm per expert)."""
    recipe = "float8_rowwise"

    def dense(x, w):
        return torch.autograd.grad(ops.quantized_linear(x, w, recipe).sum(), [x, w])

    def grouped(x, w, sizes):
        return torch.autograd.grad(ops.quantized_grouped_mm(x, w, sizes, recipe).sum(), [x, w])

    def batched(x, w):
        return torch.autograd.grad(ops.quantized_batched_mm(x, w, recipe).sum(), [x, w])

    x, w = torch.randn(2, 8, 64, requires_grad=True), torch.randn(32, 64, requires_grad=True)
    names = _captured_ops(dense, x, w)
    assert names.count("titan_capture::qlinear_fwd") == 1 and names.count("titan_capture::qlinear_bwd") == 1, names
    assert not [n for n in names if n.startswith("aten::mm") or n.startswith("aten::bmm")], names
    xg, wg = torch.randn(40, 64, requires_grad=True), torch.randn(4, 64, 32, requires_grad=True)
    names = _captured_ops(grouped, xg, wg, torch.tensor([10, 0, 20, 10]))
    assert names.count("titan_capture::qgmm_fwd") == 1 and names.count("titan_capture::qgmm_bwd") == 1, names
    xb = torch.randn(4, 10, 64, requires_grad=True)
    names = _captured_ops(batched, xb, wg)
    assert names.count("titan_capture::qgmm_fwd") == 1 and names.count("titan_capture::qgmm_bwd") == 1, names
    assert not [n for n in names if n.startswith(("aten::mm", "aten::bmm"))], names
    with FakeTensorMode():
        xb, wg = torch.empty(4, 10, 64, requires_grad=True), torch.empty(4, 64, 32, requires_grad=True)
        out = ops.quantized_batched_mm(xb, wg, recipe)
        assert out.shape == (4, 10, 32)
        assert [g.shape for g in torch.autograd.grad(out.sum(), [xb, wg])] == [xb.shape, wg.shape]


def test_a_tensor_window_without_sliding_window_takes_the_reference(installed, monkeypatch):
    """As register.py on a TPU: the kernel builds its masks from `sliding_window`, so a tensor
    window without one (its values unknown) goes to the reference."""
    seen = []
    monkeypatch.setattr(ops, "sdpa_sink_attention", lambda *a: seen.append(a) or a[0])
    x = torch.zeros(1, 2, 8, 8)
    ops.sink_attention(x, x, x, torch.zeros(2), torch.tensor(0))
    assert len(seen) == 1


def _cp_program(rank: int, size: int, seq: int):
    """A rank's CP splash forward and backward, captured as the compile worker captures them."""
    from tools import tpu_compile

    op = tpu_compile._define_program_ops()

    def step(q, k_all, v_all):
        out = op.splash_cp_fwd(q, k_all, v_all, rank, size)
        return op.splash_cp_bwd(q, k_all, v_all, out, rank, size)

    s_local = seq // size
    q = torch.empty(B, HQ, s_local, D, dtype=torch.bfloat16)
    k, v = torch.empty(B, HKV, seq, D, dtype=torch.bfloat16), torch.empty(B, HKV, seq, DV, dtype=torch.bfloat16)
    return make_fx(step, tracing_mode="fake")(q, k, v)


def _visited_blocks(seq: int, rank: int, size: int) -> int:
    """Visited (query block, key block) pairs of a rank's two chunks, counted on the dense mask."""
    c = seq // (2 * size)
    total = 0
    for n_keys, offset in ((seq // 2, rank * c), (seq, (2 * size - 1 - rank) * c)):
        bq, bkv = _splash_blocks(c), _splash_blocks(n_keys)
        visible = (np.arange(n_keys)[None, :] <= offset + np.arange(c)[:, None]).reshape(c // bq, bq, -1, bkv)
        total += int(visible.any(axis=(1, 3)).sum()) * bq * bkv
    return total


@pytest.mark.parametrize("size", [2, 4])
def test_a_cp_programs_kernel_calls_are_priced(size):
    """Each rank's CP splash is priced from the blocks its two chunks visit: the dense mask's count
    here, and over all ranks exactly the one-device causal splash of the whole sequence (the chunks
    align with the blocks, so the ranks' visited blocks tile the causal grid)."""
    from tools.tpu_compile_capture import kernel_model

    seq = 8192
    per_rank = []
    for rank in range(size):
        cost = kernel_model(_cp_program(rank, size, seq), "v6e")
        assert set(cost) == {"splash_cp_fwd", "splash_cp_bwd"}, cost
        fwd, bwd = cost["splash_cp_fwd"], cost["splash_cp_bwd"]
        assert fwd["calls"] == 1 and bwd["calls"] == 1
        assert fwd["flops"] == 2.0 * B * HQ * _visited_blocks(seq, rank, size) * (D + DV)
        # the backward op: the forward again (the capture lowers it as the forward's VJP) and five matmuls
        assert bwd["flops"] == fwd["flops"] * ((D + DV) + (3 * D + 2 * DV)) / (D + DV)
        assert fwd["bytes"] > 0 and bwd["bytes"] == 4 * fwd["bytes"]
        per_rank.append(fwd["flops"])
    # the one-device causal grid of the whole sequence: n (n + 1) / 2 blocks of 512 x 512
    n = seq // 512
    assert sum(per_rank) == 2.0 * B * HQ * (n * (n + 1) // 2) * 512 * 512 * (D + DV)
    # the load balance of the early / late chunk layout: every rank within one block row of the mean
    assert max(per_rank) - min(per_rank) <= 2.0 * B * HQ * 512 * seq * (D + DV) / size


def test_the_sink_and_delta_rule_kernels_are_priced(installed):
    """gpt-oss's sink pair and Qwen 3.5's delta rule in the captured program carry the capture
    model's FLOPs (the sink backward takes the forward's residuals: no forward again)."""
    from tools.tpu_compile_capture import kernel_model

    def step(q, k, v, sinks, dq, dk, dv, g, beta):
        out = ops.sink_attention(q, k, v, sinks, torch.tensor(128), sliding_window=128)
        delta, _ = ops.gated_delta_rule(dq, dk, dv, g, beta)
        return torch.autograd.grad(out.float().sum() + delta.float().sum(), [q, k, v, sinks, dq, dk, dv, g, beta])

    s, h, dk, dv = 256, 4, 32, 64
    args = [
        torch.randn(B, HQ, s, D),
        torch.randn(B, HKV, s, D),
        torch.randn(B, HKV, s, D),
        torch.randn(HQ),
        torch.randn(B, s, h, dk),
        torch.randn(B, s, h, dk),
        torch.randn(B, s, h, dv),
        -torch.rand(B, s, h),
        torch.rand(B, s, h),
    ]
    cost = kernel_model(make_fx(step, tracing_mode="fake")(*[a.requires_grad_(True) for a in args]), "v6e")
    assert set(cost) == {"sink_fwd", "sink_bwd", "gated_delta_fwd", "gated_delta_bwd"}, cost
    n = s // 256  # one 256-block: the causal grid's (n + 1) / 2n = 1
    causal = 2.0 * B * HQ * s * s * (n + 1) / (2 * n)
    assert cost["sink_fwd"]["flops"] == causal * (D + D)
    assert cost["sink_bwd"]["flops"] == causal * (3 * D + 2 * D)
    assert cost["gated_delta_fwd"]["flops"] == capture.gated_delta_cost(B, h, s, dk, dv, backward=False)[0]
    assert cost["gated_delta_bwd"]["flops"] == capture.gated_delta_cost(B, h, s, dk, dv, backward=True)[0]


def test_tokens_per_device_count_a_cp_ranks_share():
    """llama3_8b_128k_v6e trains CP 4 on 131,072-token sequences: each device's program holds a
    quarter of each (32,768 tokens per sequence), where the report said 131,072."""
    import planner
    from tools import tpu_compile
    from trainer.config import build_config

    path = str(Path(__file__).resolve().parents[2] / "configs" / "llama3_8b_128k_v6e.toml")
    cfg = build_config(path, [])
    report = tpu_compile.ProgramCompile(recipe=path)
    tpu_compile._plan(report, cfg, planner.parse_target(cfg.job.target))
    t, cp = cfg.training, cfg.parallelism.context_parallel_degree
    assert cp == 4 and cfg.parallelism.tensor_parallel_degree == 1
    assert report.tokens_per_device == t.local_batch_size * t.seq_len * t.gradient_accumulation_steps // cp
