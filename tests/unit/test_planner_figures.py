"""The planner figures quoted in recipe comments and docs are the planner's of this commit (issue 52).

Tables of planner figures are generated (docs/planner.md `pod_recipes`, docs/optimizers.md
`optimizer_memory`: scripts/dev/gen_doc_blocks.py, checked by tests/unit/test_docs.py). The
figures quoted in prose are checked here against the planner (the one-block probe, as
`scripts/estimate.py --config` plans), within 0.1 GiB:
- every pod recipe's header: each "X GiB per device of U usable" is the recipe as shipped, each
  "X GiB per device against the parent's P" is the low-precision recipe and its parent, each
  compiled figure ("compiled X GiB", "the compiled program: X GiB", "compiler X GiB") is the
  recipe's latest docs/results/pod_compile_*.csv row;
- VARIANTS: a figure of the recipe with some keys changed (another EP degree, the dropless
  dispatch, Muon), found by a phrase.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gen_doc_blocks", ROOT / "scripts" / "dev" / "gen_doc_blocks.py")
blocks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(blocks)

GiB = 2**30
TOLERANCE = 0.1
HEADLINE = re.compile(r"(\d+\.\d+) GiB per device of (\d+\.\d+) usable")
PARENT = re.compile(r"(\d+\.\d+) GiB per device against the parent's (\d+\.\d+)")
COMPILED = re.compile(r"(?:compiled(?: program)?:?|compiler|compile at full depth:) (\d+\.\d+) GiB")
"""An undated compiled figure is the latest compile's; an older one says its date ("the compile of ...")."""

EP = "parallelism.expert_parallel_degree"
CAPACITY = "moe.capacity_factor"
BATCH = "training.local_batch_size"
DROPLESS = ((CAPACITY, "0"), (EP, "4"))
UNCHUNKED = ("moe.dispatch_chunks", "1")  # the dropless dispatch is not chunked (a rule)
VARIANTS = [
    # (file, recipe, overrides, phrase: a regex whose group is the figure in GiB)
    (
        "configs/llama3_405b_v7x.toml",
        "llama3_405b_v7x",
        (("parallelism.tensor_parallel_degree", "2"), (BATCH, "2"), ("parallelism.enable_loss_parallel", "true")),
        r"FSDP 256 x TP 2 at batch 2 \((\d+\.\d+) GiB",
    ),
    ("docs/planner.md", "flux_dev_v7x", (), r"(\d+\.\d+) GiB of 86\.4 usable per device \(blocks 57"),
    (
        "docs/planner.md",
        "llama3_405b_v7x",
        (("parallelism.tensor_parallel_degree", "2"), (BATCH, "2"), ("parallelism.enable_loss_parallel", "true")),
        r"picks FSDP 256 x TP 2 at batch 2 \((\d+\.\d+) GiB",
    ),
    (
        "docs/planner.md",
        "qwen3_235b_a22b_v7x",
        ((CAPACITY, "0"), UNCHUNKED, (BATCH, "2"), (EP, "32")),
        r"EP 32 \(235B on v7x-512: (\d+\.?\d*) GiB\)",
    ),
    (
        "docs/planner.md",
        "qwen3_30b_a3b_v6e",
        ((CAPACITY, "0"), (BATCH, "2"), (EP, "16")),
        r"EP 16 \(30B on v6e-256: (\d+\.\d+) GiB\)",
    ),
    ("configs/kimi_k2_v7x.toml", "kimi_k2_v7x", ((EP, "4"),), r"EP 4 would need (\d+\.\d+) GiB"),
    (
        "configs/kimi_k2_v7x.toml",
        "kimi_k2_v7x",
        (*DROPLESS, UNCHUNKED, (BATCH, "2")),
        r"EP 4 with 2 sequences \((\d+\.\d+) GiB",
    ),
    ("configs/kimi_k2_v7x.toml", "kimi_k2_v7x", (*DROPLESS, UNCHUNKED, (BATCH, "4")), r"not 4 \((\d+\.\d+) GiB\)"),
    (
        "configs/kimi_k2_v7x.toml",
        "kimi_k2_v7x",
        (("optimizer.name", "muon"),),
        r"planner gives (\d+\.\d+) GiB per device with --optimizer.name=muon",
    ),
    ("configs/deepseek_v3_671b_v7x.toml", "deepseek_v3_671b_v7x", ((EP, "4"),), r"EP 4 would need (\d+\.\d+) GiB"),
    (
        "configs/deepseek_v3_671b_v7x.toml",
        "deepseek_v3_671b_v7x",
        (*DROPLESS, UNCHUNKED, (BATCH, "2")),
        r"EP 4 with 2 sequences \((\d+\.\d+) GiB",
    ),
    (
        "configs/deepseek_v3_671b_v7x.toml",
        "deepseek_v3_671b_v7x",
        (*DROPLESS, UNCHUNKED, (BATCH, "4")),
        r"not 4 \((\d+\.\d+) GiB\)",
    ),
    (
        "configs/qwen3_235b_a22b_v7x.toml",
        "qwen3_235b_a22b_v7x",
        ((CAPACITY, "0"), UNCHUNKED, (BATCH, "2")),
        r"fits only 2 sequences \((\d+\.\d+) GiB",
    ),
    (
        "configs/qwen3_235b_a22b_v7x.toml",
        "qwen3_235b_a22b_v7x",
        ((CAPACITY, "0"), UNCHUNKED, (BATCH, "8")),
        r"8 would need (\d+\.\d+) GiB",
    ),
    (
        "configs/qwen3_30b_a3b_v6e.toml",
        "qwen3_30b_a3b_v6e",
        ((CAPACITY, "0"), (BATCH, "2")),
        r"fits 2 sequences \((\d+\.\d+) GiB\)",
    ),
    (
        "configs/qwen3_30b_a3b_v6e.toml",
        "qwen3_30b_a3b_v6e",
        ((CAPACITY, "0"), (BATCH, "4")),
        r"not 4 \((\d+\.\d+) GiB\)",
    ),
    (
        "configs/qwen3_5_35b_a3b_v6e.toml",
        "qwen3_5_35b_a3b_v6e",
        ((CAPACITY, "0"), (BATCH, "2")),
        r"fits 2 sequences \((\d+\.\d+) GiB\)",
    ),
    (
        "configs/qwen3_5_35b_a3b_v6e.toml",
        "qwen3_5_35b_a3b_v6e",
        ((CAPACITY, "0"), (BATCH, "4")),
        r"not 4 \((\d+\.\d+) GiB\)",
    ),
    (
        "configs/gpt_oss_120b_v7x.toml",
        "gpt_oss_120b_v7x",
        ((CAPACITY, "0"), (BATCH, "4")),
        r"4 sequences fit \((\d+\.\d+) GiB\)",
    ),
    (
        "configs/gpt_oss_120b_v7x.toml",
        "gpt_oss_120b_v7x",
        ((CAPACITY, "0"), (BATCH, "8")),
        r"8 do not \((\d+\.\d+) GiB\)",
    ),
    ("configs/gpt_oss_20b_v6e.toml", "gpt_oss_20b_v6e", ((BATCH, "8"),), r"8 sequences would plan at (\d+\.\d+) GiB"),
    (
        "configs/gpt_oss_20b_v6e.toml",
        "gpt_oss_20b_v6e",
        ((CAPACITY, "0"), (BATCH, "2")),
        r"fits 2 sequences \((\d+\.\d+) GiB\)",
    ),
    (
        "configs/gpt_oss_20b_v6e.toml",
        "gpt_oss_20b_v6e",
        ((CAPACITY, "0"), (BATCH, "4")),
        r"not 4 \((\d+\.\d+) GiB\)",
    ),
    ("configs/qwen3_5_9b_v6e.toml", "qwen3_5_9b_v6e", ((BATCH, "8"),), r"which would plan at (\d+\.\d+) GiB"),
]


