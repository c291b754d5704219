"""Prose lists in the docs follow the registries (issue 38: the README said "four families" after
a fifth arrived, docs/training.md knew two build purposes of three and AdamW only). Each check
reads a registry of the code and the page that lists it in prose; a new family, purpose,
optimizer, attention backend or op fails here until its page names it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import models
from models.common import ops
from titan_kernels import ATTENTION_BACKENDS
from trainer.job import PURPOSES
from trainer.optim import OPTIMIZERS

ROOT = Path(__file__).resolve().parents[2]
NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}
# How prose names each family (a new family needs an entry: the failure says so).
DISPLAY = {
    "llama3": "Llama 3",
    "qwen3": "Qwen 3",
    "qwen3_5": "Qwen 3.5",
    "deepseek_v3": "DeepSeek-V3",
    "deepseek_v4": "DeepSeek-V4",
    "gpt_oss": "gpt-oss",
    "flux": "FLUX.1",
    "hf": "`hf`",
}


def read(rel: str) -> str:
    return (ROOT / rel).read_text()


def test_every_family_has_a_display_name():
    assert set(DISPLAY) == set(models.FAMILIES), f"add the new family's prose name to DISPLAY: {set(models.FAMILIES)}"


def test_readme_and_models_page_name_every_family_and_count_them():
    count = NUMBER_WORDS[len(models.FAMILIES)]
    row = next(line for line in read("README.md").splitlines() if line.startswith("| [docs/models.md]"))
    assert f"the {count} families" in row, row
    for name in DISPLAY.values():
        assert name in row, f"README's docs/models.md row does not name {name}: {row}"
    intro = read("docs/models.md").split("\n\n", 2)[1]
    assert intro.startswith(f"{count.capitalize()} families"), intro[:80]
    bullets = read("docs/models.md").split("\n\n", 3)[2]
    for family in models.FAMILIES:
        assert f"- `{family}`" in bullets, f"docs/models.md's family list has no bullet for `{family}`"


@pytest.mark.parametrize("page", ["docs/training.md", "docs/architecture.md"])
def test_build_purposes_are_all_named(page):
    text = read(page)
    for name in PURPOSES:
        assert re.search(rf"`{name}`|purpose=\"{name}\"", text), f"{page} does not name the build purpose {name!r}"


@pytest.mark.parametrize("page", ["docs/training.md", "docs/optimizers.md"])
def test_optimizers_are_all_named(page):
    text = read(page).lower()
    for name in OPTIMIZERS:
        assert name in text, f"{page} does not name the optimizer {name!r}"


def test_attention_backends_and_ops_are_all_named():
    text = read("docs/attention.md")
    for backend in ATTENTION_BACKENDS:
        assert f"`{backend}`" in text, f"docs/attention.md does not name the attention backend `{backend}`"
    models_page = read("docs/models.md")
    for op in ops.OPS:
        assert op in models_page, f"docs/models.md does not name the op {op}"


def _model_name_sentence() -> str:
    """README's sentence that lists the `[model] name` values, up to the out-of-tree form."""
    text = " ".join(read("README.md").split())
    start = text.index("`[model] name` is ")
    return text[start : text.index("`package.module:NAME`", start)]


def test_readme_model_name_list_is_the_family_registry():
    """README lists every registered family as a `[model] name` value, and nothing else (it once
    left out `deepseek_v3`)."""
    sentence = _model_name_sentence()
    values = re.sub(r"\([^)]*\)", "", sentence.removeprefix("`[model] name` is "))  # not the asides
    named = re.findall(r"`([a-z0-9_]+)`", values)
    assert sorted(named) == sorted(models.FAMILIES), (
        f"README's `[model] name` list {named} is not models.FAMILIES {sorted(models.FAMILIES)}"
    )


@pytest.mark.parametrize("page", ["README.md", "docs/engine.md"])
def test_readme_and_engine_page_name_every_optimizer(page):
    """README (the graph-mode step, the docs table) and docs/engine.md (what the engine steps)
    name every `[optimizer] name` choice (docs/engine.md once knew AdamW only)."""
    text = read(page).lower()
    for name in OPTIMIZERS:
        assert name in text, f"{page} does not name the optimizer {name!r}"
    if page == "docs/engine.md":
        intro = text.split("```", 1)[0]
        missing = [name for name in OPTIMIZERS if name not in intro]
        assert not missing, f"docs/engine.md's opening paragraph (what the engine brings) omits {missing}"


def _names(text: str) -> set[str]:
    """The families whose prose name (DISPLAY) `text` names ("Qwen 3" not inside "Qwen 3.5")."""
    return {family for family, name in DISPLAY.items() if re.search(re.escape(name) + r"(?![.\d])", text)}


def test_pipeline_families_are_one_list():
    """The families PP cuts into stages are computed once (trainer/step/pipeline_rules.py
    `PIPELINE_FAMILIES`): the model rule lets PP through for exactly them, and its message, its
    docs/rules.md row and docs/pipeline_parallel.md name exactly them (the message once said
    "llama3, qwen3 dense" by hand and the page left Qwen 3.5 out, which runs); no family name is
    written in pipeline_rules.py's strings."""
    import ast

    from trainer.step.pipeline_rules import PIPELINE_FAMILIES, pipeline_capable
    from trainer.step.plan import StepRequest, refusals

    def refused(family, args) -> bool:
        request = StepRequest(
            pp_degree=2,
            n_layers=4,
            local_batch=4,
            task=family.task,
            model_pipeline=pipeline_capable(family.model_cls),
            model_has_experts=args.shape().num_experts > 0,
            mtp_depth=getattr(args, "mtp_depth", 0),
            tie_embeddings=bool(getattr(args, "tie_embeddings", False)),
            model_document_mask=True,
        )
        return any("cuts a dense decoder" in message for message in refusals(request))

    runs = {
        name
        for name, family in models.FAMILIES.items()
        if family.plan_for is None  # `hf`: args from a config.json; its class is no Decoder (refused)
        and any(not refused(family, args) for args in family.flavors.values())
    }
    assert runs == set(PIPELINE_FAMILIES) and runs >= {"llama3", "qwen3"}, (runs, PIPELINE_FAMILIES)
    message = next(m for m in refusals(StepRequest(pp_degree=2, model_pipeline=False)) if "dense decoder" in m)
    named = {f for f in models.FAMILIES if re.search(rf"\b{f}\b", message)}
    assert named == set(PIPELINE_FAMILIES), (named, message)
    row = next(line for line in read("docs/rules.md").splitlines() if "not a plain decoder" in line)
    assert {f for f in models.FAMILIES if re.search(rf"\b{f}\b", row)} == set(PIPELINE_FAMILIES), row
    text = " ".join(read("docs/pipeline_parallel.md").split())
    start = text.index("a model that is not a plain decoder (") + len("a model that is not a plain decoder (")
    are, are_not = text[start : text.index(" are not)", start)].split("; ", 1)
    assert _names(are) == set(PIPELINE_FAMILIES), are
    assert _names(are_not) == set(models.FAMILIES) - set(PIPELINE_FAMILIES), are_not
    source = ast.parse(read("trainer/step/pipeline_rules.py"))
    written = [
        node.value
        for node in ast.walk(source)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and any(re.search(rf"\b{f}\b", node.value) for f in models.FAMILIES)
    ]
    assert not written, f"family names written by hand in pipeline_rules.py (use PIPELINE_FAMILIES): {written}"
