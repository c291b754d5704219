"""Flavors, parameter-count formulas, initialisation and the model-family table."""

import dataclasses

import pytest
import torch

import models
from models.common.rope import rope_cos_sin
from models.llama3.args import FLAVORS as LLAMA3_FLAVORS
from models.llama3.args import Llama3Args
from models.qwen3.args import FLAVORS as QWEN3_FLAVORS
from models.qwen3.args import Qwen3Args

ALL_FLAVORS = [("llama3", f) for f in LLAMA3_FLAVORS] + [("qwen3", f) for f in QWEN3_FLAVORS]


def _meta_model(family_name, flavor):
    family = models.get_model_family(family_name)
    with torch.device("meta"):
        return family.model_cls(family.get_args(flavor))


@pytest.mark.parametrize("family_name,flavor", ALL_FLAVORS)
def test_flavor_builds_on_meta_and_formula_matches_module(family_name, flavor):
    model = _meta_model(family_name, flavor)
    args = model.args
    assert all(p.is_meta for p in model.parameters())
    assert list(model.layers.keys()) == [str(i) for i in range(args.n_layers)]
    # parameters() counts a tied matrix once, like the formula.
    assert args.num_params() == sum(p.numel() for p in model.parameters())
    embedding = 0 if args.tie_embeddings else model.tok_embeddings.weight.numel()
    assert args.num_params(exclude_embedding=True) == args.num_params() - embedding
    if getattr(args, "num_experts", 0):
        # Active = everything except the (E - k) unused experts of each MoE block.
        experts = sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." in n)
        unused = experts * (args.num_experts - args.num_experts_per_tok) // args.num_experts
        assert args.num_active_params() == args.num_params() - unused
    else:
        assert args.num_active_params() == args.num_params()


# (family, flavor, published billions, what, absolute tolerance in billions). Sources: Meta's
# Llama 3.1/3.2 model cards and Qwen's model cards (Qwen/Qwen3-*), which round to the digits shown.
PUBLISHED = [
    ("llama3", "1B", 1.24, "total", None),
    ("llama3", "3B", 3.21, "total", None),
    ("llama3", "8B", 8.03, "total", None),
    ("llama3", "70B", 70.6, "total", None),
    ("llama3", "405B", 405.9, "total", None),
    ("qwen3", "0.6B", 0.6, "total", 0.05),  # card: 0.6B (0.44B non-embedding), we count 0.596B
    ("qwen3", "1.7B", 1.7, "total", 0.05),
    ("qwen3", "4B", 4.0, "total", 0.05),
    ("qwen3", "8B", 8.19, "total", None),
    ("qwen3", "14B", 14.8, "total", None),
    ("qwen3", "32B", 32.8, "total", None),
    ("qwen3", "30B-A3B", 30.5, "total", None),
    ("qwen3", "30B-A3B", 3.3, "active", 0.06),  # card: 3.3B activated; formula 3.35B (card truncates)
    ("qwen3", "235B-A22B", 235.0, "total", 0.5),
    ("qwen3", "235B-A22B", 22.0, "active", 0.5),  # formula 22.19B
]


@pytest.mark.parametrize("family_name,flavor,published,what,abs_tol", PUBLISHED)
def test_published_sizes(family_name, flavor, published, what, abs_tol):
    args = models.get_model_family(family_name).get_args(flavor)
    count = (args.num_params() if what == "total" else args.num_active_params()) / 1e9
    if abs_tol is None:
        assert abs(count - published) <= 0.005 * published, f"{flavor} {what}: {count:.3f}B vs {published}B"
    else:
        assert abs(count - published) <= abs_tol, f"{flavor} {what}: {count:.3f}B vs {published}B"


def test_qwen3_non_embedding_matches_model_cards():
    """Qwen's cards also list non-embedding sizes (embedding and output both excluded)."""
    for flavor, published in (("0.6B", 0.44), ("8B", 6.95), ("32B", 31.2), ("30B-A3B", 29.9)):
        args = QWEN3_FLAVORS[flavor]
        table = args.vocab_size * args.dim
        non_embedding = args.num_params(exclude_embedding=True) - table
        assert abs(non_embedding / 1e9 - published) <= 0.005 * published, flavor


def test_llama3_ffn_width_follows_meta_rule():
    widths = {name: LLAMA3_FLAVORS[name].ffn_hidden_dim for name in ("1B", "3B", "8B", "70B", "405B")}
    assert widths == {"1B": 8192, "3B": 8192, "8B": 14336, "70B": 28672, "405B": 53248}
    assert dataclasses.replace(LLAMA3_FLAVORS["8B"], hidden_dim=1000).ffn_hidden_dim == 1000


