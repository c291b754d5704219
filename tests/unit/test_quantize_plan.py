"""The quantize plan (trainer/step/quantize.py): what `[quantize]` picks in a model is counted before
anything is built, a recipe that picks nothing is refused by a rule naming the key that left each
linear out, and the banner states the count."""

from __future__ import annotations

import pytest

from models.errors import ConfigError
from parallelisms.quantize import QuantizePlan, apply_quantize
from trainer.config import build_config, resolve_model_args
from trainer.job import plan_job, step_request
from trainer.step import refusals
from trainer.step.quantize import quantize_census


def _cfg(*overrides: tuple[str, str], recipe: str = "configs/llama3_debug.toml"):
    return build_config(recipe, list(overrides))


def test_a_recipe_that_quantizes_nothing_is_refused_naming_min_dim():
    """The debug model's widths (256, 768) are below the default min_dim 1024: float8_rowwise would
    train in bf16 under a float8 label. One line, naming quantize.min_dim and the largest that works."""
    cfg = _cfg(("quantize.recipe", "float8_rowwise"))
    with pytest.raises(ConfigError) as e:
        plan_job(cfg, world_size=1, device_type="cpu")
    text = str(e.value)
    assert "\n" not in text
    assert text.startswith("quantize.min_dim: 1024 leaves none of this model's"), text
    assert "allowed: a min_dim of at most 256" in text and "quantize.recipe = none" in text
    family, _ = resolve_model_args(cfg.model, seq_len=cfg.training.seq_len)
    assert refusals(step_request(cfg, family)) == []  # the census unknown: no rule reads it


def test_a_filter_that_leaves_nothing_is_refused_naming_filter_fqns():
    cfg = _cfg(
        ("quantize.recipe", "int8"),
        ("quantize.min_dim", "0"),
        ("quantize.filter_fqns", '["attention", "feed_forward", "output"]'),
    )
    with pytest.raises(
        ConfigError, match=r"^quantize\.filter_fqns: \['attention', 'feed_forward', 'output'\] match all"
    ):
        plan_job(cfg, world_size=1, device_type="cpu")


def test_the_census_counts_what_apply_quantize_swaps():
    """The census and the swap agree (one rule, parallelisms/quantize.py `is_chosen`), and the
    banner line states them."""
    import torch

    cfg = _cfg(("quantize.recipe", "float8_rowwise"), ("quantize.min_dim", "0"), ("model.n_layers", "2"))
    plan = plan_job(cfg, world_size=1, device_type="cpu")
    census = plan.quantize_census
    family, args = resolve_model_args(cfg.model, seq_len=cfg.training.seq_len)
    with torch.device("meta"):
        model = family.model_cls(args)
    swapped = apply_quantize(model, recipe="float8_rowwise", min_dim=0)
    assert census.chosen == len(swapped) == 14 and census.linears == 15 and census.by_filter == 1
    assert census.line("float8_rowwise").startswith("quantize: float8_rowwise: 14 of 15 linears, 0 skipped by min_dim")
    assert (
        _cfg().quantize.recipe == "none" and plan_job(_cfg(), world_size=1, device_type="cpu").quantize_census is None
    )


def test_moe_experts_count_in_the_census():
    cfg = _cfg(("quantize.recipe", "float8_rowwise"), ("quantize.min_dim", "0"), recipe="configs/qwen3_moe_debug.toml")
    family, args = resolve_model_args(cfg.model, seq_len=cfg.training.seq_len)
    census = quantize_census(family, args, QuantizePlan.of(cfg.quantize))
    assert census.experts > 0 and census.experts_chosen == census.experts
    assert f"MoE experts: {census.experts} of {census.experts} layers" in census.line("float8_rowwise")
    left_out = quantize_census(family, args, QuantizePlan("float8_rowwise", ("output", "router.gate", "experts"), 0))
    assert left_out.experts_chosen == 0
