"""Byte-level BPE tokenizer on tiktoken.

`build_tokenizer(spec)` returns a `Tokenizer` for:
- `"bundled"`: the 4096-token BPE in `assets/tokenizer/` trained on the bundled corpus
  (4094 ranks + `<|begin_of_text|>` and `<|end_of_text|>`, so n_vocab is 4096, the
  vocab size of the Llama 3 debug model);
- a path to a tiktoken BPE file (lines of `base64(token_bytes) rank`), e.g. Llama 3's
  `tokenizer.model`. Such a file gets Llama 3's 256 special tokens placed right after its
  ranks (`<|begin_of_text|>` = first id after the ranks, `<|end_of_text|>` next, ...,
  `<|eot_id|>` the tenth), so Llama 3's file gives exactly Llama 3's ids (128000..128255).
- a Hugging Face `tokenizer.json` of a byte-level BPE (Qwen 2/3, Llama 3's HF export, GPT-2
  style), or a directory holding one: its vocab becomes the tiktoken ranks, its split regex the
  pattern, its added tokens the special tokens with their own ids, and an NFC normalizer is
  applied before encoding (see `load_hf_tokenizer_json`).

The bundled BPE keeps the first two of those special tokens, at the same relative places.
Both use the Llama 3 (= cl100k) pre-tokenization regex. The ranks file is parsed here
rather than with `tiktoken.load.load_tiktoken_bpe`, which caches even local files by path
and can return stale ranks after a file is rewritten.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import unicodedata
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

_ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "assets")
BUNDLED_BPE_PATH = os.path.join(_ASSETS, "tokenizer", "titan_bpe_4k.tiktoken")
BUNDLED_SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN]


def load_bpe_ranks(path: str) -> dict[bytes, int]:
    """Parse a tiktoken BPE file into {token_bytes: rank}; ConfigError names the file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(
            f"tokenizer file {path}: cannot read ({e.strerror or e}); "
            "allowed: 'bundled' or a path to a tiktoken BPE file"
        ) from None
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
                "allowed: a tiktoken BPE file such as Llama 3's tokenizer.model"
            ) from None
        if token in ranks or rank in seen_ranks:
            raise ConfigError(
                f"tokenizer file {path}: line {lineno} repeats a token or rank "
                f"({rank}); allowed: a file where every token and rank is unique"
            )
        ranks[token] = rank
        seen_ranks.add(rank)
    if not ranks:
        raise ConfigError(f"tokenizer file {path}: no ranks found; allowed: a tiktoken BPE file")
    # Byte-level BPE can encode any text only if every single byte is a token.
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ConfigError(
            f"tokenizer file {path}: {len(missing)} of the 256 single-byte tokens "
            f"are missing (e.g. byte {missing[0]}); allowed: a byte-level BPE with all 256"
        )
    return ranks


