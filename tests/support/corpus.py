"""A small corpus of documents of varied length, so packed windows cut through documents and hold
several of them (tests/unit/test_data.py, tests/unit/test_document_mask.py; their fixtures are in
tests/unit/conftest.py)."""

DOCS = [f"Document {i}: " + " ".join(f"word{j * i % 17}" for j in range(3 + (i * 7) % 23)) for i in range(24)]
