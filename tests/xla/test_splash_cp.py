"""Splash attention for context parallelism (titan_kernels/tpu/splash.py `splash_cp_attention`).

Two probes (tests/xla/probes/splash_cp.py): the kernels in Pallas' interpreter against the dense
reference (xla venv), and deviceless XLA:TPU compiles of an attention sublayer in a shard_map over
a `cp` mesh axis (ttpu venv: libtpu 0.0.52, the one torch-tpu runs), whose program must hold the
k/v all-gathers, their transposes (reduce-scatters) and the Mosaic splash calls.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xla

U_FP32 = 2.0**-24

# name:topology:cp:seq:dim:heads:kv_heads:head_dim -- small sublayers (seconds to compile).
SMALL = ("cp2:v6e:2x2:2:4096:512:4:2:128", "cp4:v6e:2x2:4:8192:512:4:2:128")


@pytest.fixture(scope="module")
def interpreted(probe):
    return probe("xla", "splash_cp.py", "interpret")


@pytest.fixture(scope="module")
def compiled(probe):
    return {row["case"]: row for row in probe("ttpu", "splash_cp.py", "compile", *SMALL)["compiles"]}


def test_interpreted_cp_splash_matches_the_dense_reference(interpreted):
    """Every rank of cp 2 and 4, with and without document segments, float32 in the interpreter
    against the float64 dense reference of the same rows (`cp_reference`).

    Bound: each output is a softmax-weighted sum over at most n keys of d-long dot products;
    float32 rounding of those reductions and of the online softmax's rescaling is at most about
    (n + d) u relative to the largest value, with a factor 8 for the backward's extra products
    (dS = P (dP - D), dq = dS k, dk = dS^T q) -- the bound tests/xla/test_kernels.py uses for the
    non-CP splash. A wrong causal offset (one chunk off) or a wrong gathered-key range gives
    errors of the order of the values themselves, far above it."""
    assert len(interpreted["cases"]) == 2 * (2 + 4)
    for case in interpreted["cases"]:
        bound = 8 * (case["n"] + case["d"]) * U_FP32
        for name, r in case["outputs"].items():
            assert r["err"] <= bound * r["scale"], f"{case['case']} {name}: {r['err']:.3g} > {bound * r['scale']:.3g}"


def test_the_ranks_rows_in_global_order_are_the_causal_attention(interpreted):
    """The cp ranks' outputs, put back in global order (early chunks in rank order, late chunks in
    reverse), equal the single-device causal attention (`splash.reference`, float32) of the
    whole sequence: the layout and the per-rank offsets together cover every row once."""
    for case, r in interpreted["global"].items():
        n = int(case.split("_s")[1].split("_")[0])
        assert r["err"] <= 8 * (n + 128) * U_FP32 * r["scale"], f"{case}: {r}"


def test_deviceless_compile_has_the_cp_collectives_and_the_mosaic_splash(compiled):
    """The per-device program of a CP attention sublayer (forward + backward) for v6e: the k and v
    all-gathers over cp and their transposes (reduce-scatters of dk, dv) in the program, and the
    Mosaic splash kernels: per rank branch, 2 chunks x (forward, dq, dkv) = 6 calls. Arguments
    per device: the local x and cotangent [1, s/cp, dim] plus the four projection weights, bf16."""
    for spec in SMALL:
        name, _, _, cp, seq, dim, heads, kv_heads, head_dim = spec.split(":")
        cp, seq, dim, heads, kv_heads, head_dim = map(int, (cp, seq, dim, heads, kv_heads, head_dim))
        row = compiled[name]
        assert "error" not in row, row.get("error")
        assert row["stablehlo_all_gather"] == 2 and row["stablehlo_reduce_scatter"] == 2, row
        # The compiler keeps the all-gathers; it may schedule a reduce-scatter as an all-reduce
        # (it did at 128k on v6e). Where the compiled text cannot be printed, the StableHLO counts.
        assert row["counted_in"] != "compiled HLO" or (
            row["all_gather"] >= 2 and row["reduce_scatter"] + row["all_reduce"] >= 2
        ), row
        assert row["mosaic_calls"] == 6 * cp, row
        weights = 2 * dim * heads * head_dim + 2 * dim * kv_heads * head_dim
        assert row["argument_size_in_bytes"] == 2 * (2 * seq // cp * dim + weights), row
