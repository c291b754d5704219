"""FP8 hub checkpoints (DeepSeek-V3 / Kimi K2 format: float8_e4m3fn weights with a float32
`weight_scale_inv` per 128x128 block; trainer/checkpoint/hf_fp8.py, docs/low_precision.md).

A small DeepSeek-V3 is written in that format with random fp8 values and random scales, its
dims chosen so that most weights end in partial blocks (192 = 128 + 64 columns, 80, 160, 320
rows). The dequantized reference is a block loop written here. Checked: the trainer's initial
load and `convert.py from-hf` give exactly the reference, every box a rank could read equals the
reference's box and reads only its fp8 bytes and the scales of its blocks, the logits of the
model loaded from fp8 equal those loaded from an fp32 folder of the reference; ours -> fp8 hub
format (`to-hf --hf-format fp8_blockwise`) -> ours stays within e4m3's rounding bound; bad
folders are one error line.

The bound: quantization divides a block by s = amax / 448, so every value lies in [-448, 448],
and the float8 cast rounds to nearest: an error of at most half the spacing of e4m3 there. With
3 mantissa bits the spacing of normal values (|v| >= 2^-6) is 2^(e - 3) for |v| in [2^e, 2^(e+1)),
so half of it is at most 2^-4 |v|; below 2^-6 (subnormals) the spacing is 2^-9, half is 2^-10.
Back in weight units (times s): |w - deq| <= 2^-4 |w| + 2^-10 s, plus the float32 rounding of
w / s and of q * s (2^-24 relative each), covered by a factor 1 + 2^-20.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

import models
from models.common.quantize import E4M3, Operand, dequantize, quantize
from models.deepseek_v3 import FLAVORS, DeepSeekV3
from models.deepseek_v3 import hf_adapter as ds_hf
from models.errors import ConfigError
from trainer import checkpoint as ckpt
from trainer.checkpoint.hf_fp8 import HUB_QUANTIZATION_CONFIG

ROOT = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location("convert", ROOT / "scripts" / "convert.py")
convert = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(convert)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# Edge blocks everywhere: dim 192 = 128 + 64, wkv_a 64 + 16 = 80 rows, experts 160, dense 320.
ARGS = dataclasses.replace(
    FLAVORS["debugmodel"],
    dim=192,
    n_layers=3,
    n_dense_layers=1,
    hidden_dim=320,
    moe_hidden_dim=160,
    num_experts=4,
    num_expert_groups=2,
    num_limited_groups=1,
    vocab_size=512,
    max_seq_len=1024,
)
# Quantized per layer: 5 attention linears (q_a, q_b, kv_a, kv_b, o); the dense block's 3 MLP
# linears; each MoE block's 3 shared-expert and 4 x 3 routed-expert linears.
N_FP8 = 3 * 5 + 3 + 2 * (3 + 4 * 3)


def _hub_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """HF names and shapes of ARGS, float32, seeded (norms away from 1, a nonzero selection bias)."""
    torch.manual_seed(seed)
    model = DeepSeekV3(ARGS)
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.normal_(0, 0.1)
    return {k: v.contiguous() for k, v in ds_hf.to_hf(model.state_dict(), ARGS).items()}


def _reference_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The format's definition, block by block: weight[block (i, j)] = q[block].float() * s[i, j]."""
    out = torch.empty(q.shape, dtype=torch.float32)
    rows, cols = q.shape
    for i in range(math.ceil(rows / 128)):
        for j in range(math.ceil(cols / 128)):
            block = (slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128))
            out[block] = q[block].to(torch.float32) * s[i, j]
    return out