@pytest.mark.parametrize("family_name,flavor", [("llama3", "debugmodel"), ("qwen3", "debugmodel_moe")])
def test_init_weights_after_to_empty(family_name, flavor):
    torch.manual_seed(0)
    model = _meta_model(family_name, flavor)
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=torch.device("cpu"))
    args = model.args
    assert torch.isfinite(torch.cat([p.flatten() for p in model.parameters()])).all()

    def std(t):
        return t.float().std().item()

    assert std(model.tok_embeddings.weight) == pytest.approx(0.02, rel=0.05)
    assert std(model.output.weight) == pytest.approx(args.dim**-0.5, rel=0.05)
    assert model.output.weight.abs().max() <= 3 * args.dim**-0.5  # truncated at 3 std
    last = model.layers[str(args.n_layers - 1)]
    depth_std = 0.02 / (2 * args.n_layers) ** 0.5
    # A normal truncated at 3 std has std 0.9866 * std.
    assert std(last.attention.wq.weight) == pytest.approx(0.02 * 0.9866, rel=0.05)
    assert std(last.attention.wo.weight) == pytest.approx(depth_std * 0.9866, rel=0.05)
    assert std(model.layers["0"].attention.wo.weight) == pytest.approx(0.02 / 2**0.5 * 0.9866, rel=0.05)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
    cos, sin = rope_cos_sin(
        model.rope_config.head_dim,
        args.max_seq_len,
        args.rope_theta,
        scaling_factor=getattr(args, "rope_scaling_factor", None),
    )
    assert torch.equal(model.rope_cos, cos) and torch.equal(model.rope_sin, sin)
    assert "rope_cos" not in model.state_dict()  # non-persistent
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, args.vocab_size) and torch.isfinite(logits).all()


def test_tied_embeddings_survive_to_empty_and_init():
    args = dataclasses.replace(QWEN3_FLAVORS["debugmodel"], tie_embeddings=True, n_layers=2)
    with torch.device("meta"):
        model = models.get_model_family("qwen3").model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights()
    assert model.output.weight is model.tok_embeddings.weight
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert set(model.state_dict()) >= {"tok_embeddings.weight", "output.weight"}


def test_init_weights_on_dtensor_parameters():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        model = _meta_model("qwen3", "debugmodel_moe")
        model.to_empty(device="cpu")
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is None:  # Linear(bias=False) lists bias as None
                    continue
                local = torch.full((p.shape[0] // 2, *p.shape[1:]), float("nan"))
                module._parameters[name] = torch.nn.Parameter(
                    DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
                )
        model.init_weights(buffer_device=torch.device("cpu"))
        wq = model.layers["0"].attention.wq.weight
        assert isinstance(wq, DTensor)
        assert torch.isfinite(wq.to_local()).all() and wq.to_local().std().item() == pytest.approx(0.02, rel=0.1)
        norm_local = model.norm.weight.to_local()
        assert norm_local.shape == (model.args.dim // 2,) and torch.equal(norm_local, torch.ones_like(norm_local))
    finally:
        dist.destroy_process_group()


def test_args_validation_and_family_errors():
    with pytest.raises(ValueError, match="n_kv_heads"):
        Llama3Args(dim=64, n_heads=8, n_kv_heads=3)
    with pytest.raises(ValueError, match="n_heads"):
        Llama3Args(dim=64, n_heads=7)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        Qwen3Args(num_experts=4, num_experts_per_tok=5)
    with pytest.raises(
        ValueError,
        match="allowed: llama3, qwen3, qwen3_5, deepseek_v3, deepseek_v4, gpt_oss, flux, hf, or package.module:NAME",
    ):
        models.get_model_family("gpt2")
    with pytest.raises(ValueError, match="model.name: cannot load 'tests.nowhere:X'"):
        models.get_model_family("tests.nowhere:X")
    with pytest.raises(ValueError, match="is a dict, not a ModelFamily"):
        models.get_model_family("models:FAMILIES")
    assert models.get_model_family("tests.support.toy_family:TOY").name == "toy"
    family = models.get_model_family("llama3")
    with pytest.raises(ValueError, match="allowed: \\['debugmodel'"):
        family.get_args("7B")
    with pytest.raises(ValueError, match="model.bogus"):
        family.get_args("debugmodel", bogus=1)
    assert family.get_args("debugmodel", rope_theta=10000).rope_theta == 10000.0  # int for a float field
    args = family.get_args("debugmodel", n_layers=2)
    assert args.n_layers == 2 and LLAMA3_FLAVORS["debugmodel"].n_layers == 6  # flavors are not mutated
    from models.llama3.plan import PLAN

    assert family.plan is PLAN
    assert {"from_hf", "to_hf", "hf_config", "args_from_hf_config"} <= set(dir(family.hf_adapter))


def test_sequence_longer_than_rope_table_is_rejected():
    args = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], n_layers=1, max_seq_len=8)
    model = models.get_model_family("llama3").model_cls(args)
    with pytest.raises(AssertionError, match="max_seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))
