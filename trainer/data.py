"""Token data loader: datasets streaming -> tiktoken -> packed windows -> per-rank batches.

Dataset specs (`[training] dataset`, `[validation] dataset`):
- `"bundled"`: the corpus in `assets/corpus/` (`split` picks train.jsonl.gz or
  validation.jsonl.gz);
- a local file, folder or glob of `.json`/`.jsonl`/`.parquet`/`.txt` files (optionally
  `.gz`/`.bz2`/`.xz` compressed; one kind per spec). json/parquet rows supply the field
  `text_field`; a .txt file gives one document per paragraph (blank-line separated);
- a Hugging Face Hub dataset `owner/name[:config]`, e.g. `allenai/c4:en` (needs network),
  read with `split`.

The global window stream is a function of the data, the tokenizer, `seq_len` and `seed`
only. Documents are read in file order in blocks of `shuffle_block_docs` rows, each block
is permuted by a hash keyed on (seed, epoch, block), each document becomes
`[BOS] tokens [EOS]`, and the concatenation of all epochs is cut into non-overlapping
windows of `seq_len + 1` tokens (inputs = w[:-1], labels = w[1:]). Call c of `next_batch`
on dp rank r returns global windows `c*D*B + r*B + [0, B)` (D = dp_degree,
B = local_batch_size), so optimizer step s with A accumulation calls covers windows
`[s*G, (s+1)*G)`, G = B*D*A, whatever the mesh. Every rank reads and tokenizes the whole
stream and keeps its slice: D times the tokenization work (measured cost in docs/data.md).

The state (`state_dict`) is the position of the global stream (epoch, block, token offset
in the block, windows consumed): the same on every rank, so a checkpoint from D ranks
resumes exactly on any other D. Resuming reads only the current block's rows again.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import itertools
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from models.errors import ConfigError

_ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
BUNDLED_CORPUS_DIR = os.path.join(_ASSETS, "corpus")

SHUFFLE_BLOCK_DOCS = 8192
_COMPRESSION = (".gz", ".bz2", ".xz")
_KIND_BY_EXT = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}
_ALLOWED = "'bundled', a .json/.jsonl/.parquet/.txt file, folder or glob, or a hub name owner/name[:config]"
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+)?$")


def _file_kind(path: str) -> str | None:
    base = path
    for ext in _COMPRESSION:
        if base.endswith(ext):
            base = base[: -len(ext)]
            break
    return _KIND_BY_EXT.get(os.path.splitext(base)[1].lower())


@dataclass(frozen=True, kw_only=True)
class _Source:
    """Where documents come from: local files of one kind ("json", "parquet", "text"), or a
    Hub dataset (kind "hub")."""

    spec: str
    kind: str
    files: list[str] | None = None
    hub_path: str | None = None
    hub_config: str | None = None
    split: str = "train"


def resolve_dataset(spec: str, split: str = "train") -> _Source:
    """Parse a dataset spec (see the module docstring); ConfigError if it names nothing usable."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"dataset: {spec!r} is empty; allowed: {_ALLOWED}")
    if spec == "bundled":
        if split not in ("train", "validation"):
            raise ConfigError(f"dataset 'bundled': no split {split!r}; allowed: train, validation")
        path = os.path.join(BUNDLED_CORPUS_DIR, f"{split}.jsonl.gz")
        if not os.path.isfile(path):
            raise ConfigError(f"dataset 'bundled': {path} is missing; regenerate it with scripts/build_corpus.py")
        return _Source(spec=spec, kind="json", files=[path], split=split)

    path = os.path.expanduser(spec)
    if any(ch in path for ch in "*?["):
        matches = [p for p in globlib.glob(path, recursive=True) if os.path.isfile(p)]
        if not matches:
            raise ConfigError(f"dataset {spec}: the glob matches no file; allowed: {_ALLOWED}")
    elif os.path.isdir(path):
        matches = [p for p in globlib.glob(os.path.join(path, "**", "*"), recursive=True)
                   if os.path.isfile(p) and _file_kind(p)]
        if not matches:
            raise ConfigError(f"dataset {spec}: the folder holds no .json/.jsonl/.parquet/.txt file")
    elif os.path.isfile(path):
        matches = [path]
    elif _file_kind(path) or path.startswith((".", "/", "~")) or not _HUB_NAME.match(spec):
        raise ConfigError(f"dataset {spec}: no such file; allowed: {_ALLOWED}")
    else:
        name, _, config = spec.partition(":")
        return _Source(spec=spec, kind="hub", hub_path=name, hub_config=config or None, split=split)

    matches = sorted(matches)
    kinds = {}
    for p in matches:
        kind = _file_kind(p)
        if kind is None:
            raise ConfigError(f"dataset {spec}: file {p} has an unsupported type; allowed: "
                              ".json .jsonl .parquet .txt (optionally .gz .bz2 .xz)")
        kinds.setdefault(kind, p)
        if not os.access(p, os.R_OK):
            raise ConfigError(f"dataset {spec}: file {p} is not readable")
    if len(kinds) > 1:
        raise ConfigError(f"dataset {spec}: mixes file kinds {sorted(kinds)} (e.g. {list(kinds.values())}); "
                          "use one kind per dataset")
    return _Source(spec=spec, kind=next(iter(kinds)), files=matches, split=split)


