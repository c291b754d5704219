"""FP8 block-scaled Hugging Face checkpoints (DeepSeek-V3, Kimi K2 on the hub): read dequantized,
written by `scripts/convert.py to-hf --hf-format fp8_blockwise`.

The format (DeepSeek-V3's README_WEIGHTS.md, "FP8 Weight Documentation"; transformers'
`FineGrainedFP8Config` and `integrations/finegrained_fp8.py`, whose `Fp8Dequantize` reads it):
- config.json carries `"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
  "activation_scheme": "dynamic", "weight_block_size": [128, 128]}`;
- each quantized linear weight `X.weight` [rows, cols] is stored as float8_e4m3fn, next to
  `X.weight_scale_inv`, float32 [ceil(rows / 128), ceil(cols / 128)]: one multiplier per
  128 x 128 block, the edge blocks partial;
- the weight is `X.weight.float() * X.weight_scale_inv[i // 128, j // 128]` at element (i, j).

Reading: `FP8Blocks` pairs every float8 weight with its scale from the safetensors headers alone
(a missing scale, a scale of the wrong shape or dtype, a float8 weight in a folder whose config
declares no fp8 quantization: one ConfigError naming the file and tensor), and `dequantize_box`
turns the box of a weight that a rank reads into float32 from the fp8 box and only the scale
rows and columns that cover it; `SafetensorsSlices` (initial.py) hides the scales and returns
weights dequantized, so the per-rank loader and `convert.py from-hf` read these folders like any
other. The product `q * s` is computed in float32, as DeepSeek's `weight_dequant` kernel and
transformers do; a float32 master then holds the checkpoint's weights up to that one rounding.

Writing: `quantize_blocks` makes (fp8, scale_inv) with scale_inv = amax / 448 per block (448 is
e4m3's largest value; models/common/quantize.py's `block` scales, the same divisor the
`float8_blockwise` recipe uses), values divided by it, clamped to +-448 and rounded to nearest
by the float8 cast. Which tensors are quantized is the model family's rule (its adapter's
`fp8_hub_weight`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.common.quantize import E4M3, QMAX, Operand, scales
from models.errors import ConfigError

QUANT_METHOD = "fp8"
FMT = "e4m3"
BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"
HUB_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": FMT,
    "quant_method": QUANT_METHOD,
    "weight_block_size": list(BLOCK),
}
"""The `quantization_config` of DeepSeek-V3's and Kimi K2's config.json (and of what we write)."""

HF_FORMATS = ("default", "fp8_blockwise")
"""`convert.py to-hf --hf-format`: weights as stored (or `--dtype`), or the FP8 hub format."""

_ALLOWED = (
    'allowed: "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", '
    '"activation_scheme": "dynamic", "weight_block_size": [128, 128]} (DeepSeek-V3 / Kimi K2 FP8 checkpoints), '
    'or {"quant_method": "mxfp4"} (gpt-oss)'
)


def quantization_of(config: Mapping[str, Any], *, where: str | Path) -> tuple[int, int] | None:
    """The block size of config.json's FP8 `quantization_config`, or None if it has none;
    ConfigError naming `where` for any other quantization (method, fmt, block size, activation
    scheme), whose weights this trainer cannot read."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise ConfigError(f"{where}: quantization_config is {type(q).__name__}, not an object; {_ALLOWED}")
    method = q.get("quant_method")
    if method == "mxfp4":  # gpt-oss's MXFP4 experts: hf_mxfp4.py, paired by tensor name
        return None
    if method != QUANT_METHOD:
        raise ConfigError(f"{where}: quantization_config.quant_method {method!r} unsupported; {_ALLOWED}")
    if q.get("fmt", FMT) != FMT:
        raise ConfigError(f"{where}: quantization_config.fmt {q['fmt']!r} unsupported; {_ALLOWED}")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigError(
            f"{where}: quantization_config.activation_scheme {q['activation_scheme']!r} unsupported "
            f"(static activation scales are not read); {_ALLOWED}"
        )
    block = q.get("weight_block_size")
    if not isinstance(block, (list, tuple)) or tuple(block) != BLOCK:
        raise ConfigError(f"{where}: quantization_config.weight_block_size {block!r} unsupported; {_ALLOWED}")
    return BLOCK


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, ...]:
    """The `weight_scale_inv` shape of a weight: its leading dims, then ceil(rows / 128) x ceil(cols / 128)."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


@dataclass(frozen=True)
class FP8Blocks:
    """The float8 weights of a set of safetensors and their scales: `scale_of[weight] = scale`."""

    block: tuple[int, int]
    scale_of: dict[str, str]

    @classmethod
    def pair(
        cls,
        tensors: Mapping[str, tuple[Path | str, tuple[int, ...], torch.dtype]],
        block: tuple[int, int] | None,
        *,
        config: str | Path,
    ) -> FP8Blocks | None:
        """Pair each float8 weight with its `weight_scale_inv` from name -> (file, shape, dtype)
        (safetensors headers); None when there is nothing to dequantize. `block` is
        `quantization_of(config.json)`; ConfigError naming the file and tensor otherwise."""
        fp8 = {name for name, (_, _, dtype) in tensors.items() if dtype in (torch.float8_e4m3fn, torch.float8_e5m2)}
        scales_ = {name for name in tensors if name.endswith(SCALE_SUFFIX)}
        if not fp8 and not scales_:
            return None
        if block is None:
            name = sorted(fp8 or scales_)[0]
            raise ConfigError(
                f"{tensors[name][0]}: {name} is an FP8 checkpoint tensor, but {config} declares no "
                f"quantization_config; {_ALLOWED}"
            )
        scale_of = {}
        for name in sorted(fp8):
            file, shape, dtype = tensors[name]
            scale = name + SCALE_SUFFIX
            if dtype != torch.float8_e4m3fn:
                raise ConfigError(
                    f"{file}: {name} is {str(dtype).removeprefix('torch.')}; allowed: float8_e4m3fn (fmt e4m3)"
                )
            if len(shape) < 2:
                raise ConfigError(f"{file}: {name} is float8 of shape {list(shape)}; allowed: a matrix [rows, cols]")
            if scale not in tensors:
                raise ConfigError(
                    f"{file}: {name} is float8_e4m3fn but {scale} is missing; allowed: each float8 weight "
                    f"with its float32 block scale {scale} of shape {list(scale_shape(shape, block))}"
                )
            scale_file, got, scale_dtype = tensors[scale]
            want = scale_shape(shape, block)
            if tuple(got) != want or scale_dtype != torch.float32:
                raise ConfigError(
                    f"{scale_file}: {scale} is {str(scale_dtype).removeprefix('torch.')} {list(got)} for {name} "
                    f"{list(shape)}; allowed: float32 {list(want)} (one scale per {block[0]}x{block[1]} block)"
                )
            scale_of[name] = scale
        orphans = sorted(scales_ - set(scale_of.values()))
        if orphans:
            file, _, dtype = tensors[orphans[0]]
            weight = orphans[0][: -len(SCALE_SUFFIX)]
            what = f"is {str(tensors[weight][2]).removeprefix('torch.')}" if weight in tensors else "is missing"
            raise ConfigError(
                f"{file}: {orphans[0]} scales {weight}, which {what}; allowed: a scale only beside a float8_e4m3fn weight"
            )
        return cls(block, scale_of)

    @property
    def scale_names(self) -> set[str]:
        return set(self.scale_of.values())

    def read(self, name: str, slices: tuple[slice, ...], shape: tuple[int, ...], raw_read: Callable) -> torch.Tensor:
        """The float32 box `slices` of float8 weight `name` (full shape `shape`): its fp8 box and the
        scale rows/columns of the blocks the box touches, through `raw_read(name, slices)`."""
        slices = slices or tuple(slice(None) for _ in shape)
        bounds = [s.indices(n)[:2] for s, n in zip(slices, shape)]
        *lead, (r0, r1), (c0, c1) = bounds
        q = raw_read(name, tuple(slices))
        s_slices = (
            *(slice(a, b) for a, b in lead),
            slice(r0 // self.block[0], -(-r1 // self.block[0])),
            slice(c0 // self.block[1], -(-c1 // self.block[1])),
        )
        s = raw_read(self.scale_of[name], s_slices) if r1 > r0 and c1 > c0 else None
        return dequantize_box(q, s, self.block, start=(r0, c0))


def dequantize_box(
    q: torch.Tensor, s: torch.Tensor | None, block: tuple[int, int] = BLOCK, *, start: tuple[int, int] = (0, 0)
) -> torch.Tensor:
    """float32 `q * scale` for a box `q` [..., r, c] of a float8 weight whose top-left element is
    (`start`) in the weight, and `s` the scales of the blocks the box touches (from block
    start // block on). Each element is multiplied by its own block's scale, in float32."""
    out = q.to(torch.float32)
    if out.numel() == 0:
        return out
    return out * _per_element(s.to(torch.float32), tuple(q.shape), block, start)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [rows, cols] -> (float8_e4m3fn [rows, cols], float32 scale_inv [ceil(rows/128),
    ceil(cols/128)]) with scale_inv = amax / 448 per 128x128 block (an all-zero block: the smallest
    normal float32, its values 0), `w / scale_inv` clamped to +-448 and rounded to nearest even by
    the cast. `dequantize_box(q, scale_inv)` errs by at most half a spacing of e4m3 per element:
    2^-4 |w| where w / scale_inv is a normal e4m3 value, scale_inv 2^-10 below 2^-6 (subnormals)."""
    assert w.ndim == 2 and block == BLOCK, (w.shape, block)
    s = scales(w, Operand(E4M3, "block"))  # [ceil(rows/128), ceil(cols/128)]
    qmax = QMAX[E4M3]
    scaled = w.to(torch.float32) / _per_element(s, tuple(w.shape), block, (0, 0))
    q = scaled.clamp(-qmax, qmax).to(torch.float8_e4m3fn)
    return q, s.to(torch.float32).contiguous()


def _per_element(
    s: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int], start: tuple[int, int]
) -> torch.Tensor:
    """Block scales `s` (from block start // block on) spread to a box of `shape` at `start`: each
    element gets its own block's scale."""
    r0, c0 = start
    rows = torch.arange(r0, r0 + shape[-2]) // block[0] - r0 // block[0]
    cols = torch.arange(c0, c0 + shape[-1]) // block[1] - c0 // block[1]
    return s[..., rows, :][..., cols]


def quantize_hf_state_dict(
    hf_state_dict: Mapping[str, torch.Tensor], fp8_weight: Callable[[str, tuple[int, ...]], bool]
) -> dict[str, torch.Tensor]:
    """An HF state dict in the FP8 hub format: each tensor `fp8_weight(key, shape)` selects becomes
    float8 `key` and float32 `key + "_scale_inv"` (placed right after it); the rest pass through.
    Meta tensors give meta results of the right shapes and dtypes (for planning files)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in hf_state_dict.items():
        if not fp8_weight(key, tuple(value.shape)):
            out[key] = value
            continue
        if value.is_meta:
            out[key] = torch.empty(value.shape, dtype=torch.float8_e4m3fn, device="meta")
            out[key + SCALE_SUFFIX] = torch.empty(scale_shape(tuple(value.shape)), dtype=torch.float32, device="meta")
            continue
        out[key], out[key + SCALE_SUFFIX] = quantize_blocks(value)
    return out


def dequantize_hf_state_dict(
    hf_state_dict: Mapping[str, torch.Tensor], block: tuple[int, int] | None, *, files: str, config: str | Path
) -> dict[str, torch.Tensor]:
    """An in-memory HF state dict with its float8 weights dequantized (float32) and the scales
    dropped (the load path of adapters without `hf_layout`); `FP8Blocks.pair`'s checks first."""
    tensors = {k: (files, tuple(v.shape), v.dtype) for k, v in hf_state_dict.items()}
    pairs = FP8Blocks.pair(tensors, block, config=config)
    if pairs is None:
        return dict(hf_state_dict)
    out, scale_names = {}, pairs.scale_names
    for key, value in hf_state_dict.items():
        if key in scale_names:
            continue
        out[key] = (
            dequantize_box(value, hf_state_dict[pairs.scale_of[key]], pairs.block) if key in pairs.scale_of else value
        )
    return out
