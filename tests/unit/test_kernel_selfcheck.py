"""The TPU kernels' start-up self-check, the JAX platform pin and the tile rule, on the CPU.

titan_kernels/tpu/selfcheck.py decides, per op, whether a kernel may serve the run: it runs the
implementation and the op's torch reference on tiny inputs and compares. Here the
implementations are injected torch functions (no jax, no torch-tpu in this process): one that
agrees as a bf16 kernel would (an independent formula computed in bf16), one that raises, and
ones that disagree the way kernel bugs do (no causal mask, a shifted group, a missing ignore
mask, a non-finite value). titan_kernels/tpu/tiles.py is pure Python; its rule is checked against the
VMEM facts it encodes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import titan_kernels
from models.common import gated_delta, ops
from models.gpt_oss.args import FLAVORS as GPT_OSS_FLAVORS
from titan_kernels.tpu import pin_jax_platform, selfcheck, tiles

GPT_OSS_DEBUG = GPT_OSS_FLAVORS["debugmodel"]

BF16 = torch.bfloat16


# --- independent implementations, computed in the inputs' dtype (bf16), like a kernel -----------


def attention_bf16(q, k, v, segment_ids=None, *, causal=True):
    group = q.shape[1] // k.shape[1]
    k, v = ops.repeat_kv(k, group), ops.repeat_kv(v, group)
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)  # bf16 operands, as the MXU takes them
    s = q.shape[2]
    mask = torch.ones(s, s, dtype=torch.bool).tril() if causal else torch.ones(s, s, dtype=torch.bool)
    mask = mask[None, None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    p = torch.softmax(scores.float().masked_fill(~mask, float("-inf")), dim=-1).to(q.dtype)
    return p @ v


def grouped_bf16(x, w, group_sizes, *, shift=0):
    ends = torch.cumsum(group_sizes, 0).tolist()
    starts = [0] + ends[:-1]
    out = []
    for g, (a, b) in enumerate(zip(starts, ends)):
        out.append(x[a:b] @ w[(g + shift) % w.shape[0]])
    return torch.cat(out)


def ce_bf16(h, w, labels, *, ignore=True):
    logits = F.linear(h, w).float()
    if not ignore:
        labels = labels.clamp(min=0)
    return F.cross_entropy(logits, labels, ignore_index=ops.IGNORE_INDEX)


def full_attention_bf16(q, k, v):
    return attention_bf16(q, k, v, causal=False)


def full_attention_seeing_padding_bf16(q, k, v):
    """The full-mask bug padding invites: keys zero-padded to splash's tile (128) and seen."""
    pad = (-q.shape[2]) % 128
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    return attention_bf16(q, k, v, causal=False)[:, :, : q.shape[2] - pad]


def sink_attention_bf16(q, k, v, sinks, window, segment_ids=None, sliding_window=0):
    """softmax over [scores | sink] with the sink column dropped, bf16 operands (as splash)."""
    group = q.shape[1] // k.shape[1]
    k, v = ops.repeat_kv(k, group), ops.repeat_kv(v, group)
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
    i, j = torch.arange(q.shape[2])[:, None], torch.arange(q.shape[2])[None, :]
    mask = ((j <= i) & ((window <= 0) | (i - j < window)))[None, None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    logits = scores.float().masked_fill(~mask, float("-inf"))
    sink = sinks.float()[None, :, None, None].expand(*logits.shape[:3], 1)
    p = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1].to(q.dtype)
    return p @ v


AGREEING = {
    "causal_attention": attention_bf16,
    "attention": full_attention_bf16,
    "sink_attention": sink_attention_bf16,
    "grouped_mm": grouped_bf16,
    "linear_cross_entropy": ce_bf16,
    # The token-by-token recurrence (an independent formula; float32 inside, output in the inputs' dtype).
    "gated_delta_rule": lambda *a, chunk_size=64, **kw: gated_delta.recurrent_gated_delta_rule(*a, **kw),
}
DISAGREEING = {
    "causal_attention": lambda q, k, v, seg=None: attention_bf16(q, k, v, seg, causal=False),
    "attention": lambda q, k, v: attention_bf16(q, k, v, causal=True),
    "sink_attention": lambda q, k, v, sinks, window, *rest: sink_attention_bf16(q, k, v, sinks, 0, *rest),
    "grouped_mm": lambda x, w, sizes: grouped_bf16(x, w, sizes, shift=1),
    "linear_cross_entropy": lambda h, w, labels: ce_bf16(h, w, labels, ignore=False),
    # The documents' resets ignored: the state crosses document boundaries.
    "gated_delta_rule": lambda *a, chunk_size=64, reset=None, **kw: gated_delta.recurrent_gated_delta_rule(*a, **kw),
}


