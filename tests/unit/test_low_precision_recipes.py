"""The low-precision pod recipes (configs/*_v7x_fp8.toml, *_v6e_int8.toml) are their bf16 parent
plus `[quantize]`: the config system has no include, so each is a whole recipe, and this test keeps
it in step with its parent. Only `[quantize]`, `[job] dump_folder`, `[job] description`, the
checkpoint folder's recipe name and (float8 experts on v7x) a scoped VMEM limit may differ; the recipe names a recipe its target runs natively (v7x: float8, v6e: int8)."""

from __future__ import annotations

import dataclasses
import glob
import os

import pytest

from trainer.config import build_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VARIANTS = sorted(
    glob.glob(os.path.join(ROOT, "configs", "*_fp8.toml")) + glob.glob(os.path.join(ROOT, "configs", "*_int8.toml"))
)
EXPECTED = {
    "llama3_405b_v7x_fp8.toml": "float8_tensorwise",
    "qwen3_235b_a22b_v7x_fp8.toml": "float8_rowwise",
    "deepseek_v3_671b_v7x_fp8.toml": "float8_rowwise",
    "llama3_70b_v6e_int8.toml": "int8",
    "qwen3_32b_v6e_int8.toml": "int8",
}

FLOAT8_GATHER = {"llama3_405b_v7x_fp8.toml"}
"""Variants that all-gather their float8_tensorwise weights in float8 (FSDP only, no TP)."""

VMEM_CAP = {"qwen3_235b_a22b_v7x_fp8.toml", "deepseek_v3_671b_v7x_fp8.toml"}
"""Variants whose float8 experts' ragged dots need a scoped VMEM limit under the v7x bundle's whole
64 MiB: their libtpu_init_args are the parent's plus `--xla_tpu_scoped_vmem_limit_kib=61440`."""


def test_every_variant_is_listed():
    assert sorted(os.path.basename(v) for v in VARIANTS) == sorted(EXPECTED)


def _diff(a, b, prefix=""):
    if dataclasses.is_dataclass(a):
        out = []
        for f in dataclasses.fields(a):
            out += _diff(getattr(a, f.name), getattr(b, f.name), f"{prefix}{f.name}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


@pytest.mark.parametrize("variant", VARIANTS, ids=os.path.basename)
def test_a_variant_is_its_parent_plus_quantize(variant):
    name = os.path.basename(variant)
    parent = variant.replace("_fp8.toml", ".toml").replace("_int8.toml", ".toml")
    parent_stem = os.path.basename(parent)[:-5]
    cfg, base = build_config(variant), build_config(parent)
    assert base.quantize.recipe == "none"
    assert cfg.quantize.recipe == EXPECTED[name]
    differ = _diff(cfg, base)
    allowed = {"job.dump_folder", "job.description", "quantize.recipe", "checkpoint.folder"}
    if name in FLOAT8_GATHER:
        allowed.add("quantize.fsdp_float8_all_gather")
    if name in VMEM_CAP:
        allowed.add("device.libtpu_init_args")
        assert list(cfg.device.libtpu_init_args) == [
            *base.device.libtpu_init_args,
            "--xla_tpu_scoped_vmem_limit_kib=61440",
        ]
    assert cfg.quantize.fsdp_float8_all_gather == (name in FLOAT8_GATHER)
    assert set(differ) == allowed, differ
    assert cfg.job.dump_folder == base.job.dump_folder + name[len(os.path.basename(parent)) - 5 : -5]
    # its own checkpoint folder (the bucket placeholder, trainer/config/placeholders.py), named like the recipe
    assert cfg.checkpoint.folder == base.checkpoint.folder.replace(f"/{parent_stem}/", f"/{name[:-5]}/")
    assert cfg.job.description.startswith(base.job.description)
    # the target's native low-precision format
    assert ("float8" in cfg.quantize.recipe) == cfg.job.target.startswith("v7x")
