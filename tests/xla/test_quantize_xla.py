"""The TPU path of `[quantize]` (titan_kernels/tpu/qmatmul.py, qlinear.py) without a TPU.

Probes (tests/xla/probes/quantize_xla.py), each in its venv:
- xla venv: the JAX recipe table equals the torch emulation's, and XLA:CPU runs of the forward
  and both gradients equal the torch emulation (models/common/quantize.py) for every recipe.
  Both quantize identically (same scales, clamp, round-half-to-even), so they differ only in the
  order of float32 sums: |jax - torch| <= 2 n u max|torch|, n the matmul's contraction length,
  u = 2^-24 (the bound of tests/xla/test_kernels.py). A wrong scale, rounding or recipe costs
  O(2^-4) of scale.
- ttpu venv: torch-tpu's `jax_op` defines `titan_tpu::qlinear_fwd / _bwd` and, on fake tensors,
  the forward op with its autograd gives the right shapes and dtypes for every recipe.
- tpuc venv: a decoder block (forward and gradients, bf16) with quantized linears compiles for
  TPU7x (float8_rowwise) and v6e (int8) without a TPU, and the compiled program's dots are
  float8 x float8 -> f32 and s8 x s8 -> s32: the low-precision dots reach XLA:TPU's compiler and
  stay there. The recipe-width compile against bf16 is in docs/low_precision.md.
- xla venv (`grouped`): the MoE experts' op (titan_kernels/tpu/qgmm.py, ragged dots) on XLA:CPU
  against `emulated_grouped_mm`, unequal and empty experts, rows past the sum.
- tpuc venv (`compile_grouped`): that op compiles for TPU7x / v6e to float8 / int8 ragged dots.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xla

U_FP32 = 2.0**-24
RECIPES = ("float8_tensorwise", "float8_rowwise", "float8_blockwise", "int8")


def test_xla_cpu_equals_the_torch_emulation(probe):
    """Every recipe, and float8_tensorwise with the weight arriving quantized (the float8
    all-gather: qmatmul.forward_w8 / backward_w8 on the float8 weight and its scale, against the
    emulation on the same values), within fp32 summation order."""
    result = probe("xla", "quantize_xla.py", "cpu")
    assert result["tables_equal"], "titan_kernels/tpu/qmatmul.py RECIPES differs from RECIPE_SPECS"
    assert set(result["cases"]) == {*RECIPES, "float8_tensorwise_w8"}
    for recipe, outputs in result["cases"].items():
        for name, out in outputs.items():
            assert out["scale"] > 0, (recipe, name)
            assert out["diff"] <= 2 * out["n"] * U_FP32 * out["scale"], (recipe, name, out)


def test_grouped_xla_cpu_equals_the_torch_emulation(probe):
    """titan_kernels/tpu/qgmm.py (`quantized_grouped_mm` on TPU: ragged dots) on XLA:CPU against
    `emulated_grouped_mm`, experts of 37, 0, 150 and 61 rows (+12 rows past the sum), expert 0's
    tokens x 1000. Both quantize the same scale groups identically, so they differ by the order of
    float32 sums, 2 n u max|torch| (n: K, N, the expert's tokens), plus whatever the dense JAX op
    (qmatmul, each expert's rows alone) already differs from the emulation by on the same data:
    XLA:CPU can round a value lying exactly on a float8 tie to the other neighbour inside a fused
    quantization (one e4m3 step of one operand element; blockwise dx here), a dense-op matter
    the grouped op inherits and must not add to. Weight gradients get no such allowance (their
    blockwise token tiles are global, cut at the experts' boundaries, not the dense op's)."""
    result = probe("xla", "quantize_xla.py", "grouped")
    assert set(result["cases"]) == set(RECIPES)
    for recipe, case in result["cases"].items():
        assert case["empty_expert_dw_zero"] and case["rows_past_sum_zero"], (recipe, case)
        assert case["custom_vjp_diff"] <= 2 * 300 * U_FP32, (recipe, case["custom_vjp_diff"])
        assert set(case["outputs"]) == {"y", "dx", "dw0", "dw2", "dw3"}
        for name, out in case["outputs"].items():
            assert out["scale"] > 0, (recipe, name)
            inherited = out["dense_diff"] if name in ("y", "dx") else 0.0
            assert out["diff"] <= 2 * out["n"] * U_FP32 * out["scale"] + inherited, (recipe, name, out)


def test_the_grouped_op_compiles_to_float8_ragged_dots_on_v7x_and_int8_on_v6e(probe):
    """qgmm.grouped_mm (forward output and both gradients, 8 experts, bf16, group sizes a runtime
    array) compiled by XLA:TPU without a TPU: the forward and input-gradient matmuls reach the
    compiled program as XLA:TPU's ragged-dot kernels on float8 (v7x: float8_rowwise, tensorwise,
    blockwise) and int8 (v6e) operands, and the weight gradient as one float8 dot over the
    experts' segments; int8's weight gradient stays bf16 (the recipe's). Nothing else multiplies
    in high precision. float8_rowwise's dots write bf16 (its scales are powers of two, so
    rounding before them is exact: qgmm `_accumulator`) and no float32 value of the tokens' rows
    reaches memory: neither a dot's float32 product nor the scales gathered to every row
    (qgmm `row_lookup`), which held 2.5 GiB per expert matmul's backward at the 235B's shapes."""
    result = probe(
        "tpuc",
        "quantize_xla.py",
        "compile_grouped",
        "v7x:float8_rowwise",
        "v6e:int8",
        "v7x:float8_tensorwise",
        "v7x:float8_blockwise",
        "--tokens=1024",
    )
    fp8, int8 = result["compiles"]["v7x:float8_rowwise"], result["compiles"]["v6e:int8"]
    assert all("error" not in c for c in result["compiles"].values()), result
    # tensorwise: e5m2 gradients; blockwise: one ragged dot per 128-wide K tile (K 512: 4 forward,
    # N 256: 2 input-gradient), the weight gradient one float8 dot
    assert result["compiles"]["v7x:float8_tensorwise"]["matmuls"] == {
        "ragged-dot: f8e4m3fn x f8e4m3fn -> f32": 1,
        "ragged-dot: f8e5m2 x f8e4m3fn -> f32": 1,
        "convolution: f8e5m2 x f8e4m3fn -> f32": 1,
    }, result
    assert result["compiles"]["v7x:float8_blockwise"]["matmuls"] == {
        "ragged-dot: f8e4m3fn x f8e4m3fn -> f32": 6,
        "convolution: f8e4m3fn x f8e4m3fn -> f32": 1,
    }, result
    assert fp8["matmuls"] == {
        "ragged-dot: f8e4m3fn x f8e4m3fn -> bf16": 2,
        "convolution: f8e4m3fn x f8e4m3fn -> bf16": 1,
    }, fp8
    assert fp8["wide_token_values"] == [], fp8
    assert int8["matmuls"] == {"ragged-dot: s8 x s8 -> s32": 2, "convolution: bf16 x bf16 -> bf16": 1}, int8


def test_torch_tpu_registers_the_ops_with_autograd(probe):
    """torch-tpu's `jax_op` defines the dense, grouped (MoE experts) and float8-weight ops; on fake
    tensors each runs forward and backward with the right shapes and dtypes: the dense and grouped
    ops through their registered autograd for every recipe, the float8-weight op (a float8_e4m3fn
    weight and its scale) directly and through the autograd.Function that sends the weight
    gradient to the gather's carrier."""
    result = probe("ttpu", "quantize_xla.py", "register")
    assert result["ops"] == ["qgmm_bwd", "qgmm_fwd", "qlinear_bwd", "qlinear_fwd", "qlinear_w8_bwd", "qlinear_w8_fwd"]
    expected = {
        **{r: "ok" for r in RECIPES},
        **{f"grouped:{r}": "ok" for r in RECIPES},
        "w8_ops": "ok",
        "w8_autograd": "ok",
    }
    assert result["checks"] == expected, result["checks"]


def test_the_block_compiles_to_float8_dots_on_v7x_and_int8_dots_on_v6e(probe):
    result = probe(
        "tpuc",
        "quantize_xla.py",
        "compile",
        "v7x:float8_rowwise",
        "v6e:int8",
        "--small",
        "--no-baseline",
        "--tokens=512",
        "--seq=256",
    )
    fp8, int8 = result["compiles"]["v7x:float8_rowwise"], result["compiles"]["v6e:int8"]
    assert "error" not in fp8 and "error" not in int8, result
    # 7 linears x 3 matmuls, less the last linear's forward (dead: the block's output is not
    # returned, only its gradients): 20 float8 dots; int8 quantizes 2 of the 3: 13.
    assert fp8["dots"].get("f8e4m3fn x f8e4m3fn -> f32") == 20, fp8["dots"]
    assert int8["dots"].get("s8 x s8 -> s32") == 13, int8["dots"]
    # The rest are attention's six and int8's seven weight gradients in bf16: nothing else
    # was left in high precision.
    assert sum(fp8["dots"].values()) == 26 and sum(int8["dots"].values()) == 26


def test_the_float8_gathered_weight_compiles_without_a_weight_pass_on_v7x(probe):
    """The block with float8_tensorwise weights arriving as the float8 all-gather delivers them
    (float8_e4m3fn and a scale) against the same block quantizing bf16 weights in the op, both for
    TPU7x: the same 20 float8 dots, and fewer bytes accessed (no amax, scale or cast pass over any
    weight: measured at these widths 113.3 MB against 138.6 MB, bf16 112.2 MB; at the 8B block's
    widths 16.91 GB against 19.71 GB, bf16 16.17 GB, docs/low_precision.md)."""
    result = probe(
        "tpuc",
        "quantize_xla.py",
        "compile",
        "v7x:float8_tensorwise_w8",
        "v7x:float8_tensorwise",
        "--small",
        "--no-baseline",
        "--tokens=512",
        "--seq=256",
    )
    w8, op = result["compiles"]["v7x:float8_tensorwise_w8"], result["compiles"]["v7x:float8_tensorwise"]
    assert "error" not in w8 and "error" not in op, result
    f8 = {k: v for k, v in w8["dots"].items() if k.startswith("f8")}
    assert sum(f8.values()) == 20 and f8 == {k: v for k, v in op["dots"].items() if k.startswith("f8")}, (w8, op)
    assert w8["cost"]["bytes accessed"] < 0.9 * op["cost"]["bytes accessed"], (w8["cost"], op["cost"])