def _raises(*args, **kwargs):
    raise RuntimeError("Mosaic failed to compile the kernel\nsecond line of a long error")


CPU = torch.device("cpu")


@pytest.mark.parametrize("op", ops.OPS)
def test_a_kernel_that_agrees_in_bf16_passes_within_the_argued_tolerance(op):
    verdict = selfcheck.check(op, AGREEING[op], device=CPU, dtype=BF16, head_dim=64)
    assert verdict.ok, verdict
    # bf16 rounding is seen (the check compares something), and sits well below the tolerance.
    assert 0 < verdict.worst < selfcheck.TOLERANCE / 2, verdict


@pytest.mark.parametrize("op", ops.OPS)
def test_the_reference_itself_agrees_exactly_in_float32(op):
    verdict = selfcheck.check(op, selfcheck.REFERENCES[op], device=CPU, dtype=torch.float32)
    assert verdict.ok and verdict.worst < 1e-5, verdict


@pytest.mark.parametrize("op", ops.OPS)
def test_a_kernel_that_raises_is_dropped_with_its_error(op):
    verdict = selfcheck.check(op, _raises, device=CPU, dtype=BF16)
    assert not verdict.ok
    assert "raised RuntimeError: Mosaic failed to compile the kernel" in verdict.reason
    assert "second line" not in verdict.reason
    line = selfcheck.banner(verdict)
    assert "\n" not in line and selfcheck.KERNEL_NAMES[op] in line and op in line, line


@pytest.mark.parametrize("op", ops.OPS)
def test_a_kernel_that_disagrees_is_dropped_with_the_numbers(op):
    verdict = selfcheck.check(op, DISAGREEING[op], device=CPU, dtype=BF16)
    assert not verdict.ok, verdict
    assert "differs from the reference" in verdict.reason and verdict.worst > selfcheck.TOLERANCE, verdict


def test_a_sink_kernel_that_drops_the_sinks_or_the_window_is_dropped():
    """The sink splash's two ways to be wrong: sinks not in the softmax (a logit of -30 is no sink)
    and the causal mask where the window was asked (a scan's window picking the wrong kernel)."""
    shapes = selfcheck.KernelShapes(qk_head_dim=64, v_head_dim=64, sliding_window=32)
    (window_case, full_case) = selfcheck.cases("sink_attention", dtype=BF16, shapes=shapes)
    assert int(window_case.args[4]) == 32 and int(full_case.args[4]) == 0 and full_case.args[5] is not None
    no_sinks = lambda q, k, v, sinks, *rest: sink_attention_bf16(q, k, v, sinks * 0 - 30, *rest)  # noqa: E731
    verdict = selfcheck.check("sink_attention", no_sinks, device=CPU, dtype=BF16, shapes=shapes)
    assert not verdict.ok and "differs from the reference" in verdict.reason, verdict
    good = selfcheck.check("sink_attention", sink_attention_bf16, device=CPU, dtype=BF16, shapes=shapes)
    assert good.ok and 0 < good.worst < selfcheck.TOLERANCE / 2, good
    assert good.checked == "head 64, window 32 and full"


def test_select_on_tpu_checks_the_sink_splash_only_for_a_model_with_a_window(monkeypatch):
    """gpt-oss / DeepSeek-V4 (`KernelShapes.sliding_window` from their args): the sink splash is
    checked at the run's window and serves the op; a model without one never calls the op, so
    nothing is built or checked for it; `sdpa` keeps the reference."""
    from titan_kernels import tpu

    monkeypatch.setattr(tpu, "load", lambda: {"sink_attention": sink_attention_bf16})
    monkeypatch.setattr(tpu, "saved_ops", lambda: [])
    monkeypatch.setattr(tpu, "compile_checker", lambda shapes, attached=False: lambda op: None)
    gpt_oss = selfcheck.KernelShapes.of(GPT_OSS_DEBUG)
    assert gpt_oss.sliding_window == GPT_OSS_DEBUG.sliding_window > 0
    try:
        line = titan_kernels._select_tpu("auto", device=CPU, dtype=BF16, head_dim=None, shapes=gpt_oss)
        assert ops.implementation("sink_attention") is sink_attention_bf16
        assert "sink splash" in line and "self-check passed" in line, line
        for backend, shapes in (("auto", selfcheck.KernelShapes()), ("sdpa", gpt_oss)):
            line = titan_kernels._select_tpu(backend, device=CPU, dtype=BF16, head_dim=None, shapes=shapes)
            assert ops.implementation("sink_attention") is ops.sdpa_sink_attention, backend
            assert "sink splash" not in line, line
    finally:
        ops.register("sink_attention", None)