class Tokenizer:
    """tiktoken `Encoding` plus BOS/EOS handling. Ids are plain Python ints.

    `special_tokens` is a list (ids follow the ranks in order) or a {token: id} dict (ids as
    given, e.g. from a tokenizer.json). `bos_token` None: documents get no BOS (Qwen).
    """

    def __init__(
        self,
        *,
        name: str,
        ranks: dict[bytes, int],
        special_tokens: Sequence[str] | dict[str, int],
        pattern: str = LLAMA3_PATTERN,
        bos_token: str | None = BOS_TOKEN,
        eos_token: str = EOS_TOKEN,
        nfc: bool = False,
    ):
        if isinstance(special_tokens, dict):
            specials = dict(special_tokens)
        else:
            first_special = max(ranks.values()) + 1
            specials = {tok: first_special + i for i, tok in enumerate(special_tokens)}
        self._encoding = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
        self.special_tokens: dict[str, int] = specials
        self.bos_id: int | None = specials[bos_token] if bos_token is not None else None
        self.eos_id: int = specials[eos_token]
        self.n_vocab: int = self._encoding.n_vocab
        self.name = name
        self._nfc = nfc

    def _normalize(self, text: str) -> str:
        return unicodedata.normalize("NFC", text) if self._nfc else text

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        """Token ids of `text`. Special-token strings inside `text` are encoded as plain
        text (training data must not be able to inject control tokens)."""
        ids = self._encoding.encode_ordinary(self._normalize(text))
        if bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts: Sequence[str], *, bos: bool, eos: bool, num_threads: int = 4) -> list[list[int]]:
        """`encode` for many texts; tiktoken releases the GIL and runs them in threads."""
        batch = self._encoding.encode_ordinary_batch([self._normalize(t) for t in texts], num_threads=num_threads)
        if bos or eos:
            head = [self.bos_id] if bos and self.bos_id is not None else []
            tail = [self.eos_id] if eos else []
            batch = [head + ids + tail for ids in batch]
        return batch

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; special tokens decode to their names, invalid UTF-8 to U+FFFD."""
        return self._encoding.decode(list(ids))

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, n_vocab={self.n_vocab})"


_ALLOWED = "allowed: 'bundled', a path to a tiktoken BPE file, or a tokenizer.json (or its directory)"


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte, inverted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _json_pattern(pre: dict | None, path: str) -> str:
    """The split regex of a byte-level pre-tokenizer (a Split(Regex) before ByteLevel, or
    ByteLevel with use_regex, which is GPT-2's pattern)."""
    gpt2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    steps = (pre or {}).get("pretokenizers") if (pre or {}).get("type") == "Sequence" else [pre or {}]
    if not isinstance(steps, list) or not all(isinstance(step, dict) for step in steps):
        raise ConfigError(
            f"tokenizer file {path}: pre_tokenizer.pretokenizers is not a list of objects; "
            "allowed: a byte-level BPE (Split regex + ByteLevel, or ByteLevel)"
        )
    pattern = None
    for step in steps:
        kind = step.get("type")
        if kind == "Split":
            regex = step.get("pattern").get("Regex") if isinstance(step.get("pattern"), dict) else None
            if regex is None or step.get("behavior") != "Isolated" or step.get("invert"):
                raise ConfigError(
                    f"tokenizer file {path}: pre_tokenizer Split must be an isolated Regex "
                    "split; this tokenizer cannot be expressed as a tiktoken encoding; allowed: an isolated Regex Split"
                )
            pattern = regex
        elif kind == "ByteLevel":
            if step.get("add_prefix_space"):
                raise ConfigError(
                    f"tokenizer file {path}: ByteLevel add_prefix_space = true is not supported; allowed: "
                    "add_prefix_space = false"
                )
            if step.get("use_regex", True):
                pattern = pattern or gpt2
        elif kind is not None:
            raise ConfigError(
                f"tokenizer file {path}: pre_tokenizer {kind} is not supported; "
                "allowed: a byte-level BPE (Split regex + ByteLevel, or ByteLevel)"
            )
    if pattern is None:
        raise ConfigError(f"tokenizer file {path}: no byte-level pre-tokenizer; allowed: a byte-level BPE")
    return pattern


def _json_tables(spec, path: str) -> tuple[dict[str, int], dict[str, int], list[tuple[str, str]]]:
    """(vocab, added tokens, merges) of a tokenizer.json, each checked for shape and type, with
    every id a non-negative integer held by one token only (an added token may repeat its own
    vocab entry); ConfigError naming the file and the entry otherwise."""

    def refuse(what: str):
        raise ConfigError(f"tokenizer file {path}: {what}; {_ALLOWED}")

    if not isinstance(spec, dict):
        refuse(f"expected a JSON object, got {type(spec).__name__}")
    model = spec.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE":
        raise ConfigError(
            f"tokenizer file {path}: model type "
            f"{model.get('type') if isinstance(model, dict) else model!r}; allowed: BPE"
        )
    for key in ("normalizer", "pre_tokenizer"):
        if spec.get(key) is not None and not isinstance(spec[key], dict):
            refuse(f"{key} is a {type(spec[key]).__name__}, expected an object or null")
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not vocab:
        refuse("model.vocab is not a non-empty object of token -> id")
    owner: dict[int, str] = {}
    for token, idx in vocab.items():
        if not isinstance(idx, int) or isinstance(idx, bool) or idx < 0:
            refuse(f"model.vocab[{token!r}] = {idx!r}, expected an integer id >= 0")
        if idx in owner:
            refuse(f"model.vocab: tokens {owner[idx]!r} and {token!r} share id {idx}; every id names one token")
        owner[idx] = token
    entries = spec.get("added_tokens") or []
    if not isinstance(entries, list):
        refuse(f"added_tokens is a {type(entries).__name__}, expected a list of {{content, id}} objects")
    added: dict[str, int] = {}
    for i, t in enumerate(entries):
        content, idx = (t.get("content"), t.get("id")) if isinstance(t, dict) else (None, None)
        if not isinstance(content, str) or not content or not isinstance(idx, int) or isinstance(idx, bool) or idx < 0:
            refuse(f"added_tokens[{i}] is not {{content: a string, id: an integer >= 0}}")
        if content in added or (idx in owner and owner[idx] != content) or idx in added.values():
            other = owner.get(idx) or next((k for k, v in added.items() if v == idx), content)
            refuse(f"added_tokens[{i}] {content!r} has id {idx}, the id of {other!r}; every id names one token")
        if content in vocab and vocab[content] != idx:
            refuse(f"added_tokens[{i}] {content!r} has id {idx}, model.vocab gives it {vocab[content]}")
        added[content] = idx
    raw_merges = model.get("merges") or []
    if not isinstance(raw_merges, list):
        refuse(f"model.merges is a {type(raw_merges).__name__}, expected a list")
    merges = []
    for i, m in enumerate(raw_merges):
        pair = m.split(" ", 1) if isinstance(m, str) else m
        if not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(x, str) and x for x in pair):
            refuse(f'model.merges[{i}] = {m!r}, expected "a b" or ["a", "b"]')
        merges.append((pair[0], pair[1]))
    return vocab, added, merges


