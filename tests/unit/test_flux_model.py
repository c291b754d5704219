"""FLUX.1 transformer (models/flux): parameter counts, diffusers parity, the adapter and
conversion, latents, FLOPs, tensor/data parallelism, AC, compile and bf16.

Tolerances (fp32 unless stated):
- diffusers parity: max |ours - diffusers| <= 1e-5 x max |diffusers|. Both compute the same
  float32 ops; they differ only in how matmuls are split (the single block's out-projection
  is one GEMM over [attn; mlp] there, two GEMMs summed here) and in the order of some
  elementwise terms, i.e. rounding of float32 sums (eps 6e-8, K <= 1280 terms, a few blocks
  deep). Measured: <= 5e-7 relative.
- TP=2 / FSDP=2 vs one process: outputs and every gradient within 1e-5 relative (max abs
  difference over max abs value): TP splits each out-projection's K-sum into two halves that
  are all-reduced, FSDP averages two half-batch gradients; both only reorder float32 sums.
- AC: recomputation runs the same kernels on the same inputs: bitwise equal.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
import torch

from models.flux import FLAVORS, FluxArgs, FluxTransformer, hf_adapter, latents
from models.flux.flops import first_layer_flops_per_sample, flops_per_sample, forward_flops_per_sample
from models.flux.plan import PLAN

# diffusers is a dev extra: the tests that compare with it skip without it. Imported lazily, so
# the spawned ranks of the parallel tests (which import this module) do not pay for it.
needs_diffusers = pytest.mark.skipif(
    importlib.util.find_spec("diffusers") is None, reason="diffusers (the dev extra) is not installed"
)

PARITY_RTOL = 1e-5
PARALLEL_RTOL = 1e-5


def _args(guidance: bool = False, **kw) -> FluxArgs:
    return dataclasses.replace(FLAVORS["debugmodel"], guidance_embed=guidance, **kw)


def _random_model(args: FluxArgs, seed: int = 0) -> FluxTransformer:
    """Every parameter random (normal, std 0.05): init_weights zeroes the modulation and the
    output layer, which would hide most of the model from a parity check."""
    model = FluxTransformer(args)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _inputs(args: FluxArgs, batch: int, height: int, width: int, txt_len: int, guidance: bool, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    img = latents.pack(torch.randn(batch, 16, height, width, generator=g))
    return dict(
        img=img,
        img_ids=latents.image_ids(batch, height, width),
        txt=torch.randn(batch, txt_len, args.context_in_dim, generator=g),
        txt_ids=latents.text_ids(batch, txt_len),
        timesteps=torch.rand(batch, generator=g),
        y=torch.randn(batch, args.vec_in_dim, generator=g),
        guidance=(1 + 4 * torch.rand(batch, generator=g)) if guidance else None,
    )


def _diffusers_model(args: FluxArgs, state: dict[str, torch.Tensor] | None = None):
    import diffusers

    cfg = hf_adapter.hf_config(args)
    cfg.pop("_class_name")
    ref = diffusers.FluxTransformer2DModel(**cfg)
    if state is not None:
        ref.load_state_dict(hf_adapter.to_hf(state, args), strict=True)
    return ref


def _diffusers_forward(ref, x: dict) -> torch.Tensor:
    # diffusers: ids without the batch dim (shared by the batch); t and guidance scaled x1000 inside.
    with torch.no_grad():
        return ref(
            hidden_states=x["img"],
            encoder_hidden_states=x["txt"],
            pooled_projections=x["y"],
            timestep=x["timesteps"],
            img_ids=x["img_ids"][0],
            txt_ids=x["txt_ids"][0],
            guidance=x["guidance"],
            return_dict=False,
        )[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


# --- parameter counts ---------------------------------------------------------------------


FLUX_DEV_PARAMS = 11_901_408_320
"""FLUX.1-dev's transformer as diffusers builds it from the published config (counted below on
the meta device): BFL's "12 billion parameter" model; 2 bytes each = the published 23.8 GB
bf16 checkpoint."""


@needs_diffusers
@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_num_params_matches_built_model_and_diffusers(flavor):
    args = FLAVORS[flavor]
    with torch.device("meta"):
        ours = sum(p.numel() for p in FluxTransformer(args).parameters())
        theirs = sum(p.numel() for p in _diffusers_model(args).parameters())
    assert args.num_params() == ours == theirs
    assert args.num_active_params() == ours
    counts = args.param_counts()
    assert (
        counts.total
        == counts.matmul + counts.per_sample + (2 * args.depth + args.depth_single_blocks) * 2 * args.head_dim
    )


def test_flux_dev_is_the_published_12b():
    dev, schnell = FLAVORS["flux-dev"], FLAVORS["flux-schnell"]
    assert dev.num_params() == FLUX_DEV_PARAMS
    assert round(dev.num_params() / 1e9) == 12 and round(2 * dev.num_params() / 1e9, 1) == 23.8
    assert (dev.depth, dev.depth_single_blocks, dev.hidden_size, dev.num_heads, dev.axes_dim) == (
        19,
        38,
        3072,
        24,
        (16, 56, 56),
    )
    # schnell lacks only the guidance embedder: two linears 256 -> 3072 -> 3072
    assert dev.num_params() - schnell.num_params() == 256 * 3072 + 3072 + 3072 * 3072 + 3072
    shape = dev.shape()
    assert (shape.n_layers, shape.dim, shape.n_heads, shape.head_dim, shape.ffn_hidden) == (57, 3072, 24, 128, 12288)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(num_heads=5), "num_heads"),
        (dict(axes_dim=(16, 24, 22)), "axes_dim"),
        (dict(axes_dim=(15, 25, 24)), "axes_dim"),
        (dict(depth=0), "depth"),
    ],
)
def test_bad_args_name_the_field(bad, match):
    with pytest.raises(ValueError, match=rf"^{match}:"):
        dataclasses.replace(FLAVORS["debugmodel"], **bad)


@pytest.mark.parametrize("raw", ["abc", "[8, 28]", "[8, 28, 28.5]", "[8, 28, 27]", "[8, 28, 30]"])
def test_bad_axes_dim_override_is_one_config_error(raw):
    from models.errors import ConfigError
    from trainer.config import model_args, parse_value

    with pytest.raises(ConfigError, match=r"^model\.axes_dim: "):
        model_args("flux", "debugmodel", {"axes_dim": parse_value(raw)})
    assert model_args("flux", "debugmodel", {"axes_dim": parse_value("[8, 28, 28]")})[1].axes_dim == (8, 28, 28)


# --- diffusers parity and the adapter -----------------------------------------------------

SHAPES = [  # batch, latent height, width, text length, guidance
    (1, 4, 4, 3, False),
    (2, 8, 6, 5, True),
    (3, 6, 10, 7, False),
    (2, 16, 16, 16, True),
]


@needs_diffusers
@pytest.mark.parametrize("batch, height, width, txt_len, guidance", SHAPES)
def test_velocity_matches_diffusers(batch, height, width, txt_len, guidance):
    args = _args(guidance)
    model = _random_model(args)
    ref = _diffusers_model(args, model.state_dict())
    x = _inputs(args, batch, height, width, txt_len, guidance)
    with torch.no_grad():
        ours = model(**x)
    theirs = _diffusers_forward(ref, x)
    assert ours.shape == (batch, height * width // 4, args.out_channels)
    assert theirs.abs().max() > 0.1  # random weights: a non-trivial velocity
    assert _rel(ours, theirs) <= PARITY_RTOL


@needs_diffusers
@pytest.mark.parametrize("guidance", [False, True])
def test_adapter_round_trip_is_exact(guidance):
    args = _args(guidance)
    state = _random_model(args, seed=3).state_dict()
    hf_state = hf_adapter.to_hf(state, args)
    assert set(hf_state) == set(_diffusers_model(args).state_dict())
    back = hf_adapter.from_hf(hf_state, args)
    assert set(back) == set(state) and all(torch.equal(back[k], v) for k, v in state.items())
    assert hf_adapter.args_from_hf_config(hf_adapter.hf_config(args)) == args
    with pytest.raises(ValueError, match="^bogus.weight: not a parameter"):
        hf_adapter.from_hf({"bogus.weight": torch.zeros(1)}, args)


@needs_diffusers
def test_convert_to_diffusers_and_back(tmp_path):
    """scripts/convert.py: DCP -> diffusers folder (loadable by from_pretrained, same velocity)
    -> DCP with the same tensors."""
    import torch.distributed.checkpoint as dcp

    from models import get_model_family
    from trainer.checkpoint import write_manifest
    from trainer.hf_convert import convert_from_hf, convert_to_hf

    args = _args(True)
    model = _random_model(args, seed=5)
    ckpt = tmp_path / "step-1"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt))
    write_manifest(ckpt)
    family = get_model_family("flux")
    files = convert_to_hf(tmp_path, family, args, tmp_path / "hf")
    assert [f.name for f in files] == ["diffusion_pytorch_model.safetensors"]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["_class_name"] == "FluxTransformer2DModel"
    from diffusers import FluxTransformer2DModel

    ref = FluxTransformer2DModel.from_pretrained(str(tmp_path / "hf"))
    x = _inputs(args, 2, 6, 8, 4, True)
    with torch.no_grad():
        assert _rel(model(**x), _diffusers_forward(ref, x)) <= PARITY_RTOL
    name, args_back = convert_from_hf(tmp_path / "hf", tmp_path / "dcp")
    assert name == "flux" and args_back == args
    loaded = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    dcp.load({"model": loaded}, checkpoint_id=str(tmp_path / "dcp"))
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


def test_convert_cli_rejects_a_bad_flux_folder(tmp_path, capsys):
    from scripts.convert import main

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel", "patch_size": 2}))
    from safetensors.torch import save_file

    save_file({"x_embedder.weight": torch.zeros(1)}, str(tmp_path / "hf" / "diffusion_pytorch_model.safetensors"))
    assert main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "patch_size" in err[0]


# --- latents -------------------------------------------------------------------------------


@needs_diffusers
def test_latents_round_trip_and_match_diffusers_packing():
    from diffusers import FluxPipeline

    x = torch.randn(2, 16, 6, 10)
    packed = latents.pack(x)
    assert packed.shape == (2, 15, 64)
    assert torch.equal(latents.unpack(packed, 6, 10), x)
    assert torch.equal(packed, FluxPipeline._pack_latents(x, 2, 16, 6, 10))
    ids = latents.image_ids(2, 6, 10)
    assert ids.shape == (2, 15, 3) and torch.equal(ids[0], ids[1])
    assert torch.equal(ids[0], FluxPipeline._prepare_latent_image_ids(2, 3, 5, "cpu", torch.float32))
    assert torch.equal(latents.text_ids(2, 7), torch.zeros(2, 7, 3))
    # token (row r, col c) holds latent pixels [2r:2r+2, 2c:2c+2], channel-major
    assert torch.equal(packed[1, 5 * 1 + 2].view(16, 2, 2), x[1, :, 2:4, 4:6])
    with pytest.raises(ValueError, match="even"):
        latents.pack(torch.zeros(1, 16, 5, 4))


# --- init ----------------------------------------------------------------------------------


def test_meta_build_and_init_weights_is_adaln_zero():
    args = _args(True)
    with torch.device("meta"):
        model = FluxTransformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        if ".modulation." in name or "_mod." in name or name.startswith("final_layer."):
            assert not p.any(), name  # adaLN-Zero: modulation and output start at zero
        elif "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith(".bias"):
            assert not p.any(), name
        elif name.startswith(("time_in", "vector_in", "guidance_in")):
            assert abs(p.std().item() - 0.02) < 0.002, name
        else:  # xavier uniform: std = sqrt(2 / (fan_in + fan_out))
            expected = (2 / sum(p.shape)) ** 0.5
            assert abs(p.std().item() / expected - 1) < 0.1, name
    x = _inputs(args, 2, 4, 4, 3, True)
    out = model(**x)
    assert model.pop_aux_loss() is None
    assert not out.any()  # zero velocity at init ...
    out.sum().backward()
    assert model.final_layer.linear.weight.grad.abs().sum() > 0  # ... but a gradient that learns
    with pytest.raises(ValueError, match="^guidance:"):
        model(**{**x, "guidance": None})


# --- FLOPs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("guidance", [False, True])
def test_flops_match_flop_counter(guidance):
    """Exact, with SDPA's math backend (its bmm's are counted). With the default CPU kernel
    FlopCounterMode counts no attention FLOPs at all (it has no formula for
    `_scaled_dot_product_flash_attention_for_cpu`). Training: FlopCounterMode counts what
    runs, i.e. 3x forward minus the input-gradient matmuls of the first linears, whose inputs
    need no gradient (`first_layer_flops_per_sample`)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    args = _args(guidance)
    model = FluxTransformer(args)
    batch, height, width, txt_len = 2, 8, 6, 5
    x = _inputs(args, batch, height, width, txt_len, guidance)
    img_tokens = height * width // 4
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as fwd, torch.no_grad():
            model(**x)
        with FlopCounterMode(display=False) as train:
            model(**x).sum().backward()
    assert fwd.get_total_flops() == batch * forward_flops_per_sample(args, img_tokens, txt_len)
    expected = flops_per_sample(args, img_tokens, txt_len) - first_layer_flops_per_sample(args, img_tokens, txt_len)
    assert train.get_total_flops() == batch * expected
    assert flops_per_sample(args, img_tokens, txt_len) == 3 * forward_flops_per_sample(args, img_tokens, txt_len)


