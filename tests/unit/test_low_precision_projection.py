"""scripts/bench/low_precision_projection.py: the quantized work of a pod recipe and the bytes per
quantized operand element taken from the compiled 8B block, against hand computation."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("lpp", ROOT / "scripts" / "bench" / "low_precision_projection.py")
lpp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lpp)


def test_llama3_405b_quantized_work_by_hand():
    """Llama 3 405B, 126 blocks of wq, wo [16384, 16384], wk, wv [1024, 16384], w1, w3 [53248,
    16384], w2 [16384, 53248]; full AC: 4 float8 matmuls per linear (forward twice, both
    gradients), 2 M N K FLOPs each, at M = 8192 tokens. The recipe gathers its float8_tensorwise
    weights in float8, so the quantized operands counted are the activations and gradients only
    (the weights arrive quantized)."""
    per_block = 2 * 16384 * 16384 + 2 * 1024 * 16384 + 3 * 53248 * 16384
    assert per_block == 3_187_671_040
    work = lpp.quantized_work(ROOT / "configs" / "llama3_405b_v7x_fp8.toml", 8192)
    assert work["recipe"] == lpp.W8
    assert work["linears"] == 126 * 7
    assert work["flops"] == 4 * 2 * 8192 * 126 * per_block
    # operand elements: forward x twice, input gradient dy, weight gradient (dy, x)
    m = 8192
    per_linear = lambda n, k: 2 * (m * k) + (m * n) + (m * n + m * k)  # noqa: E731
    shapes = [(16384, 16384)] * 2 + [(1024, 16384)] * 2 + [(53248, 16384)] * 2 + [(16384, 53248)]
    assert work["elements"] == 126 * sum(per_linear(n, k) for n, k in shapes)
    # the quantized weights' share of the parameters: all block linears; not the embedding, the
    # head (128256 x 16384 each) or the norms
    total = 126 * per_block + 2 * 128256 * 16384 + 126 * 2 * 16384 + 16384
    assert abs(work["quantized_param_share"] - 126 * per_block / total) < 1e-12


def test_float8_all_gather_fsdp_traffic():
    """Per quantized parameter and step the bf16 program gathers twice (2 bytes each) and reduces
    once (2 bytes, as compiled): 6 bytes; gathered in float8: 1 + 1 + 2 = 4."""
    assert abs(lpp.fsdp_traffic_ratio(1.0) - 4 / 6) < 1e-15
    assert lpp.fsdp_traffic_ratio(0.0) == 1.0
    assert abs(lpp.fsdp_traffic_ratio(0.99) - (1 - 0.99 * 2 / 6)) < 1e-15


def test_bytes_per_element_from_the_block_compile():
    """float8_rowwise on TPU7x: 20,398,735,360 - 16,169,611,264 bytes accessed over the operand elements of the
    block's 20 quantized dots (7 linears x 3 matmuls at 4096 tokens, w2's forward dropped): sum of
    M K 159,383,552, of N K 218,103,808, of M N 176,160,768, each twice, less w2's x and w."""
    m = 4096
    linears = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]
    elements = sum(2 * (m * k + n * k + m * n) for n, k in linears) - (m * 14336 + 4096 * 14336)
    assert elements == 2 * (159_383_552 + 218_103_808 + 176_160_768) - 117_440_512 == 989_855_744
    assert abs(lpp.bytes_per_element("float8_rowwise") - (20_398_735_360 - 16_169_611_264) / elements) < 1e-9
    # int8: the forward and the input gradient only
    int8_elements = sum((m * k + n * k) + (m * n + n * k) for n, k in linears) - (m * 14336 + 4096 * 14336)
    assert int8_elements == 654_311_424
    assert abs(lpp.bytes_per_element("int8") - (19_300_589_568 - 16_229_998_592) / int8_elements) < 1e-9
    # the float8 all-gather (W8): 16,914,961,408 bytes over the activation / gradient operands only
    w8_elements = sum(2 * (m * k + m * n) for n, k in linears) - m * 14336
    assert w8_elements == 2 * (159_383_552 + 176_160_768) - 58_720_256 == 612_368_384
    assert abs(lpp.bytes_per_element(lpp.W8) - (16_914_961_408 - 16_169_611_264) / w8_elements) < 1e-9