def test_full_attention_that_lets_real_queries_see_padded_keys_is_dropped():
    # The self-check's 200 tokens are not a multiple of splash's tile: a full-mask kernel whose
    # padded keys stay visible (zero keys: a weight of exp(0) each) fails; one that hides them passes.
    (case,) = selfcheck.cases("attention")
    assert case.args[0].shape[2] % 128 != 0
    verdict = selfcheck.check("attention", full_attention_seeing_padding_bf16, device=CPU, dtype=BF16)
    assert not verdict.ok and "differs from the reference" in verdict.reason, verdict


def test_a_wrong_scale_just_above_the_tolerance_is_caught_and_just_below_is_not():
    # The bound is relative to the output's magnitude: a kernel off by 2x the tolerance fails,
    # one off by half of it (plus bf16 rounding) passes. Guards the comparison's arithmetic.
    def scaled(factor):
        return lambda h, w, labels: ce_bf16(h, w, labels) * factor

    assert not selfcheck.check("linear_cross_entropy", scaled(1 + 2 * selfcheck.TOLERANCE), device=CPU, dtype=BF16).ok
    assert selfcheck.check("linear_cross_entropy", scaled(1 + selfcheck.TOLERANCE / 4), device=CPU, dtype=BF16).ok


def test_non_finite_output_is_dropped():
    verdict = selfcheck.check(
        "grouped_mm", lambda x, w, s: grouped_bf16(x, w, s) * float("nan"), device=CPU, dtype=BF16
    )
    assert not verdict.ok and "not finite" in verdict.reason


def test_select_registers_only_the_kernels_that_passed_and_prints_one_line_per_failure(capsys):
    impls = {
        "causal_attention": AGREEING["causal_attention"],
        "grouped_mm": _raises,
        "linear_cross_entropy": DISAGREEING["linear_cross_entropy"],
    }
    saved = {op: ops.register(op, None) for op in ops.OPS}
    try:
        passed, verdicts = selfcheck.run(impls, device=CPU, dtype=BF16, head_dim=32)
        assert set(passed) == {"causal_attention"}
        line = titan_kernels._register_tpu("auto", passed, verdicts, saved=[])
        assert ops.implementation("causal_attention") is impls["causal_attention"]
        assert ops.implementation("grouped_mm") is ops.torch_grouped_mm  # the reference
        assert ops.implementation("linear_cross_entropy") is ops.chunked_linear_cross_entropy
    finally:
        for op, fn in saved.items():
            ops.register(op, fn)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2, err
    assert err[0].startswith("titan-tpu: kernel self-check: gmm (grouped_mm) failed") and "RuntimeError" in err[0]
    assert err[1].startswith("titan-tpu: kernel self-check: fused CE (linear_cross_entropy) failed")
    assert line.startswith("splash (") and "self-check failed: gmm, fused CE" in line, line


def test_splash_failing_its_check_falls_back_to_sdpa_even_when_asked_for(capsys):
    saved = {op: ops.register(op, None) for op in ops.OPS}
    try:
        passed, verdicts = selfcheck.run({"causal_attention": _raises}, device=CPU, dtype=BF16)
        line = titan_kernels._register_tpu("splash", passed, verdicts, saved=[])
        assert ops.implementation("causal_attention") is ops.sdpa_causal_attention
    finally:
        for op, fn in saved.items():
            ops.register(op, fn)
    assert line.startswith("sdpa (") and "splash" in line
    assert "splash (causal_attention) failed" in capsys.readouterr().err


# --- the JAX platform pin (nothing of jax is imported here) -------------------------------------


def test_jax_is_pinned_to_the_cpu_unless_the_user_chose(monkeypatch):
    assert "jax" not in sys.modules
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    assert pin_jax_platform() is None and os.environ["JAX_PLATFORMS"] == "cpu"
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert pin_jax_platform() is None
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    warning = pin_jax_platform()
    assert os.environ["JAX_PLATFORMS"] == "tpu"  # the user's explicit choice stands
    assert warning and "JAX_PLATFORMS='tpu'" in warning and "\n" not in warning


