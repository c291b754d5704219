"""Data: text data sets (sources) packed into token windows (text) and the tiktoken BPE (tokenizer). The FLUX
data set (its build, reader and loader) is trainer/flux_data, which reads the tokenizer here."""

from trainer.data.sources import BUNDLED_CORPUS_DIR, resolve_dataset
from trainer.data.text import (
    DEFAULT_SHARDS,
    SHUFFLE_BLOCK_DOCS,
    TokenLoader,
    auto_shards,
    build_dataloader,
    merge_states,
    shard_windows,
)
from trainer.data.tokenizer import BUNDLED_BPE_PATH, Tokenizer, build_tokenizer, load_bpe_ranks

__all__ = [
    "BUNDLED_BPE_PATH",
    "BUNDLED_CORPUS_DIR",
    "DEFAULT_SHARDS",
    "SHUFFLE_BLOCK_DOCS",
    "TokenLoader",
    "Tokenizer",
    "auto_shards",
    "build_dataloader",
    "build_tokenizer",
    "load_bpe_ranks",
    "merge_states",
    "resolve_dataset",
    "shard_windows",
]
