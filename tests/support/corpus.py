"""A small corpus and a loader over it of documents of varied length, so packed windows cut through documents and hold
several of them (tests/unit/test_data.py, tests/unit/test_document_mask.py; their fixtures are in
tests/unit/conftest.py)."""

DOCS = [f"Document {i}: " + " ".join(f"word{j * i % 17}" for j in range(3 + (i * 7) % 23)) for i in range(24)]

SHARDS = 8  # 24 documents: 3 per data shard


def small_loader(tok, dataset, **kw):
    """The LM loader at the tests' small shape (seq 16, batch 4, one rank, `SHARDS` data shards);
    `kw` overrides any argument of `build_dataloader`."""
    from trainer.data import build_dataloader

    args = dict(
        dataset=dataset,
        tokenizer=tok,
        seq_len=16,
        local_batch_size=4,
        dp_rank=0,
        dp_degree=1,
        seed=7,
        num_shards=SHARDS,
    )
    args.update(kw)
    return build_dataloader(**args)