def test_qwen3_235b_routed_experts_are_counted():
    """Qwen3-235B-A22B: 94 MoE layers of 128 experts (dim 4096, hidden 1536), top 8, capacity
    1.125 (the recipe's since 2026-12-07), EP 16 (8 local experts); the recipe quantizes the routed
    experts: per layer 3 matmuls (w1, w3, w2) x 4 (forward twice under full AC, both gradients) x 2
    x rows x 4096 x 1536 at rows = tokens x 8 x 1.125, and their weight operands are the 8 local
    experts' [1536, 4096]."""
    tokens = 4096
    rows = tokens * 8 * 1.125
    work = lpp.quantized_work(ROOT / "configs" / "qwen3_235b_a22b_v7x_fp8.toml", tokens)
    assert work["expert_flops"] == 94 * 3 * 4 * 2 * rows * 4096 * 1536
    m = round(rows)
    per_matrix = lambda n, k: 2 * (m * k + 8 * n * k) + (m * n + 8 * n * k) + (m * n + m * k)  # noqa: E731
    per_layer_experts = 2 * per_matrix(1536, 4096) + per_matrix(4096, 1536)
    # the quantized attention linears (wq [8192, 4096], wo [4096, 8192]) at `tokens`
    per_linear = lambda n, k: 2 * (tokens * k + n * k) + (tokens * n + n * k) + (tokens * n + tokens * k)  # noqa: E731
    assert work["elements"] == 94 * (per_layer_experts + per_linear(8192, 4096) + per_linear(4096, 8192))


def test_the_row_sets_both_programs_side_by_side(monkeypatch):
    """`program_row_of`: the speed-up is the parent's predicted step over the low-precision one's (the
    same tokens per device), tokens/s per chip the device's tokens x 2 devices per v7x chip over the
    step; the MoE recipes are read at random routing (as MaxText published both of its runs), the
    dense ones at none; the markdown row carries the speed-up and MaxText's published ratio."""
    from types import SimpleNamespace

    seen = []

    def side(name, overrides, *, anchors, ns, caches):
        seen.append((name, overrides))
        step = 20.0 if name.endswith("_fp8") else 36.0
        return {
            "step_scheduled_s": step,
            "tokens": 8192,
            "devices": 512,
            "chips": 256,
            "mfu_causal_scheduled": 50.0 * 36.0 / step,
            "mfu_palm_scheduled": 52.0 * 36.0 / step,
            "sched_compute_s": step - 0.5,
            "exposed_comm_s": 0.5,
            "dot_tflop": 24.5e3,
            "low_precision_dot_share": 1.0 if name.endswith("_fp8") else 0.0,
            "dot_flops_by_type": "",
            "dot_ops_s": step - 5.0,
            "other_xla_s": 2.0,
            "cache": "outputs/x",
        }

    monkeypatch.setattr(lpp, "program_side", side)
    monkeypatch.setattr(lpp, "project", lambda *a: {"speedup_exposed": 1.54, "speedup_overlapped": 1.56})
    # MaxText's two 405B programs as the calibration table has them: 105.72 and 60.10 s at 24,576 tokens
    mt = {
        "llama3.1-405b_v7x-512": {"step_s": "105.7178", "tokens_per_device": "24576.0", "error_pct": "-7.0"},
        "llama3.1-405b-fp8_v7x-512": {"step_s": "60.1017", "tokens_per_device": "24576.0", "error_pct": "7.1"},
    }
    ns = SimpleNamespace(cache=None, parent_cache=None, maxtext=mt)
    row = lpp.program_row_of("llama3_405b_v7x_fp8", "llama3_405b_v7x", None, (499.8, 763.5), anchors={}, ns=ns)
    assert seen == [("llama3_405b_v7x_fp8", ()), ("llama3_405b_v7x", ())]
    assert row["speedup"] == 36.0 / 20.0
    assert row["tokens_per_chip_lp"] == 8192 * 2 / 20.0 and row["tokens_per_chip_bf16"] == 8192 * 2 / 36.0
    assert abs(row["maxtext_ratio"] - 763.5 / 499.8) < 1e-12 and "analytic_speedup_exposed" not in row
    # calibrated: ours x MaxText's published ratio / its predicted one (105.7178 / 60.1017 = 1.759)
    assert abs(row["maxtext_predicted_ratio"] - 105.7178 / 60.1017) < 1e-12
    assert abs(row["calibrated_speedup"] - 1.8 * (763.5 / 499.8) / (105.7178 / 60.1017)) < 1e-12
    # per token against MaxText's FP8 program: 60.1017 / 24576 over 20 / 8192 (ours slower: < 1)
    assert abs(row["ratio_to_maxtext_fp8"] - (60.1017 / 24576) / (20.0 / 8192)) < 1e-12
    assert abs(row["calibrated_tokens_per_chip_lp"] - 763.5 * row["ratio_to_maxtext_fp8"]) < 1e-9
    assert lpp.routing("qwen3_235b_a22b_v7x_fp8") == lpp.RANDOM == lpp.routing("deepseek_v3_671b_v7x_fp8")
    assert lpp.routing("llama3_70b_v6e_int8") == ()
    line = lpp.markdown([row], ["h"]).splitlines()[-1]
    assert (
        "| 36.00 | 20.00 | **1.80x**; calibrated **1.56x** (MaxText's two programs predicted 1.76x) | 1.53x |" in line
        and "| 31.00 / 2.00 / 2.50 -> 15.00 / 2.00 / 2.50 |" in line
    )
