"""MXFP4 expert weights in Hugging Face checkpoints (gpt-oss on the hub): read dequantized.

The format (the OCP Microscaling spec's MXFP4; the gpt-oss model card and transformers'
`integrations/mxfp4.py`, whose `convert_moe_packed_tensors` reads it):
- config.json carries `"quantization_config": {"quant_method": "mxfp4", ...}`;
- an expert tensor `X` that transformers holds as [E, in, out] (`gate_up_proj` [E, dim,
  2 hidden], `down_proj` [E, hidden, dim]) is stored transposed and packed: `X_blocks`, uint8
  [E, out, in / 32, 16] (32 FP4 E2M1 values per block, two per byte, the low nibble first), and
  `X_scales`, uint8 [E, out, in / 32] (one E8M0 exponent per block, bias 127);
- element (e, i, o) of X is `FP4[nibble] * 2^(scale - 127)` of block i // 32 of row o.

`MXFP4Experts.pair` finds every `X_blocks` / `X_scales` pair from the safetensors headers (a
block without its scale, or a shape or dtype off: one ConfigError naming the file and tensor);
`SafetensorsSlices` (initial.py) then lists `X` [E, in, out] in place of the pair and `read`
returns a box of it, dequantized from the blocks and scales of the rows and blocks the box
touches. So the per-rank loader and `convert.py from-hf` read these folders like a BF16 copy.
Every value is exact in bfloat16 (2 mantissa bits times a power of two within bf16's exponent
range), the dtype `read` returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from models.errors import ConfigError

QUANT_METHOD = "mxfp4"
BLOCK = 32
"""Values per block (one shared exponent), the MX block size."""
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
E8M0_BIAS = 127

# E2M1: sign, 2 exponent bits (bias 1), 1 mantissa bit; code 0b0001 is the subnormal 0.5.
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_E2M1 = torch.tensor([*_MAGNITUDES, *(-m for m in _MAGNITUDES)], dtype=torch.float32)
"""The 16 E2M1 values by code (bit 3 the sign)."""


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 `blocks` [..., rows, G, 16] and `scales` [..., rows, G] -> bfloat16 [..., G * 32, rows]:
    each byte's low nibble the even element, its high nibble the odd one, times 2^(scale - 127),
    then the last two dims swapped (the stored [out, in] to transformers' [in, out])."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., rows, G, 16, 2]
    values = FP4_E2M1[codes].flatten(-2)  # [..., rows, G, 32]
    exponents = scales.to(torch.int32) - E8M0_BIAS
    values = torch.ldexp(values, exponents.unsqueeze(-1).to(torch.float32))
    return values.flatten(-2).transpose(-1, -2).to(torch.bfloat16)


@dataclass(frozen=True)
class MXFP4Experts:
    """The MXFP4 tensors of a set of safetensors: `packed[X] = (X_blocks, X_scales)`, and the
    shape [..., in, out] each dequantized `X` has."""

    packed: dict[str, tuple[str, str]]
    shapes: dict[str, tuple[int, ...]]

    @classmethod
    def pair(
        cls, tensors: Mapping[str, tuple[Path | str, tuple[int, ...], torch.dtype]], *, config: str | Path
    ) -> MXFP4Experts | None:
        """Pair each `X_blocks` with its `X_scales` from name -> (file, shape, dtype) (safetensors
        headers); None when there is none. ConfigError naming the file and tensor otherwise."""
        blocks = sorted(n for n in tensors if n.endswith(BLOCKS_SUFFIX))
        if not blocks:
            return None
        packed, shapes = {}, {}
        for name in blocks:
            file, shape, dtype = tensors[name]
            base = name.removesuffix(BLOCKS_SUFFIX)
            scale = base + SCALES_SUFFIX
            if dtype != torch.uint8 or len(shape) < 3 or shape[-1] != BLOCK // 2:
                raise ConfigError(
                    f"{file}: {name} is {str(dtype).removeprefix('torch.')} {list(shape)}; allowed: uint8 "
                    f"[..., rows, blocks, {BLOCK // 2}] (MXFP4: two FP4 values per byte, {BLOCK} per block)"
                )
            if scale not in tensors:
                raise ConfigError(
                    f"{file}: {name} is MXFP4 but {scale} is missing; allowed: each {BLOCKS_SUFFIX} tensor with "
                    f"its uint8 {SCALES_SUFFIX} of shape {list(shape[:-1])} ({config})"
                )
            scale_file, got, scale_dtype = tensors[scale]
            if tuple(got) != tuple(shape[:-1]) or scale_dtype != torch.uint8:
                raise ConfigError(
                    f"{scale_file}: {scale} is {str(scale_dtype).removeprefix('torch.')} {list(got)} for {name} "
                    f"{list(shape)}; allowed: uint8 {list(shape[:-1])} (one E8M0 exponent per block)"
                )
            if base in tensors:
                raise ConfigError(f"{file}: {base} is stored both as it is and as MXFP4; allowed: one of them")
            *lead, rows, groups, _ = shape
            packed[base] = (name, scale)
            shapes[base] = (*lead, groups * BLOCK, rows)
        orphans = sorted(n for n in tensors if n.endswith(SCALES_SUFFIX) and n not in {s for _, s in packed.values()})
        if orphans:
            file = tensors[orphans[0]][0]
            raise ConfigError(
                f"{file}: {orphans[0]} has no {orphans[0].removesuffix(SCALES_SUFFIX)}{BLOCKS_SUFFIX}; "
                f"allowed: a {SCALES_SUFFIX} tensor only beside its MXFP4 {BLOCKS_SUFFIX}"
            )
        return cls(packed, shapes)

    @property
    def stored_names(self) -> set[str]:
        return {n for pair in self.packed.values() for n in pair}

    def read(self, name: str, slices: tuple[slice, ...], raw_read: Callable) -> torch.Tensor:
        """The bfloat16 box `slices` of dequantized `name` [..., in, out]: the blocks and scales of
        rows out and of the blocks that cover in, through `raw_read(stored name, slices)`."""
        shape = self.shapes[name]
        slices = slices or tuple(slice(None) for _ in shape)
        bounds = [s.indices(n)[:2] for s, n in zip(slices, shape)]
        *lead, (i0, i1), (o0, o1) = bounds
        lead_slices = tuple(slice(a, b) for a, b in lead)
        if i1 <= i0 or o1 <= o0 or any(b <= a for a, b in lead):
            return torch.empty([b - a for a, b in bounds], dtype=torch.bfloat16)
        g0, g1 = i0 // BLOCK, -(-i1 // BLOCK)
        blocks_name, scales_name = self.packed[name]
        blocks = raw_read(blocks_name, (*lead_slices, slice(o0, o1), slice(g0, g1), slice(None)))
        scales = raw_read(scales_name, (*lead_slices, slice(o0, o1), slice(g0, g1)))
        full = dequantize(blocks, scales)  # [..., (g1 - g0) * 32, o1 - o0]
        return full[..., i0 - g0 * BLOCK : i1 - g0 * BLOCK, :]