# --- tiles per generation ------------------------------------------------------------------------

# Expert shapes of the MoE recipes (k x n of each projection) at 65,536 token copies, 128
# experts; the loss heads of Llama 3 8B / 70B and Qwen 3 (dim, vocab).
GMM_SHAPES = [(2048, 768), (768, 2048), (4096, 1536), (1536, 4096)]
CE_SHAPES = [(4096, 128256), (8192, 128256), (5120, 151936)]


def test_the_table_names_every_generation_and_parses():
    table = tiles.load_table()
    for kernel in ("gmm", "fused_ce"):
        assert set(table[kernel]) == {*tiles.GENERATIONS, "unknown"}


@pytest.mark.parametrize("gen", [*tiles.GENERATIONS, None])
def test_gmm_tiles_fit_the_scoped_vmem_and_divide_the_weight(gen):
    limit = tiles.hardware(gen).scoped_vmem_bytes
    for k, n in GMM_SHAPES:
        tm, tk, tn = tiles.gmm_tiles(gen, 65536, k, n, 128)
        assert tiles.gmm_vmem_bytes(tm, tk, tn) <= tiles.BUDGET_FRACTION * limit, (gen, k, n, tm, tk, tn)
        assert k % tk == 0 and n % tn == 0 and tm % 8 == 0 and tm >= 128
        # The backward's dx call has K and N swapped; its tiles fit too.
        assert tiles.gmm_vmem_bytes(tm, *tiles.gmm_kn_tiles(gen, tm, n, k)) <= tiles.BUDGET_FRACTION * limit


def test_gmm_tiles_grow_with_the_generation_and_beat_the_old_ones_on_the_roofline():
    old = (128, 512, 256)  # what gmm.py used for 2048 x 768 before the table
    for gen in tiles.GENERATIONS:
        new = tiles.gmm_tiles(gen, 65536, 2048, 768, 128)
        ridge = tiles.hardware(gen).ridge
        assert tiles.gmm_cost(*new, 65536, 2048, 128, ridge) < tiles.gmm_cost(*old, 65536, 2048, 128, ridge), gen
    # Memory-bound (v6e's high ridge point): the largest row tile. On a chip with a low ridge
    # point (v5p, compute-bound sooner) with many groups, the rows wasted in tiles that straddle
    # group boundaries pull it down.
    # (The rule's choice: the table's compiled-cost entry for this class on v6e is dropped here.)
    rule = {**tiles.load_table(), "gmm": {**tiles.load_table()["gmm"], "v6e": {"default": [512, 1024, 2048]}}}
    assert tiles.gmm_tiles("v6e", 65536, 2048, 768, 8, table=rule)[0] == 512
    assert tiles.gmm_tiles("v5p", 65536, 2048, 768, 128)[0] == 256


@pytest.mark.parametrize("gen", [*tiles.GENERATIONS, None])
def test_loss_blocks_fit_their_vmem_limit_and_the_limit_fits_the_chip(gen):
    limit = tiles.ce_vmem_limit(gen)
    assert limit <= tiles.hardware(gen).vmem_bytes
    for dim, vocab in CE_SHAPES:
        bn, bv = tiles.ce_blocks(gen, 8192, vocab, dim)
        assert bn >= 128 and bv >= 128
        fits = tiles.ce_vmem_bytes(bn, bv, dim) <= tiles.BUDGET_FRACTION * limit
        # The kernel keeps whole rows of h (and of its f32 gradient) in VMEM: at dim 8192 even
        # 128 x 128 blocks need ~16 MiB, all of v4's VMEM. There the start-up self-check (a
        # failed compile) hands the loss to the torch reference; everywhere else the rule fits.
        assert fits == (dim < 8192 or tiles.hardware(gen).vmem_bytes > 16 * tiles.MiB), (gen, dim, bn, bv)


def test_v4_gets_smaller_loss_blocks_than_v6e():
    # The old fixed 48 MiB assumption was wrong for v4 (16 MiB of VMEM).
    assert tiles.ce_vmem_limit("v4") == 16 * tiles.MiB
    v4, v6e = tiles.ce_blocks("v4", 8192, 128256, 4096), tiles.ce_blocks("v6e", 8192, 128256, 4096)
    assert v4[0] * v4[1] < v6e[0] * v6e[1], (v4, v6e)


