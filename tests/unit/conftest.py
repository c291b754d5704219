"""Fixtures shared by the unit tests of the data loader and document masking."""

import json

import pytest

from tests.support.corpus import DOCS
from trainer.data.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    """The bundled BPE tokenizer."""
    return build_tokenizer("bundled")


@pytest.fixture
def jsonl(tmp_path):
    """`DOCS` as a JSON-lines file (fields text and id)."""
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    return str(path)