def _write(
    folder: Path,
    tensors: dict[str, torch.Tensor],
    *,
    quantization: dict | None,
    split: bool = False,
    model_type: str = "deepseek_v3",
) -> None:
    """config.json (with `quantization_config` if given) and the safetensors; `split`: two files
    with an index, every scale in the other file than its weight (the index names each)."""
    folder.mkdir(parents=True)
    config = {**ds_hf.hf_config(ARGS), "model_type": model_type}
    if quantization is not None:
        config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    if not split:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    stems = {k: "model-b" if k.endswith("_scale_inv") or ".layers.0." in k else "model-a" for k in tensors}
    for stem in ("model-a", "model-b"):
        save_file({k: v for k, v in tensors.items() if stems[k] == stem}, str(folder / f"{stem}.safetensors"))
    index = {"metadata": {}, "weight_map": {k: f"{s}.safetensors" for k, s in stems.items()}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory) -> tuple[Path, dict, dict]:
    """An FP8 hub folder of ARGS with random fp8 values and random scales (not made by our
    quantizer), split over two files, its config.json a Kimi K2 one (`model_type: kimi_k2`; the
    round trip below covers `deepseek_v3`); returns (folder, its tensors, the dequantized reference)."""
    gen = torch.Generator().manual_seed(1)
    tensors, reference = {}, {}
    # V3's multi-token-prediction layer (`model.layers.{n_layers}`, fp8 `eh_proj`): paired, then skipped.
    mtp = f"model.layers.{ARGS.n_layers}."
    extra = {mtp + "eh_proj.weight": torch.zeros(ARGS.dim, 2 * ARGS.dim), mtp + "enorm.weight": torch.ones(ARGS.dim)}
    for key, value in {**_hub_state_dict(), **extra}.items():
        if not (ds_hf.fp8_hub_weight(key, tuple(value.shape)) or key.endswith("eh_proj.weight")):
            tensors[key] = value.to(torch.bfloat16)  # the hub stores the rest in bf16
            reference[key] = tensors[key].float()
            continue
        q = (torch.randn(value.shape, generator=gen) * 120).clamp(-448, 448).to(torch.float8_e4m3fn)
        s = torch.exp(torch.randn(math.ceil(value.shape[0] / 128), math.ceil(value.shape[1] / 128), generator=gen))
        s = s * 1e-4
        tensors[key], tensors[key + "_scale_inv"] = q, s
        reference[key] = _reference_dequant(q, s)
    folder = tmp_path_factory.mktemp("fp8") / "hf"
    _write(folder, tensors, quantization=dict(HUB_QUANTIZATION_CONFIG), split=True, model_type="kimi_k2")
    return folder, tensors, reference


def _loaded(path: Path) -> DeepSeekV3:
    model = DeepSeekV3(ARGS)  # fp32 master weights
    ckpt.load_initial(model, path=path, fmt="hf", hf_adapter=ds_hf, args=ARGS)
    return model.eval()


def test_fp8_folder_loads_dequantized(fp8_folder, tmp_path):
    folder, tensors, reference = fp8_folder
    assert sum(v.dtype == torch.float8_e4m3fn for v in tensors.values()) == N_FP8 + 1  # + eh_proj
    # transformers reads the format the same way (its FP8 backward's dequantization, which
    # handles partial edge blocks): a second implementation of the block loop above.
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    for key, value in tensors.items():
        if value.dtype == torch.float8_e4m3fn:
            theirs = _dequantize_fp8_weight(value, tensors[key + "_scale_inv"], [128, 128], torch.float32)
            assert torch.equal(theirs, reference[key]), key
    want = ds_hf.from_hf(reference, ARGS)
    got = _loaded(folder)
    for name, value in got.state_dict().items():
        assert torch.equal(value, want[name].to(value.dtype)), name
    # An adapter with only `from_hf` (every rank reads the whole files): the same weights.
    whole = DeepSeekV3(ARGS)
    ckpt.load_initial(whole, path=folder, fmt="hf", hf_adapter=ds_hf.from_hf, args=ARGS)
    assert all(torch.equal(v, want[k]) for k, v in whole.state_dict().items())
    # The same weights from an fp32 folder of the reference: the same logits, bit for bit.
    _write(tmp_path / "fp32", reference, quantization=None)
    plain = _loaded(tmp_path / "fp32")
    tokens = torch.randint(0, ARGS.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(got(tokens), plain(tokens))
    # convert.py from-hf: a DCP checkpoint of the dequantized weights (float32: the product q * s).
    assert convert.main(["from-hf", str(folder), str(tmp_path / "dcp")]) == 0
    loaded = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in want.items()}
    dcp.load({"model": loaded}, checkpoint_id=str(tmp_path / "dcp"))
    for name, value in loaded.items():
        assert torch.equal(value, want[name].float()), name