@pytest.mark.parametrize(
    "kind,gen",
    [
        ("TPU v4", "v4"),
        ("TPU v5 lite", "v5e"),
        ("TPU v5", "v5p"),
        ("v5litepod-16", "v5e"),
        ("TPU v6 lite", "v6e"),
        ("v6e-8", "v6e"),
        ("TPU7x", "v7x"),
        ("tpu7x-64", "v7x"),
        ("TPU", None),
        ("", None),
    ],
)
def test_generation_from_device_kind(kind, gen):
    assert tiles.generation_of(kind) == gen


def test_detect_generation_reads_the_accelerator_type(monkeypatch):
    monkeypatch.delenv("ACCELERATOR_TYPE", raising=False)
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-8")
    assert tiles.detect_generation("TPU") == "v5e"  # torch-tpu's bare "TPU" names nothing
    assert tiles.detect_generation("TPU v6 lite") == "v6e"


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"gmm": {"v6e": {"default": [512, 1024]}}}, "gmm.v6e.default"),
        ({"gmm": {"v6e": {"2048x768": [512, 1024, 1024]}}}, "no default"),
        ({"fused_ce": {"v9": {"default": [512, 512]}}}, "unknown generation"),
        ({"fused_ce": {"v4": {"default": [500, 512]}}}, "multiples of 8"),
    ],
)
def test_a_bad_table_entry_is_named(bad, match):
    with pytest.raises(ValueError, match=match):
        tiles.check_table(bad)


# --- the tile sweep's enumeration and VMEM filter (list mode: pure Python) ----------------------

ROOT = Path(__file__).resolve().parents[2]