def _header(recipe: str) -> str:
    """The recipe's leading comment, '#' dropped and whitespace joined to single spaces."""
    lines = []
    for line in (ROOT / "configs" / f"{recipe}.toml").read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(" ".join(lines).split())


def _total(recipe: str, overrides: tuple[tuple[str, str], ...] = ()) -> float:
    return blocks.recipe_estimate(recipe, overrides)[1].total / GiB


def _close(quoted: str, actual: float) -> bool:
    return abs(float(quoted) - actual) <= TOLERANCE


@pytest.mark.parametrize("recipe", blocks.pod_recipes())
def test_recipe_header_figures_are_the_planners(recipe):
    text = _header(recipe)
    _, est = blocks.recipe_estimate(recipe)
    total, usable = est.total / GiB, est.usable / GiB
    wrong = []
    for m in HEADLINE.finditer(text):
        if not (_close(m.group(1), total) and _close(m.group(2), usable)):
            wrong.append(f"'{m.group(0)}': the planner gives {total:.1f} of {usable:.1f}")
    for m in PARENT.finditer(text):
        parent = recipe.rsplit("_", 1)[0]
        parent_total = _total(parent)
        if not (_close(m.group(1), total) and _close(m.group(2), parent_total)):
            wrong.append(f"'{m.group(0)}': the planner gives {total:.1f} against {parent} {parent_total:.1f}")
    compiled = blocks.compiled_figures().get(recipe)
    for m in COMPILED.finditer(text):
        if compiled is None or not _close(m.group(1), float(compiled[0])):
            wrong.append(f"'{m.group(0)}': docs/results/pod_compile_*.csv has {compiled}")
    assert not wrong, f"configs/{recipe}.toml's header quotes figures the planner or the CSV do not give: {wrong}"


@pytest.mark.parametrize("path,recipe,overrides,phrase", VARIANTS, ids=[f"{v[1]}-{i}" for i, v in enumerate(VARIANTS)])
def test_quoted_variant_figures_are_the_planners(path, recipe, overrides, phrase):
    text = " ".join(line.lstrip("#").strip() for line in (ROOT / path).read_text().splitlines())
    text = " ".join(text.split())
    m = re.search(phrase, text)
    assert m, f"{path}: no phrase /{phrase}/ (reworded? update VARIANTS)"
    actual = _total(recipe, overrides)
    assert _close(m.group(1), actual), f"{path}: '{m.group(0)}', the planner gives {actual:.2f} GiB ({overrides})"