def _load_streaming(path: str, *, local: bool, **kwargs):
    import datasets  # imported lazily: ~1 s, only jobs that read data pay for it

    # The json reader logs its own copy of a parse error before raising it; we report the
    # error ourselves, as one line with the true line number (_json_error_line).
    datasets.utils.logging.get_logger("datasets.packaged_modules.json.json").setLevel(logging.CRITICAL)

    if not local:
        return datasets.load_dataset(path, streaming=True, **kwargs)
    # Local files need no network, but load_dataset still sends a download-count request
    # (and waits for its timeout when offline) unless it believes it is offline. The flag is
    # read from the environment at import, so set the module's copy for this call only.
    previous = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        return datasets.load_dataset(path, streaming=True, **kwargs)
    finally:
        datasets.config.HF_HUB_OFFLINE = previous


def _iter_texts(source: _Source, text_field: str, skip_rows: int = 0) -> Iterator[str]:
    """Document texts in a fixed order, starting after `skip_rows` rows (skipped rows are
    parsed, not tokenized). A row whose field is None or empty yields "" so that row
    positions stay stable."""
    if source.kind == "hub":
        try:
            ds = _load_streaming(source.hub_path, local=False, name=source.hub_config, split=source.split)
        except Exception as e:  # noqa: BLE001 - any failure to open a hub dataset is a bad spec or no network
            raise ConfigError(f"dataset {source.spec}: not a local file or folder, and cannot open it from the "
                              f"Hugging Face Hub (split {source.split!r}; offline?): {type(e).__name__}: {e}") from None
        yield from itertools.islice(_rows_to_texts(ds, source.spec, text_field), skip_rows, None)
        return
    extra = {"sample_by": "paragraph"} if source.kind == "text" else {}
    for path in source.files:
        # One streaming dataset per file so that a read error names its file.
        rows = 0  # rows of this file already read: the reader's error row numbers count from its chunk
        try:
            ds = _load_streaming(source.kind, local=True, data_files=[path], split="train", **extra)
            for text in _rows_to_texts(ds, path, text_field):
                rows += 1
                if skip_rows:
                    skip_rows -= 1
                    continue
                yield text
        except ConfigError:
            raise
        except UnicodeDecodeError as e:
            raise ConfigError(f"dataset {source.spec}: file {path} is not valid UTF-8 ({e.reason} at byte "
                              f"{e.start}); allowed: UTF-8 text") from None
        except StopIteration:
            continue  # datasets raises it for an empty json file: no rows
        except Exception as e:  # noqa: BLE001 - a malformed or unreadable file, reported by name
            where = _json_error_line(path, rows, str(e)) if source.kind == "json" else None
            if where is not None:
                line, reason = where
                raise ConfigError(f"dataset {source.spec}: file {path} line {line} is not valid JSON ({reason}); "
                                  "allowed: one JSON object per line") from None
            raise ConfigError(f"dataset {source.spec}: cannot read file {path} as {source.kind}: "
                              f"{type(e).__name__}: {_one_line(str(e))}") from None


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _open_text(path: str):
    """A local data file as text, decompressed by its extension (.gz, .bz2, .xz)."""
    import bz2
    import gzip
    import lzma

    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(os.path.splitext(path)[1], open)
    return opener(path, "rt", encoding="utf-8", errors="replace")


def _json_error_line(path: str, rows_before: int, message: str) -> tuple[int, str] | None:
    """(1-based line number, reason) of the first line of a JSON-lines file that does not parse.

    The reader parses a file in chunks (~10 MB) and reports `in row R` counted from the start of
    the failing chunk; `rows_before` rows (all earlier chunks) were read. So the bad line is
    the (rows_before + R)-th non-blank line: found by counting lines, parsing only from there.
    If that line parses after all (another kind of error), the whole file is parsed line by line.
    None if every line parses (e.g. a .json file holding one array: not line-delimited).
    """
    match = re.search(r"in row (\d+)", message)
    guess = rows_before + int(match.group(1)) if match else 0
    try:
        for start in ((guess, 0) if guess else (0,)):
            row = -1
            with _open_text(path) as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    row += 1
                    if row == 0 and line.lstrip().startswith("["):
                        return None  # one JSON array, not JSON lines: the reader's message stands
                    if row < start:
                        continue
                    try:
                        json.loads(line)
                    except ValueError as e:
                        return number, _one_line(str(e), 120)
                    if start and row > start:
                        break  # the guessed line parses: look through the whole file
    except (OSError, EOFError, ValueError):  # not readable as text (bad gzip, ...): no line to name
        return None
    return None