def _sweep(*args):
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench" / "sweep_kernel_tiles.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_sweep_lists_candidates_filters_by_vmem_and_writes_a_table_the_kernels_read(tmp_path):
    out = tmp_path / "tiles.toml"
    run = _sweep(
        "--mode", "list", "--generation", "v5e", "--generation", "v4", "--kernel", "gmm", "--kernel", "fused_ce",
        "--out", str(out), "--json",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    results = json.loads(run.stdout.strip().splitlines()[-1])["results"]
    assert {(r["kernel"], r["generation"]) for r in results} == {
        (k, g) for k in ("gmm", "fused_ce") for g in ("v4", "v5e")
    }
    for r in results:
        gen, (shape,) = r["generation"], r["instances"]  # no recipe on v4 / v5e: the fixed shapes
        for row in r["candidates"]:
            if r["kernel"] == "gmm":
                assert (
                    tiles.gmm_vmem_bytes(*row["tiles"]) <= tiles.BUDGET_FRACTION * tiles.hardware(gen).scoped_vmem_bytes
                )
                assert shape["k"] % row["tiles"][1] == 0 and shape["n"] % row["tiles"][2] == 0
            else:
                assert tiles.ce_vmem_bytes(*row["tiles"], shape["dim"]) <= tiles.BUDGET_FRACTION * tiles.ce_vmem_limit(
                    gen
                )
        assert r["dropped_by_vmem"] > 0, r  # the filter did something at these shapes
    # v4 cannot hold the loss at dim 8192 at all (see the VMEM test above): no candidate, no entry.
    v4_8192 = next(
        r for r in results if r["kernel"] == "fused_ce" and r["generation"] == "v4" and r["class"] == "d8192"
    )
    assert v4_8192["kept"] == 0 and v4_8192["pick"] is None
    # The written table parses, keeps the other generations, and the kernels' rule takes its entries.
    table = tiles.load_table(str(out))
    assert set(table["gmm"]) == {*tiles.GENERATIONS, "unknown"}
    assert "--mode list" in table["source"]["v5e"] and table["source"]["v6e"] == tiles.load_table()["source"]["v6e"]
    pick = next(
        r["pick"] for r in results if r["kernel"] == "gmm" and r["generation"] == "v5e" and r["class"] == "2048x768"
    )
    assert list(tiles.gmm_tiles("v5e", 65536, 2048, 768, 128, table=table)) == pick


@pytest.mark.parametrize(
    "args,names",
    [
        (["--generation", "v9"], "--generation"),
        (["--kernel", "attention"], "--kernel"),
        (["--groups", "0"], "--groups"),
        (["--out", "/no/such/dir/t.toml"], "--out"),
    ],
)
def test_sweep_bad_arguments_are_one_error_line(args, names):
    run = _sweep(*args)
    assert run.returncode == 2
    assert run.stderr.startswith("error: ") and names in run.stderr and len(run.stderr.strip().splitlines()) == 1, (
        run.stderr
    )


def _two_rank_agree(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        impls = {
            "grouped_mm": _raises if rank == 1 else AGREEING["grouped_mm"],
            "linear_cross_entropy": AGREEING["linear_cross_entropy"],
        }
        passed, verdicts = selfcheck.run(impls, device=CPU, dtype=BF16)
        Path(out, f"rank{rank}.json").write_text(
            json.dumps({"passed": sorted(passed), "reasons": {v.op: v.reason for v in verdicts}})
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_ranks_agree_a_kernel_that_failed_on_one_rank_is_dropped_on_all(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_two_rank_agree, args=(2, f"file://{tmp_path / 'pg'}", str(tmp_path)), nprocs=2)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["passed"] == r1["passed"] == ["linear_cross_entropy"]
    assert r0["reasons"]["grouped_mm"] == "failed on another rank (see its log)"
    assert "raised RuntimeError" in r1["reasons"]["grouped_mm"]


# --- the self-check at the run's widths (issue 37) ------------------------------------------------


def test_kernel_shapes_are_the_widths_the_run_calls():
    from models import get_model_family

    llama = titan_kernels.KernelShapes.of(get_model_family("llama3").flavors["70B"], tokens=8192)
    assert (llama.hidden, llama.vocab, llama.qk_head_dim, llama.v_head_dim, llama.num_experts) == (
        8192,
        128256,
        128,
        128,
        0,
    )
    mla = get_model_family("deepseek_v3").flavors["671B"]
    assert (mla.qk_head_dim, mla.v_head_dim) == (192, 128)
    shapes = titan_kernels.KernelShapes.of(mla, cp=4, cp_rank=3)
    # The model hands the op v at its own width (models/deepseek_v3/model.py, no padding): splash
    # runs at q/k 192 and v 128.
    assert (shapes.qk_head_dim, shapes.v_head_dim) == (192, 128)
    assert shapes.describe("causal_attention") == "q/k 192, v 128"
    assert (shapes.hidden, shapes.expert_hidden, shapes.num_experts, shapes.top_k) == (7168, 2048, 256, 8)
    assert (shapes.cp, shapes.cp_rank) == (4, 3)


def test_cases_take_the_run_widths():
    shapes = selfcheck.KernelShapes(hidden=96, vocab=5000, qk_head_dim=48, v_head_dim=32, expert_hidden=160)
    (causal, segments) = selfcheck.cases("causal_attention", shapes=shapes)
    q, k, v = causal.args
    assert (q.shape[-1], k.shape[-1], v.shape[-1]) == (48, 48, 32)
    up, down = selfcheck.cases("grouped_mm", shapes=shapes)
    assert up.args[0].shape[1] == 96 and up.args[1].shape[1:] == (160, 96)  # x [m, dim], w [G, N, K]
    assert down.args[0].shape[1] == 160 and down.args[1].shape[1:] == (96, 160)
    (loss,) = selfcheck.cases("linear_cross_entropy", shapes=shapes)
    assert loss.args[0].shape[1] == 96 and loss.args[1].shape == (1000, 96)  # numerics: small vocabulary


def test_a_kernel_is_checked_at_distinct_q_and_v_widths():
    """v narrower than q/k (MLA unpadded): the reference and an agreeing kernel take it."""
    shapes = selfcheck.KernelShapes(qk_head_dim=48, v_head_dim=32)
    verdict = selfcheck.check("causal_attention", AGREEING["causal_attention"], device=CPU, dtype=BF16, shapes=shapes)
    assert verdict.ok and 0 < verdict.worst < selfcheck.TOLERANCE / 2, verdict
    assert "q/k 48, v 32" in verdict.checked


def _v4_loss_compile(op):
    # What titan_kernels/tpu/compile_check.py answers for the 70B-wide loss on v4 (tests/xla shows the real one).
    if op != "linear_cross_entropy":
        return None
    return False, (
        "backward at rows 8192, hidden 8192, vocab 128256, blocks 128 x 128 does not compile for v4: "
        "JaxRuntimeError: RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom: (17.90M of 16.00M scoped VMEM)"
    )


def test_a_kernel_that_does_not_compile_at_the_run_width_falls_back_with_one_line(capsys):
    shapes = selfcheck.KernelShapes(hidden=64, vocab=128256)
    impls = dict(AGREEING)
    saved = {op: ops.register(op, None) for op in ops.OPS}
    try:
        passed, verdicts = selfcheck.run(impls, device=CPU, dtype=BF16, shapes=shapes, compile_check=_v4_loss_compile)
        line = titan_kernels._register_tpu("auto", passed, verdicts, saved=[])
        assert ops.implementation("linear_cross_entropy") is ops.chunked_linear_cross_entropy
        assert ops.implementation("grouped_mm") is impls["grouped_mm"]
    finally:
        for op, fn in saved.items():
            ops.register(op, fn)
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith(
        "titan-tpu: kernel self-check: fused CE (linear_cross_entropy) failed, the torch reference "
        "serves it: backward at rows 8192, hidden 8192, vocab 128256"
    ), err
    assert "CompileTimeScopedVmemOom" in err and "17.90M of 16.00M" in err
    assert "self-check failed: fused CE" in line


def test_a_compile_check_that_passes_or_raises():
    def compiled(op):
        return (True, "forward + backward compiled for v6e (0.5 s, not run)") if op == "linear_cross_entropy" else None

    verdict = selfcheck.check(
        "linear_cross_entropy", AGREEING["linear_cross_entropy"], device=CPU, dtype=BF16, compile_check=compiled
    )
    assert verdict.ok and "compiled for v6e" in verdict.checked, verdict

    def broken(op):
        raise RuntimeError("no libtpu here\nmore")

    verdict = selfcheck.check("grouped_mm", AGREEING["grouped_mm"], device=CPU, dtype=BF16, compile_check=broken)
    assert not verdict.ok and verdict.reason == "the compile-only check raised RuntimeError: no libtpu here"


def cp_attention_bf16(cp_rank, cp_size, *, rank_offsets=None):
    """Independent CP local attention in bf16: explicit loops over the rank's two chunks."""

    def attention(q, k_all, v_all, segment_ids=None, segment_ids_all=None):
        seq, local = k_all.shape[2], q.shape[2]
        chunk = local // 2
        r = cp_size - 1 - cp_rank if rank_offsets == "mirrored" else cp_rank
        starts = (r * chunk, (2 * cp_size - 1 - r) * chunk)
        group = q.shape[1] // k_all.shape[1]
        k, v = ops.repeat_kv(k_all, group), ops.repeat_kv(v_all, group)
        outs = []
        for c, start in enumerate(starts):
            qc = q[:, :, c * chunk : (c + 1) * chunk]
            scores = ((qc * qc.shape[-1] ** -0.5) @ k.transpose(-2, -1)).float()
            mask = torch.arange(seq)[None, :] <= (start + torch.arange(chunk))[:, None]
            mask = mask[None, None]
            if segment_ids is not None:
                mask = mask & (
                    segment_ids[:, None, c * chunk : (c + 1) * chunk, None] == segment_ids_all[:, None, None, :]
                )
            outs.append(torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(q.dtype) @ v)
        return torch.cat(outs, dim=2)

    return attention


@pytest.mark.parametrize("cp_rank", [0, 2])
def test_the_cp_kernel_is_checked_against_dense_attention_at_its_positions(cp_rank):
    shapes = selfcheck.KernelShapes(qk_head_dim=32, v_head_dim=32, cp=4, cp_rank=cp_rank)
    good = selfcheck.check("cp_attention", cp_attention_bf16(cp_rank, 4), device=CPU, dtype=BF16, shapes=shapes)
    assert good.ok and 0 < good.worst < selfcheck.TOLERANCE / 2, good
    # Another rank's offsets: the classic CP bug (a kernel built for the wrong rank).
    wrong = selfcheck.check(
        "cp_attention", cp_attention_bf16(cp_rank, 4, rank_offsets="mirrored"), device=CPU, dtype=BF16, shapes=shapes
    )
    assert not wrong.ok and "differs from the reference" in wrong.reason, wrong


def test_select_on_tpu_checks_every_kernel_at_the_run_widths_and_the_cp_kernel(monkeypatch, capsys):
    """`_select_tpu` with the TPU pieces injected (load, the CP kernel, the compile check): what
    it checks at which widths, and a failed CP kernel leaves CP's local product to SDPA."""
    from titan_kernels import tpu

    shapes = selfcheck.KernelShapes(
        hidden=64,
        vocab=128256,
        qk_head_dim=48,
        v_head_dim=48,
        expert_hidden=96,
        num_experts=8,
        top_k=2,
        cp=2,
        cp_rank=1,
        tokens=4096,
    )
    asked = []

    def checker(run_shapes, attached=False):
        assert run_shapes is shapes and not attached  # the CPU: no TPU attached
        return lambda op: asked.append(op) or _v4_loss_compile(op)

    built, real_cp_attention = [], tpu.cp_attention
    monkeypatch.setattr(tpu, "load", lambda: dict(AGREEING))
    monkeypatch.setattr(tpu, "saved_ops", lambda: [])
    monkeypatch.setattr(tpu, "compile_checker", checker)
    monkeypatch.setattr(tpu, "cp_attention", lambda rank, size: built.append((rank, size)) or _raises)
    saved = {op: ops.register(op, None) for op in ops.OPS}
    try:
        line = titan_kernels._select_tpu("auto", device=CPU, dtype=BF16, head_dim=None, shapes=shapes)
    finally:
        for op, fn in saved.items():
            ops.register(op, fn)
    assert built == [(1, 2)]
    assert set(asked) == {"causal_attention", "attention", "grouped_mm", "linear_cross_entropy", "cp_attention"}
    err = capsys.readouterr().err.strip().splitlines()
    assert [e.split(" failed")[0] for e in err] == [
        "titan-tpu: kernel self-check: fused CE (linear_cross_entropy)",
        "titan-tpu: kernel self-check: CP splash (cp_attention)",
    ], err
    # Loaded, but the CP kernel was refused: context parallelism gets None and takes SDPA.
    assert real_cp_attention(1, 2) is None
    tpu.refuse_cp(None)
    assert (
        line.startswith("splash (Pallas: gmm for MoE experts, full-mask splash;")
        and "self-check failed: fused CE, CP splash" in line
    )


def test_no_second_libtpu_client_in_a_process_a_tpu_is_attached_to(monkeypatch):
    """N15 (docs/tpu.md): the compile-only kernel check made a compile-only libtpu device
    (`jax.experimental.topologies`) inside the training process, whose torch-tpu client owns the
    chips. On a TPU device `_select_tpu` now asks the checker with `attached=True`, which reaches
    `compile_kernel` (the tile rule decides, no compile-only device), and the references still
    serve a refused op. A fake device layer: a device whose type is "tpu", fake compile_check and
    register modules (no jax here)."""
    import sys
    import types
    from types import SimpleNamespace

    from titan_kernels import tpu

    calls = []
    fake_compile = types.ModuleType("titan_kernels.tpu.compile_check")
    fake_compile.compile_kernel = lambda op, shapes, generation, attached=False: (
        calls.append((op, generation, attached)) or (False, "tile rule: over the VMEM limit")
    )
    fake_register = types.ModuleType("titan_kernels.tpu.register")
    fake_register.device_generation = lambda: "v6e"
    for name, module in (("compile_check", fake_compile), ("register", fake_register)):
        monkeypatch.setitem(sys.modules, f"titan_kernels.tpu.{name}", module)
        monkeypatch.setattr(tpu, name, module, raising=False)
    shapes = selfcheck.KernelShapes(hidden=64, vocab=1024, qk_head_dim=48, v_head_dim=48, tokens=256)
    assert tpu.compile_checker(shapes, attached=True)("linear_cross_entropy") == (
        False,
        "tile rule: over the VMEM limit",
    )
    assert calls == [("linear_cross_entropy", "v6e", True)]

    asked = []
    monkeypatch.setattr(tpu, "load", lambda: dict(AGREEING))
    monkeypatch.setattr(tpu, "saved_ops", lambda: [])
    monkeypatch.setattr(tpu, "compile_checker", lambda s, attached=False: asked.append(attached) or (lambda op: None))
    monkeypatch.setattr(selfcheck, "run", lambda selected, **kw: (kw["compile_check"]("grouped_mm"), ({}, []))[1])
    saved = {op: ops.register(op, None) for op in ops.OPS}
    try:
        for device in (SimpleNamespace(type="tpu"), CPU):
            titan_kernels._select_tpu("auto", device=device, dtype=BF16, head_dim=None, shapes=shapes)
    finally:
        for op, fn in saved.items():
            ops.register(op, fn)
    assert asked == [True, False]