def test_every_box_reads_its_fp8_bytes_and_block_scales(fp8_folder):
    """A rank's shard is a box of the weight at any offset (TP/FSDP rows, single RoPE rows): each
    box equals the reference's, read from the fp8 box and the scales of the blocks it touches."""
    folder, tensors, reference = fp8_folder
    reader = ckpt.SafetensorsSlices(ckpt.safetensors_files(folder), fp8_block=(128, 128))
    assert not any(k.endswith("_scale_inv") for k in reader.shapes())
    key = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"  # [80, 192]: one partial block row
    big = "model.layers.0.mlp.down_proj.weight"  # [192, 320]: 2 x 3 blocks, all edges partial
    gen = torch.Generator().manual_seed(2)
    for name in (key, big, "model.layers.2.mlp.experts.3.up_proj.weight"):
        rows, cols = tensors[name].shape
        assert reader.dtype(name) == torch.float32
        for _ in range(12):
            r0, c0 = (int(torch.randint(0, n, (1,), generator=gen)) for n in (rows, cols))
            r1 = int(torch.randint(r0 + 1, rows + 1, (1,), generator=gen))
            c1 = int(torch.randint(c0 + 1, cols + 1, (1,), generator=gen))
            before = reader.bytes_read
            box = reader.read(name, (slice(r0, r1), slice(c0, c1)))
            blocks = (math.ceil(r1 / 128) - r0 // 128) * (math.ceil(c1 / 128) - c0 // 128)
            assert reader.bytes_read - before == (r1 - r0) * (c1 - c0) + 4 * blocks
            assert torch.equal(box, reference[name][r0:r1, c0:c1]), (name, r0, r1, c0, c1)
    reader.release()


def _each(scale_inv: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The scale of each element's block."""
    return scale_inv[torch.arange(shape[0]) // 128][:, torch.arange(shape[1]) // 128]


def test_sharded_load_fsdp2_x_tp2(fp8_folder):
    """Four thread ranks, FSDP 2 x TP 2: each rank's shards (row boxes that start inside a block,
    e.g. 40 of wkv_a's 80 rows) load dequantized, and the gathered weights equal the reference."""
    from parallelisms import ParallelDims, build_mesh, parallelize_model
    from tests.support.parallel_harness import full, run_threads

    folder, _, reference = fp8_folder
    want = ds_hf.from_hf(reference, ARGS)
    plan = models.get_model_family("deepseek_v3").plan

    def rank_fn():
        dims = ParallelDims(world_size=4, dp_shard=2, tp=2)
        with torch.device("meta"):
            model = DeepSeekV3(ARGS)
        parallelize_model(
            model,
            plan=plan,
            parallel_dims=dims,
            mesh=build_mesh(dims, "cpu"),
            param_dtype=torch.float32,
            reduce_dtype=torch.float32,
        )
        model.to_empty(device="cpu")
        ckpt.load_initial(model, path=folder, fmt="hf", hf_adapter=ds_hf, args=ARGS)
        return [name for name, p in model.named_parameters() if not torch.equal(full(p), want[name])]

    assert run_threads(4, rank_fn) == [[]] * 4


def _bound(want: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    return (2.0**-4 * want.abs() + 2.0**-10 * _each(scale_inv, want.shape)) * (1 + 2.0**-20)


def test_round_trip_ours_fp8_hub_ours(tmp_path):
    """ours (fp32) -> `to-hf --hf-format fp8_blockwise` -> `from-hf` -> ours: quantized weights within
    the e4m3 bound (module docstring), the rest bit for bit; transformers reads the format."""
    hub = _hub_state_dict(seed=3)
    model = DeepSeekV3(ARGS)
    model.load_state_dict(ds_hf.from_hf(hub, ARGS))
    step = tmp_path / "checkpoints" / "step-1"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(step))
    base = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"]
    debug = FLAVORS["debugmodel"]
    over = [
        f"--model.{f.name}={getattr(ARGS, f.name)}"
        for f in dataclasses.fields(ARGS)
        if getattr(ARGS, f.name) != getattr(debug, f.name)
    ]
    argv = ["to-hf", "--checkpoint", str(step), *base, *over, "--hf-format", "fp8_blockwise", str(tmp_path / "fp8")]
    assert convert.main(argv) == 0
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"] == HUB_QUANTIZATION_CONFIG
    written = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    errors = []
    for key, value in hub.items():
        if not ds_hf.fp8_hub_weight(key, tuple(value.shape)):
            assert written[key].dtype == torch.float32 and torch.equal(written[key], value), key
            continue
        q, s = written[key], written[key + "_scale_inv"]
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32, key
        assert s.shape == (math.ceil(value.shape[0] / 128), math.ceil(value.shape[1] / 128)), key
        deq = _reference_dequant(q, s)
        err = (deq - value).abs()
        assert (err <= _bound(value, s)).all(), (key, (err / _bound(value, s)).max())
        normal = value.abs() >= 2.0**-6 * _each(s, value.shape)  # e4m3 normals after division by s
        errors.append(((err / value.abs())[normal].max().item(), (err.norm() / value.norm()).item()))
        # The float8_blockwise recipe re-quantizes a dequantized master per 128x128 block: at the
        # first step it gets the checkpoint's fp8 values back.
        rq, rs = quantize(deq, Operand(E4M3, "block"))
        assert torch.equal(dequantize(rq, torch.ones_like(rs), tuple(value.shape)), q.float()), key
    assert len(errors) == N_FP8
    worst, frob = max(e[0] for e in errors), max(e[1] for e in errors)
    print(f"fp8 round trip: max relative error of normal elements {worst:.4g}, max relative Frobenius {frob:.4g}")
    assert worst <= 2.0**-4 * (1 + 2.0**-20)
    assert convert.main(["from-hf", str(tmp_path / "fp8"), str(tmp_path / "dcp")]) == 0
    back = {k: torch.empty(v.shape) for k, v in model.state_dict().items()}
    dcp.load({"model": back}, checkpoint_id=str(tmp_path / "dcp"))
    hub_back = ds_hf.to_hf(back, ARGS)
    for key, value in hub.items():
        if ds_hf.fp8_hub_weight(key, tuple(value.shape)):
            assert torch.equal(hub_back[key], _reference_dequant(written[key], written[key + "_scale_inv"])), key
        else:
            assert torch.equal(hub_back[key], value), key


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    return err[0]


def test_bad_fp8_folders_are_one_error_line(fp8_folder, tmp_path, capsys):
    _, tensors, _ = fp8_folder
    key = "model.layers.1.self_attn.o_proj.weight"
    good = dict(HUB_QUANTIZATION_CONFIG)
    cases = {
        "missing_scale": ({k: v for k, v in tensors.items() if k != key + "_scale_inv"}, good, [key, "is missing"]),
        "scale_shape": ({**tensors, key + "_scale_inv": torch.ones(1, 1)}, good, [key + "_scale_inv", "[2, 2]"]),
        "no_config": (tensors, None, ["declares no quantization_config", "quant_method"]),
        "method": (tensors, {**good, "quant_method": "awq"}, ["quant_method 'awq'", "allowed"]),
        "block": (tensors, {**good, "weight_block_size": [64, 64]}, ["weight_block_size [64, 64]", "[128, 128]"]),
    }
    for name, (folder_tensors, quantization, needles) in cases.items():
        folder = tmp_path / name
        _write(folder, folder_tensors, quantization=quantization)
        assert convert.main(["from-hf", str(folder), str(tmp_path / f"{name}-dcp")]) == 2, name
        line = _error_line(capsys)
        assert all(n in line for n in needles), (name, line)
        assert not (tmp_path / f"{name}-dcp").exists()
        with pytest.raises(ConfigError) as e:
            _loaded(folder)
        assert all(n in str(e.value) for n in needles) and "\n" not in str(e.value), (name, str(e.value))
    # The export flag: unknown value, or a family without the format.
    dcp_dir = tmp_path / "ckpt"
    dcp.save({"model": DeepSeekV3(ARGS).state_dict()}, checkpoint_id=str(dcp_dir))
    for argv, needle in (
        (["--model.name", "deepseek_v3", "--hf-format", "fp4"], "--hf-format: 'fp4' unknown; allowed: default"),
        (["--model.name", "llama3", "--hf-format", "fp8_blockwise"], "allowed: deepseek_v3"),
    ):
        full = ["to-hf", "--checkpoint", str(dcp_dir), "--model.flavor", "debugmodel", *argv, str(tmp_path / "o")]
        assert convert.main(full) == 2
        assert needle in _error_line(capsys)
        assert not (tmp_path / "o").exists()