def load_hf_tokenizer_json(path: str) -> Tokenizer:
    """A byte-level BPE `tokenizer.json` as a tiktoken encoding with the same ids.

    tiktoken merges, within each regex piece, the adjacent pair whose joined bytes have the
    lowest rank; Hugging Face's BPE merges the pair earliest in its merge list. The two agree
    when every merged token's id follows its merge's position, which holds for tokenizers
    trained by `tokenizers` and for Qwen's (derived from a tiktoken file): this is checked
    here, and a file that breaks it is refused rather than silently encoded differently.
    Added tokens keep their ids; BOS is the file's `bos_token` from its config if any
    (Qwen has none), EOS `<|endoftext|>` / `<|end_of_text|>` / `</s>`, whichever exists.
    """
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        raise ConfigError(f"tokenizer file {path}: cannot read as JSON ({reason}); {_ALLOWED}") from None
    vocab, added, merges = _json_tables(spec, path)
    norm = spec.get("normalizer")
    nfc = bool(norm) and norm.get("type") == "NFC"
    if norm and not nfc:
        raise ConfigError(
            f"tokenizer file {path}: normalizer {norm.get('type')} is not supported; allowed: none or NFC"
        )
    pattern = _json_pattern(spec.get("pre_tokenizer"), path)
    alphabet = _bytes_to_unicode()

    def token_bytes(token: str, where: str) -> bytes:
        try:
            return bytes(alphabet[c] for c in token)
        except KeyError:
            raise ConfigError(
                f"tokenizer file {path}: {where} {token!r} is not byte-level; allowed: a byte-level BPE"
            ) from None

    ranks: dict[bytes, int] = {}
    for token, idx in vocab.items():
        if token in added:
            continue
        ranks[token_bytes(token, "vocab entry")] = idx
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ConfigError(
            f"tokenizer file {path}: {len(missing)} single-byte tokens missing; allowed: a byte-level BPE with all 256"
        )
    last = -1
    for i, (a, b) in enumerate(merges):
        rank = ranks.get(token_bytes(a + b, f"merge {i}"))
        parts = [ranks.get(token_bytes(x, f"merge {i}")) for x in (a, b)]
        if rank is None or None in parts or rank <= last or rank <= max(parts):
            raise ConfigError(
                f"tokenizer file {path}: merge {i} ({a!r} + {b!r}) does not follow id order; "
                "this BPE cannot be expressed as tiktoken ranks; allowed: merges in id order"
            )
        last = rank
    eos = next((t for t in ("<|endoftext|>", EOS_TOKEN, "</s>") if t in added), None)
    if eos is None:
        raise ConfigError(
            f"tokenizer file {path}: no end-of-text added token; allowed: one of <|endoftext|>, {EOS_TOKEN}, </s>"
        )
    bos = BOS_TOKEN if BOS_TOKEN in added else None
    name = os.path.basename(os.path.dirname(os.path.abspath(path))) or "hf"
    if not isinstance(pattern, str):
        raise ConfigError(f"tokenizer file {path}: pre_tokenizer regex {pattern!r} is not a string; {_ALLOWED}")
    try:
        return Tokenizer(
            name=name, ranks=ranks, special_tokens=added, pattern=pattern, bos_token=bos, eos_token=eos, nfc=nfc
        )
    except ValueError as e:  # tiktoken: the split regex does not compile
        raise ConfigError(f"tokenizer file {path}: {str(e).splitlines()[0]}; {_ALLOWED}") from None


def build_tokenizer(spec: str = "bundled") -> Tokenizer:
    """`"bundled"`, a tiktoken BPE file, or a tokenizer.json (see the module docstring)."""
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"model.tokenizer: {spec!r} is not a tokenizer; {_ALLOWED}")
    if spec == "bundled":
        path = BUNDLED_BPE_PATH
    else:
        path = os.path.expanduser(spec)
        if os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer.json")):
            return load_hf_tokenizer_json(path)
        if not os.path.isfile(path):
            raise ConfigError(f"model.tokenizer: file {spec} does not exist; {_ALLOWED}")
        if path.endswith(".json"):
            return load_hf_tokenizer_json(path)
    ranks = load_bpe_ranks(path)
    # The bundled file named by its path is still the bundled tokenizer (n_vocab 4096).
    if os.path.exists(BUNDLED_BPE_PATH) and os.path.samefile(path, BUNDLED_BPE_PATH):
        return Tokenizer(name="titan_bpe_4k", ranks=ranks, special_tokens=BUNDLED_SPECIAL_TOKENS)
    name = os.path.splitext(os.path.basename(path))[0] or "bpe"
    return Tokenizer(name=name, ranks=ranks, special_tokens=LLAMA3_SPECIAL_TOKENS)
