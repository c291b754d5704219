"""FLOPs per token against torch's FlopCounterMode, and the peak-FLOP/s lookups."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from titan_kernels import cpu_attention
from trainer.runtime import flops, pci

aten = torch.ops.aten


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    # 2D x 2D with offsets is the expert weight gradient: [K, M_total] x [M_total, N] -> [E, K, N],
    # each token row contributes to one group only. Otherwise every output element is a K-long dot.
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * out_shape.numel() * a_shape[-1]


# FlopCounterMode knows SDPA only by its CUDA kernels; on the CPU the same math runs as the
# *_for_cpu ops, and MoE experts run as _grouped_mm. Count them with torch's own formulas.
CPU_MAPPING = {
    aten._scaled_dot_product_flash_attention_for_cpu: (
        lambda q, k, v, *a, out_shape=None, **kw: sdpa_flop_count(q, k, v)
    ),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        lambda g, q, k, v, *a, out_shape=None, **kw: sdpa_backward_flop_count(g, q, k, v)
    ),
    aten._grouped_mm: _grouped_mm_flops,
}
MATMULS = {aten.mm, aten.addmm, aten.bmm, aten._grouped_mm}
ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward,
}
if cpu_attention.load():  # the CPU kernel registers SDPA's formulas for its ops
    ATTENTION |= {torch.ops.titan_cpu.attn_fwd, torch.ops.titan_cpu.attn_bwd}


def _count(family: str, flavor: str, seq_len: int, batch: int = 2):
    module = __import__(f"models.{family}", fromlist=["FLAVORS", "Transformer"])
    args = dataclasses.replace(module.FLAVORS[flavor], max_seq_len=seq_len)
    torch.manual_seed(0)
    model = module.Transformer(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len))
    with FlopCounterMode(display=False, custom_mapping=CPU_MAPPING) as counter:
        model(tokens).float().sum().backward()
    by_op = counter.get_flop_counts()["Global"]
    n_tokens = batch * seq_len
    matmul = sum(v for k, v in by_op.items() if k in MATMULS) / n_tokens
    attention = sum(v for k, v in by_op.items() if k in ATTENTION) / n_tokens
    return args, matmul, attention, counter.get_total_flops() / n_tokens


MODELS = [("llama3", "debugmodel"), ("qwen3", "debugmodel"), ("qwen3", "debugmodel_moe")]


@pytest.mark.parametrize("family,flavor", MODELS)
def test_flops_per_token_matches_flop_counter(family, flavor):
    seq_len = 256
    args, matmul, attention, total = _count(family, flavor, seq_len)
    expected = flops.flops_per_token(
        num_matmul_params=args.num_active_params(exclude_embedding=True),
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        head_dim=args.head_dim,
        seq_len=seq_len,
    )
    attention_palm = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    # The 6N part: every weight matmul forward + two backward; N also holds the norm weights
    # (no matmul), well under 1 % of it.
    assert matmul == pytest.approx(expected["palm"] - attention_palm, rel=0.01)
    assert attention > 0, "SDPA was not counted"
    # FlopCounterMode's SDPA backward recomputes the scores (5 bmm vs PaLM's 4), hence 14/12.
    assert attention == pytest.approx(attention_palm * 14 / 12, rel=1e-6)
    assert total == pytest.approx(expected["palm"], rel=0.05)
    assert expected["causal"] == pytest.approx(expected["palm"] - attention_palm / 2)


def test_moe_counts_only_active_experts():
    args, matmul, _, _ = _count("qwen3", "debugmodel_moe", 64)
    dense_all_experts = args.num_params(exclude_embedding=True)
    active = args.num_active_params(exclude_embedding=True)
    assert active < dense_all_experts
    assert matmul == pytest.approx(6 * active, rel=0.01)


def test_flops_formula_by_hand():
    # Llama 3.1 8B at seq 8192: 6N + 12·32·32·128·8192 (PaLM) and half the attention (causal).
    out = flops.flops_per_token(num_matmul_params=7_000_000_000, n_layers=32, n_heads=32, head_dim=128, seq_len=8192)
    attention = 12 * 32 * 32 * 128 * 8192
    assert out == {"palm": 42e9 + attention, "causal": 42e9 + attention / 2}


@pytest.mark.parametrize(
    "kind,gen",
    [
        ("TPU v4", "v4"),
        ("v4-8", "v4"),
        ("TPU v5 lite", "v5e"),
        ("v5litepod-16", "v5e"),
        ("v5e", "v5e"),
        ("TPU v5", "v5p"),
        ("TPU v5p", "v5p"),
        ("v5p-128", "v5p"),
        ("TPU v6 lite", "v6e"),
        ("v6e-8", "v6e"),
        ("Trillium", "v6e"),
        ("TPU7x", "v7x"),
        ("tpu7x-64", "v7x"),
        ("TPU v7x", "v7x"),
        ("TPU", None),
        ("NVIDIA H100", None),
        ("Tesla V100", None),
    ],
)
def test_tpu_generation(kind, gen):
    assert flops.tpu_generation(kind) == gen


def test_tpu_peaks_per_device(monkeypatch):
    tpu = SimpleNamespace(type="tpu")  # torch.device("tpu") needs torch-tpu's backend rename
    monkeypatch.setattr(flops, "_tpu_kind_candidates", lambda: ["TPU", "v6e-8"])
    peak, desc = flops.peak_flops_per_device(tpu)
    assert peak == 918e12 and "v6e" in desc
    monkeypatch.setattr(flops, "_tpu_kind_candidates", lambda: ["tpu7x-16"])
    assert flops.peak_flops_per_device(tpu)[0] == 1153.5e12  # 2307 per chip, two devices per chip
    monkeypatch.setattr(flops, "_tpu_kind_candidates", lambda: [])
    peak, desc = flops.peak_flops_per_device(tpu)
    assert peak is None and "override" in desc
    assert flops.peak_flops_per_device(tpu, override="v5e")[0] == 197e12
    assert flops.peak_flops_per_device(tpu, override=275)[0] == 275e12


def test_tpu_kind_from_environment(monkeypatch):
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5p-256")
    assert "v5p-256" in flops._tpu_kind_candidates()
    peak, _ = flops.peak_flops_per_device(SimpleNamespace(type="tpu"))
    assert peak == 459e12


@pytest.mark.parametrize(
    "name,tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA H200", 989),
        ("NVIDIA B200", 2250),
        ("NVIDIA GB200", 2500),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA GeForce RTX 4090", None),
        ("Tesla T4", None),
    ],
)
def test_gpu_peaks(monkeypatch, name, tflops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    peak, desc = flops.peak_flops_per_device(torch.device("cuda", 0), torch.bfloat16)
    if tflops is None:
        assert peak is None and "not in the peak table" in desc
    else:
        assert peak == tflops * 1e12 and name in desc


@pytest.mark.parametrize("device_id, gen", [("0x0063", "v5e"), ("0x006f", "v6e"), ("0x0076", "v7x")])
def test_tpu_found_from_pci_ids(tmp_path, monkeypatch, device_id, gen):
    """A TPU VM without torch-tpu's device API: the chip is read from its PCI ids (Google vendor
    0x1ae0); v7x's 0x0076 is in torch-tpu 0.2.0's own table."""
    dev = tmp_path / "0000:00:04.0"
    dev.mkdir()
    (dev / "vendor").write_text("0x1ae0\n")
    (dev / "device").write_text(device_id + "\n")
    other = tmp_path / "0000:00:05.0"  # a non-Google device is ignored
    other.mkdir()
    (other / "vendor").write_text("0x8086\n")
    (other / "device").write_text("0x0076\n")
    for var in ("TPU_ACCELERATOR_TYPE", "ACCELERATOR_TYPE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(flops, "tpu_generations_on_pci", lambda: pci.tpu_generations_on_pci(str(tmp_path)))
    assert flops._tpu_kind_candidates() == [gen]
    assert flops.tpu_generation(gen) == gen


def _flavor(family: str, flavor: str, **changes):
    module = __import__(f"models.{family}", fromlist=["FLAVORS"])
    return dataclasses.replace(module.FLAVORS[flavor], **changes)


def test_model_flops_default_is_every_block_full_attention():
    args = _flavor("llama3", "debugmodel")
    assert flops.model_flops_per_token(args, 256) == flops.flops_per_token(
        num_matmul_params=args.num_active_params(exclude_embedding=True),
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        head_dim=args.head_dim,
        seq_len=256,
    )


@pytest.mark.parametrize("seq_len, window", [(256, 32), (8192, 128), (64, 128), (128, 128), (1, 4)])
def test_causal_keys_is_the_rows_mean_within_half_a_key(seq_len, window):
    """`causal_keys` against the mean over the rows of min(i + 1, window) (full: T/2 against the
    exact (T + 1)/2, the convention's half key)."""
    from models.contract import causal_keys

    exact = sum(min(i + 1, window) for i in range(seq_len)) / seq_len
    assert 0 <= exact - causal_keys(seq_len, window) <= 0.5 + 1e-9
    assert causal_keys(seq_len) == seq_len / 2


def test_gpt_oss_counts_its_sliding_blocks_by_their_window():
    """Before the change every gpt-oss block counted T keys: at 8192 tokens and a 128-key window,
    half the blocks' attention was overstated 32x, and the MFU of 120B at 8192 tokens by 18 % (palm)
    / 10 % (causal); Qwen 3.5 35B-A3B's at 4096 by 29 % / 14 % (its DeltaNet blocks as attention)."""
    args = _flavor("gpt_oss", "debugmodel")
    seq_len, w = 1024, args.sliding_window
    out = flops.model_flops_per_token(args, seq_len)
    per_block = 12 * args.n_heads * args.head_dim
    full, sliding = args.n_layers // 2, (args.n_layers + 1) // 2  # odd / even blocks
    causal_attn = per_block * (full * seq_len / 2 + sliding * (w - w * w / (2 * seq_len)))
    dense = 6 * args.num_active_params(exclude_embedding=True)
    assert out["causal"] == pytest.approx(dense + causal_attn) and out["palm"] == pytest.approx(dense + 2 * causal_attn)
    everything_full = flops.flops_per_token(
        num_matmul_params=args.num_active_params(exclude_embedding=True),
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        head_dim=args.head_dim,
        seq_len=seq_len,
    )
    assert out["palm"] < everything_full["palm"]


def test_qwen3_5_counts_delta_rule_blocks_by_their_state():
    args = _flavor("qwen3_5", "debugmodel")
    seq_len = 512
    full = sum(args.is_full_attention(i) for i in range(args.n_layers))
    assert 0 < full < args.n_layers
    delta = 18 * (args.n_layers - full) * args.linear_num_value_heads * args.linear_key_head_dim
    delta *= args.linear_value_head_dim
    attention = full * args.n_heads * args.head_dim * seq_len
    dense = 6 * args.num_active_params(exclude_embedding=True)
    out = flops.model_flops_per_token(args, seq_len)
    assert out == pytest.approx({"palm": dense + 12 * attention + delta, "causal": dense + 6 * attention + delta})


def test_mtp_adds_its_blocks_and_the_head_per_depth():
    base = _flavor("deepseek_v3", "debugmodel")
    mtp = dataclasses.replace(base, mtp_depth=2)
    seq_len, shape = 256, mtp.shape()
    out = flops.model_flops_per_token(mtp, seq_len)
    matmul = mtp.num_active_params(exclude_embedding=True) + 2 * shape.vocab_size * shape.dim
    assert out == flops.flops_per_token(
        num_matmul_params=matmul,
        n_layers=shape.n_layers + 2,
        n_heads=shape.n_heads,
        head_dim=shape.head_dim,
        seq_len=seq_len,
    )
    assert out["palm"] > flops.model_flops_per_token(base, seq_len)["palm"]


def test_trainer_planner_and_projection_read_one_count():
    """The LM task's MFU, the planner's FLOPs and the TPU projections' facts are one function."""
    from planner.search import model_flops_per_token as planner_flops
    from trainer.tasks.lm import LMTask

    args = _flavor("gpt_oss", "debugmodel")
    task = LMTask.__new__(LMTask)
    task.args, task.settings = args, SimpleNamespace(seq_len=512)
    assert task.flops_per_unit() == flops.model_flops_per_token(args, 512)
    assert planner_flops(args, args.shape(), 512) == flops.model_flops_per_token(args, 512)["palm"]
