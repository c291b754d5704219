"""Byte-level BPE tokenizer on tiktoken.

`build_tokenizer(spec)` returns a `Tokenizer` for:
- `"bundled"`: the 4096-token BPE in `assets/tokenizer/` trained on the bundled corpus
  (4094 ranks + `<|begin_of_text|>` and `<|end_of_text|>`, so n_vocab is 4096, the
  vocab size of the Llama 3 debug model);
- a path to a tiktoken BPE file (lines of `base64(token_bytes) rank`), e.g. Llama 3's
  `tokenizer.model`. Such a file gets Llama 3's 256 special tokens placed right after its
  ranks (`<|begin_of_text|>` = first id after the ranks, `<|end_of_text|>` next, ...,
  `<|eot_id|>` the tenth), so Llama 3's file gives exactly Llama 3's ids (128000..128255).

The bundled BPE keeps the first two of those special tokens, at the same relative places.
Both use the Llama 3 (= cl100k) pre-tokenization regex. The ranks file is parsed here
rather than with `tiktoken.load.load_tiktoken_bpe`, which caches even local files by path
and can return stale ranks after a file is rewritten.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Sequence

import tiktoken

from models.errors import ConfigError

# Llama 3's pre-tokenizer split pattern (identical to OpenAI's cl100k_base).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"

_NUM_LLAMA3_SPECIAL = 256
# Llama 3 special tokens in id order after the ranks (the Llama 3.0 / Meta `tokenizer.py`
# layout; Llama 3.1 renamed some reserved slots, the ids of BOS/EOS/headers/eot are unchanged).
LLAMA3_SPECIAL_TOKENS = [
    BOS_TOKEN,
    EOS_TOKEN,
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|reserved_special_token_2|>",
    "<|reserved_special_token_3|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|reserved_special_token_4|>",
    "<|eot_id|>",
] + [f"<|reserved_special_token_{i}|>" for i in range(5, _NUM_LLAMA3_SPECIAL - 5)]
assert len(LLAMA3_SPECIAL_TOKENS) == _NUM_LLAMA3_SPECIAL

_ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
BUNDLED_BPE_PATH = os.path.join(_ASSETS, "tokenizer", "titan_bpe_4k.tiktoken")
BUNDLED_SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN]


def load_bpe_ranks(path: str) -> dict[bytes, int]:
    """Parse a tiktoken BPE file into {token_bytes: rank}; ConfigError names the file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"tokenizer file {path}: cannot read ({e.strerror or e}); "
                          "allowed: 'bundled' or a path to a tiktoken BPE file") from None
    ranks: dict[bytes, int] = {}
    seen_ranks: set[int] = set()
    for lineno, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError("expected 2 fields")
            token = base64.b64decode(fields[0], validate=True)
            rank = int(fields[1])
            if not token or rank < 0:
                raise ValueError("empty token or negative rank")
        except (ValueError, binascii.Error):
            raise ConfigError(
                f"tokenizer file {path}: line {lineno} is not `base64(token_bytes) rank`; "
                "allowed: a tiktoken BPE file such as Llama 3's tokenizer.model") from None
        if token in ranks or rank in seen_ranks:
            raise ConfigError(f"tokenizer file {path}: line {lineno} repeats a token or rank "
                              f"({rank}); every token and rank must be unique")
        ranks[token] = rank
        seen_ranks.add(rank)
    if not ranks:
        raise ConfigError(f"tokenizer file {path}: no ranks found; allowed: a tiktoken BPE file")
    # Byte-level BPE can encode any text only if every single byte is a token.
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ConfigError(f"tokenizer file {path}: {len(missing)} of the 256 single-byte tokens "
                          f"are missing (e.g. byte {missing[0]}); a byte-level BPE needs all 256")
    return ranks


class Tokenizer:
    """tiktoken `Encoding` plus BOS/EOS handling. Ids are plain Python ints."""

    def __init__(self, *, name: str, ranks: dict[bytes, int], special_tokens: Sequence[str]):
        first_special = max(ranks.values()) + 1
        specials = {tok: first_special + i for i, tok in enumerate(special_tokens)}
        self._encoding = tiktoken.Encoding(
            name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
        self.special_tokens: dict[str, int] = specials
        self.bos_id: int = specials[BOS_TOKEN]
        self.eos_id: int = specials[EOS_TOKEN]
        self.n_vocab: int = self._encoding.n_vocab
        self.name = name

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        """Token ids of `text`. Special-token strings inside `text` are encoded as plain
        text (training data must not be able to inject control tokens)."""
        ids = self._encoding.encode_ordinary(text)
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts: Sequence[str], *, bos: bool, eos: bool,
                     num_threads: int = 4) -> list[list[int]]:
        """`encode` for many texts; tiktoken releases the GIL and runs them in threads."""
        batch = self._encoding.encode_ordinary_batch(list(texts), num_threads=num_threads)
        if bos or eos:
            head = [self.bos_id] if bos else []
            tail = [self.eos_id] if eos else []
            batch = [head + ids + tail for ids in batch]
        return batch

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; special tokens decode to their names, invalid UTF-8 to U+FFFD."""
        return self._encoding.decode(list(ids))

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, n_vocab={self.n_vocab})"


def build_tokenizer(spec: str = "bundled") -> Tokenizer:
    """`"bundled"` or a path to a tiktoken BPE file (see the module docstring)."""
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"model.tokenizer: {spec!r} is not a tokenizer; "
                          "allowed: 'bundled' or a path to a tiktoken BPE file")
    if spec == "bundled":
        path = BUNDLED_BPE_PATH
    else:
        path = os.path.expanduser(spec)
        if not os.path.isfile(path):
            raise ConfigError(f"model.tokenizer: file {spec} does not exist; "
                              "allowed: 'bundled' or a path to a tiktoken BPE file")
    ranks = load_bpe_ranks(path)
    # The bundled file named by its path is still the bundled tokenizer (n_vocab 4096).
    if os.path.exists(BUNDLED_BPE_PATH) and os.path.samefile(path, BUNDLED_BPE_PATH):
        return Tokenizer(name="titan_bpe_4k", ranks=ranks, special_tokens=BUNDLED_SPECIAL_TOKENS)
    name = os.path.splitext(os.path.basename(path))[0] or "bpe"
    return Tokenizer(name=name, ranks=ranks, special_tokens=LLAMA3_SPECIAL_TOKENS)