def test_flux_dev_flops_per_sample_at_1024px():
    """1024x1024 image = 128x128 latent = 4096 image tokens, 512 T5 tokens. Block matmul FLOPs
    are 6 x weights x the tokens through them: every token goes through every single block,
    but through only one of a double block's two streams (image or text weights). The
    embedders, modulation and input/output linears add well under 1 %."""
    args = FLAVORS["flux-dev"]
    L, S = 4096, 512
    T = L + S
    flops = flops_per_sample(args, L, S)
    h, m = args.hidden_size, args.mlp_hidden_dim
    per_layer = 4 * h * h + 2 * h * m  # q, k, v, out, MLP in, MLP out
    approx = 6 * T * per_layer * (args.depth + args.depth_single_blocks) + 3 * 4 * T * T * h * args.n_layers
    assert 0 < flops / approx - 1 < 0.01
    assert 2.0e14 < flops < 2.5e14  # ~223 TFLOPs per 1024px training sample


# --- parallelism, AC, compile, bf16 --------------------------------------------------------


def _loss(out: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    return (out * proj).mean()


def _parallel_rank(world_size: int, degrees: dict, state: dict, x: dict, proj: torch.Tensor, compile_backend=None):
    from parallelisms import ParallelDims, build_mesh, parallelize_model
    from tests.support.parallel_harness import full, load_full_state

    dims = ParallelDims(world_size=world_size, **degrees)
    mesh = build_mesh(dims, "cpu")
    args = _args(True)
    with torch.device("meta"):
        model = FluxTransformer(args)
    parallelize_model(
        model,
        plan=PLAN,
        parallel_dims=dims,
        mesh=mesh,
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
        ac_mode="selective" if compile_backend else "none",
        compile_backend=compile_backend,
    )
    model.to_empty(device="cpu")
    load_full_state(model, state)
    rank, n = dims.dp_rank(mesh), dims.dp_degree
    local = {k: (v.chunk(n)[rank] if v is not None else None) for k, v in x.items()}
    out = model(**local)
    _loss(out, proj.chunk(n)[rank]).backward()
    return out.detach(), {name: full(p.grad).detach() for name, p in model.named_parameters()}


PARALLEL_CASES = [
    pytest.param(2, dict(dp_shard=1, tp=2), None, id="tp2"),
    pytest.param(2, dict(dp_shard=2), None, id="fsdp2"),
    # per-block compile (aot_eager) + selective AC over the TP blocks: DTensor, the TP hooks and
    # the all-reduces traced into each block's graph
    pytest.param(2, dict(dp_shard=1, tp=2), "aot_eager", id="tp2-compile", marks=pytest.mark.slow),
    pytest.param(4, dict(dp_shard=2, tp=2), None, id="fsdp2xtp2", marks=pytest.mark.slow),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size, degrees, compile_backend", PARALLEL_CASES)
def test_tp_and_fsdp_match_single_process(world_size, degrees, compile_backend):
    from tests.support.parallel_harness import run_processes

    args = _args(True)
    model = _random_model(args, seed=7)
    x = _inputs(args, 2, 8, 6, 5, True)
    proj = torch.randn(2, 12, args.out_channels, generator=torch.Generator().manual_seed(2))
    out = model(**x)
    _loss(out, proj).backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    state = {k: v.detach() for k, v in model.state_dict().items()}
    results = run_processes(world_size, _parallel_rank, world_size, degrees, state, x, proj, compile_backend)
    tp = degrees.get("tp", 1)
    outs = [r[0] for r in results]
    for rank in range(world_size):
        assert torch.equal(outs[rank], outs[rank - rank % tp])  # replicated over TP
    par_out = torch.cat(outs[::tp])  # the dp ranks' batch slices, in order
    assert _rel(par_out, out.detach()) <= PARALLEL_RTOL
    for rank_grads in (r[1] for r in results):
        assert set(rank_grads) == set(ref_grads)
        worst = max((_rel(rank_grads[n], ref_grads[n]), n) for n in ref_grads)
        assert worst[0] <= PARALLEL_RTOL, worst


def test_tp_plan_covers_every_block_parameter():
    """Every parameter inside a block has a TP style (the TP check of parallelize_model needs
    it), found through plan paths that exist in the blocks."""
    with torch.device("meta"):
        model = FluxTransformer(_args(True))
    for _, block in PLAN.iter_blocks(model):
        styled = [path for path in PLAN.tp_block if _has(block, path)]
        for name, _ in block.named_parameters():
            assert any(name.startswith(path + ".") for path in styled), name


def test_tp2_bf16_forward_backward():
    """TP=2 with bf16 compute (SimpleFSDP's cast of the TP DTensors, fp32 reduction) on a
    threaded process group: runs, gradients finite, velocity within 5e-2 of fp32 one-process
    (the bf16 bound of test_bf16_forward_backward; measured 1e-2)."""
    from parallelisms import ParallelDims, build_mesh, parallelize_model
    from tests.support.parallel_harness import full, load_full_state, run_threads

    args = _args(True)
    model = _random_model(args, seed=7)
    x = _inputs(args, 2, 8, 6, 5, True)
    proj = torch.randn(2, 12, args.out_channels)
    ref = model(**x).detach()
    state = {k: v.detach() for k, v in model.state_dict().items()}

    def on_rank():
        dims = ParallelDims(world_size=2, dp_shard=1, tp=2)
        with torch.device("meta"):
            tp_model = FluxTransformer(args)
        parallelize_model(
            tp_model,
            plan=PLAN,
            parallel_dims=dims,
            mesh=build_mesh(dims, "cpu"),
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32,
        )
        tp_model.to_empty(device="cpu")
        load_full_state(tp_model, state)
        out = tp_model(**x)
        _loss(out, proj).backward()
        return out.detach(), all(torch.isfinite(full(p.grad)).all() for p in tp_model.parameters())

    for out, finite in run_threads(2, on_rank):
        assert out.dtype == torch.bfloat16 and finite
        assert _rel(out, ref) <= 5e-2


def test_tp_without_the_replicate_style_is_refused():
    """The modulation linears are the block parameters that `replicate` covers: without it,
    parallelize_model's TP check refuses the plan (their gradient would not be a TP DTensor),
    so the check is not satisfied vacuously. Meta device, threaded process group."""
    from models.common.plan import ModelPlan
    from models.errors import ConfigError
    from parallelisms import ParallelDims, build_mesh, parallelize_model
    from tests.support.parallel_harness import run_threads

    plan = ModelPlan(block=PLAN.block, tp={}, tp_block={k: v for k, v in PLAN.tp_block.items() if v != "replicate"})

    def on_rank(plan):
        dims = ParallelDims(world_size=2, dp_shard=1, tp=2)
        with torch.device("meta"):
            model = FluxTransformer(_args(True))
        try:
            parallelize_model(
                model, plan=plan, parallel_dims=dims, mesh=build_mesh(dims, "cpu"), param_dtype=torch.float32
            )
        except ConfigError as e:
            return str(e)
        return None

    assert run_threads(2, lambda: on_rank(PLAN)) == [None, None]
    errors = run_threads(2, lambda: on_rank(plan))
    assert all(e is not None and "double_blocks.0.img_mod.lin.weight" in e for e in errors), errors


def _has(module, path):
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


def _train_grads(model, x, proj):
    out = model(**x)
    _loss(out, proj).backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_attention_goes_through_the_ops_registry_and_its_reference_is_the_plain_sdpa():
    """Every block's joint attention calls the registry's `attention` ([B, heads, T, head_dim],
    so a TPU run gets the full-mask splash kernel), and on the CPU the output is bitwise what the
    direct `F.scaled_dot_product_attention` call gave before the op existed."""
    from models.common import ops
    from models.flux import model as flux_model

    args = _args(True)
    x = _inputs(args, 2, 4, 6, 3, True)
    model = _random_model(args)
    with torch.no_grad():
        want = model(**x)
    calls = []

    def spy(q, k, v):
        calls.append(tuple(q.shape))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    ops.register("attention", spy)
    try:
        with torch.no_grad():
            got = model(**x)
    finally:
        ops.register("attention", None)
    assert len(calls) == args.depth + args.depth_single_blocks, calls
    heads = args.num_heads
    assert set(calls) == {(2, heads, 3 + 2 * 3, args.hidden_size // heads)}, calls
    assert torch.equal(got, want)
    assert flux_model.ops is ops


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_is_exact(mode):
    from parallelisms import apply_ac

    args = _args(True)
    x = _inputs(args, 2, 4, 6, 3, True)
    proj = torch.randn(2, 6, 64)
    ref_out, ref_grads = _train_grads(_random_model(args), x, proj)
    model = apply_ac(_random_model(args), plan=PLAN, mode=mode)
    out, grads = _train_grads(model, x, proj)
    assert torch.equal(out, ref_out)
    assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)


def test_per_block_compile_matches_eager():
    """aot_eager: the captured block graphs (fullgraph, one per block kind) run the same ATen
    ops; equal up to float32 reordering (1e-5 relative)."""
    from parallelisms import apply_ac, apply_compile

    torch._dynamo.reset()
    args = _args(True)
    x = _inputs(args, 2, 4, 6, 3, True)
    proj = torch.randn(2, 6, 64)
    ref_out, ref_grads = _train_grads(_random_model(args), x, proj)
    model = apply_compile(apply_ac(_random_model(args), plan=PLAN, mode="selective"), plan=PLAN, backend="aot_eager")
    out, grads = _train_grads(model, x, proj)
    assert _rel(out, ref_out) <= 1e-5
    assert max(_rel(grads[n], ref_grads[n]) for n in ref_grads) <= 1e-5


def test_bf16_forward_backward():
    """bf16 weights (SimpleFSDP's single-process cast) and float32 inputs: runs, and the
    velocity is within 5e-2 relative of float32 (bf16 has 8 mantissa bits, 3.9e-3 relative
    rounding per op, accumulated over ~10 sequential matmul/norm stages)."""
    from parallelisms import data_parallel

    args = _args(True)
    x = _inputs(args, 2, 4, 6, 3, True)
    proj = torch.randn(2, 6, 64)
    ref_out, _ = _train_grads(_random_model(args), x, proj)
    model = data_parallel(_random_model(args), mesh=None, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out, grads = _train_grads(model, x, proj)
    assert out.dtype == torch.bfloat16
    assert _rel(out, ref_out) <= 5e-2
    assert all(torch.isfinite(g).all() for g in grads.values())