def _rows_to_texts(ds, where: str, text_field: str) -> Iterator[str]:
    for row in ds:
        if text_field not in row:
            raise ConfigError(f"dataset {where}: rows have no field {text_field!r}; fields found: "
                              f"{sorted(row)}; set the text field to one of them")
        text = row[text_field]
        if text is None:
            text = ""
        if not isinstance(text, str):
            raise ConfigError(f"dataset {where}: field {text_field!r} holds {type(text).__name__}, "
                              "not text")
        yield text


def _block_order(n: int, seed: int, epoch: int, block: int) -> list[int]:
    """A permutation of range(n) that depends only on its key: sorting by a keyed hash is
    stable across Python/NumPy versions, unlike their RNG streams."""
    key = f"{seed}/{epoch}/{block}/".encode()
    return sorted(range(n), key=lambda i: hashlib.blake2b(key + str(i).encode(), digest_size=8).digest())


class TokenLoader:
    """Yields this rank's micro-batches of the global window stream (see the module docstring)."""

    def __init__(self, *, source: _Source, tokenizer, seq_len: int, local_batch_size: int,
                 dp_rank: int, dp_degree: int, seed: int, text_field: str = "text",
                 shuffle: bool = True, repeat: bool = True, shuffle_block_docs: int = SHUFFLE_BLOCK_DOCS):
        assert 0 <= dp_rank < dp_degree, (dp_rank, dp_degree)
        assert shuffle_block_docs >= 1
        self.source, self.tokenizer, self.text_field = source, tokenizer, text_field
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.dp_rank, self.dp_degree, self.seed = dp_rank, dp_degree, seed
        self.shuffle, self.repeat, self.shuffle_block_docs = shuffle, repeat, shuffle_block_docs
        self.reset()

    # -- position of the global stream ---------------------------------------------------
    def reset(self) -> None:
        """Back to the first window (validation calls this before each evaluation)."""
        self._set_position(epoch=0, block=0, offset=0, windows=0)

    def _set_position(self, *, epoch: int, block: int, offset: int, windows: int) -> None:
        self._epoch, self._block, self._windows = epoch, block, windows
        self._texts: Iterator[str] | None = None  # row iterator of the current epoch
        self._tokens = np.zeros(0, dtype=np.int32)  # current block, flattened
        self._pos = 0  # next token in self._tokens
        self._block_loaded = False
        self._pending_offset = offset  # applied when block `block` is (re)loaded
        # Tokens seen in this epoch, counted only when it was read from its first block here,
        # so that "the data is empty" is never concluded from a partial epoch after resume.
        self._epoch_tokens = 0 if (block == 0 and offset == 0) else None
        self._exhausted = False

    def _load_block(self) -> bool:
        """Read, permute and tokenize block `self._block`; False at the end of the epoch."""
        if self._texts is None:
            self._texts = _iter_texts(self.source, self.text_field, skip_rows=self._block * self.shuffle_block_docs)
        texts = list(itertools.islice(self._texts, self.shuffle_block_docs))
        if not texts:
            return False
        if self.shuffle:
            texts = [texts[i] for i in _block_order(len(texts), self.seed, self._epoch, self._block)]
        texts = [t for t in texts if t]  # an empty document would only add BOS/EOS noise
        ids = self.tokenizer.encode_batch(texts, bos=True, eos=True) if texts else []
        self._tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32,
                                   count=sum(map(len, ids)))
        if self._pending_offset > len(self._tokens):
            raise ConfigError(f"checkpoint data loader state: offset {self._pending_offset} is past the end of "
                              f"block {self._block} of dataset {self.source.spec}; the data changed since "
                              "the checkpoint")
        self._pos, self._pending_offset = self._pending_offset, 0
        if self._epoch_tokens is not None:
            self._epoch_tokens += len(self._tokens)
        self._block_loaded = True
        return True

    def _next_block(self) -> bool:
        """Load the block after the current one, wrapping to a new epoch when `repeat`.
        False when a non-repeating split is used up."""
        if self._block_loaded:
            self._block += 1
        while not self._load_block():
            if self._epoch_tokens == 0:
                raise ConfigError(f"dataset {self.source.spec}: no text in split {self.source.split!r} "
                                  f"(0 tokens); allowed: rows with a non-empty {self.text_field!r} field")
            if not self.repeat:
                return False
            self._epoch, self._block, self._texts, self._epoch_tokens = self._epoch + 1, 0, None, 0
        return True

    def _read(self, n: int, out: np.ndarray | None) -> bool:
        """Copy the next n tokens into `out` (or just skip them when out is None)."""
        done = 0
        while done < n:
            if not self._block_loaded or self._pos == len(self._tokens):
                if not self._next_block():
                    return False
                if self._pos == len(self._tokens):
                    continue
            take = min(n - done, len(self._tokens) - self._pos)
            if out is not None:
                out[done: done + take] = self._tokens[self._pos: self._pos + take]
            self._pos += take
            done += take
        return True

    # -- public API ----------------------------------------------------------------------
    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), both int64 [local_batch_size, seq_len], for this rank.
        Raises StopIteration when a non-repeating split has no full global micro-batch left."""
        if self._exhausted:
            raise StopIteration
        window = self.seq_len + 1
        batch = self.local_batch_size
        start_windows = self._windows
        out = np.empty((batch, window), dtype=np.int32)
        ok = self._read(self.dp_rank * batch * window, None)
        for i in range(batch):
            ok = ok and self._read(window, out[i])
        ok = ok and self._read((self.dp_degree - 1 - self.dp_rank) * batch * window, None)
        if not ok:
            self._exhausted = True
            if start_windows == 0:
                need = self.dp_degree * batch * window
                raise ConfigError(f"dataset {self.source.spec}: split {self.source.split!r} has fewer "
                                  f"tokens than one micro-batch across data-parallel ranks "
                                  f"({self.dp_degree} x {batch} x {window} = {need})")
            raise StopIteration
        self._windows += self.dp_degree * batch
        tokens = torch.from_numpy(out).long()
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def check(self, micro_batches: int) -> int:
        """Read (and tokenize) the first `micro_batches` micro-batches now, then start over.

        For the validation loader: validation reads exactly these batches every time, so a bad
        file, a missing text field or a split shorter than one micro-batch fails here, before
        the first training step, instead of at the first validation. Returns how many complete
        micro-batches there are (at most `micro_batches`).
        """
        count = sum(1 for _ in zip(range(micro_batches), self))
        self.reset()
        return count

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            try:
                yield self.next_batch()
            except StopIteration:
                return

    def state_dict(self) -> dict:
        """Mesh-independent position (plain ints), valid between `next_batch` calls."""
        offset = self._pos if self._block_loaded else self._pending_offset
        return {
            "epoch": self._epoch,
            "block": self._block,
            "block_offset": offset,
            "windows_consumed": self._windows,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "shuffle_block_docs": self.shuffle_block_docs,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("seq_len", "seed", "shuffle_block_docs"):
            if int(state[key]) != getattr(self, key):
                raise ConfigError(f"checkpoint data loader state: {key} was {int(state[key])}, this run has "
                                  f"{getattr(self, key)}; resume with the same value")
        self._set_position(epoch=int(state["epoch"]), block=int(state["block"]),
                           offset=int(state["block_offset"]), windows=int(state["windows_consumed"]))
        # Load the saved block now, so a checkpoint that no longer fits the data fails at load.
        if (self._epoch, self._block, self._pending_offset) != (0, 0, 0) and not self._load_block():
            raise ConfigError(f"checkpoint data loader state: block {self._block} of epoch {self._epoch} "
                              f"is past the end of dataset {self.source.spec}; the data changed since the checkpoint")


def build_dataloader(*, dataset: str, tokenizer, seq_len: int, local_batch_size: int, dp_rank: int,
                     dp_degree: int, seed: int, split: str = "train", text_field: str = "text",
                     shuffle_block_docs: int = SHUFFLE_BLOCK_DOCS) -> TokenLoader:
    """Loader for `dataset` (see the module docstring). `split="train"` shuffles and repeats
    epochs; any other split (e.g. "validation") is read once, in order, from the start."""
    if seq_len < 1:
        raise ConfigError(f"training.seq_len: {seq_len} must be >= 1")
    if local_batch_size < 1:
        raise ConfigError(f"training.local_batch_size: {local_batch_size} must be >= 1")
    if shuffle_block_docs < 1:
        raise ConfigError(f"shuffle_block_docs: {shuffle_block_docs} must be >= 1")
    source = resolve_dataset(dataset, split)
    train = split == "train"
    return TokenLoader(source=source, tokenizer=tokenizer, seq_len=seq_len, local_batch_size=local_batch_size,
                       dp_rank=dp_rank, dp_degree=dp_degree, seed=seed, text_field=text_field,
                       shuffle=train, repeat=train, shuffle_block_docs=shuffle_block_docs)
