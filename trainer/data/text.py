"""Token data loader: datasets streaming -> tiktoken -> packed windows -> per-rank batches.

Dataset specs (`[training] dataset`, `[validation] dataset`):
- `"bundled"`: the corpus in `assets/corpus/` (`split` picks train.jsonl.gz or
  validation.jsonl.gz);
- a local file, folder or glob of `.json`/`.jsonl`/`.parquet`/`.txt` files (optionally
  `.gz`/`.bz2`/`.xz` compressed; one kind per spec). json/parquet rows supply the field
  `text_field`; a .txt file gives one document per paragraph (blank-line separated);
- a Hugging Face Hub dataset `owner/name[:config]`, e.g. `allenai/c4:en` (needs network),
  read with `split`.

The global window stream is a function of the data, the tokenizer, `seq_len`, `seed` and
the number S of virtual data shards (`[training] dataset_shards`) only, never of the mesh.
Every document belongs to one shard: with at least S files, shard s holds files s, s+S, ...
(for a Hub dataset: its data files, `IterableDataset.shard(S, s, contiguous=False)`);
otherwise row i (file order) goes to shard i mod S. Each shard reads its rows in blocks of
K = ceil(shuffle_block_docs / S) documents, permutes each block by a hash keyed on
(seed, epoch, shard, block), turns each document into `[BOS] tokens [EOS]`, and cuts the
concatenation of all its epochs into windows of `seq_len + 1` tokens (inputs = w[:-1],
labels = w[1:]). Global window g is window g div S of shard g mod S.

With `[training] document_mask` each batch also carries the windows' document ids
(`document_ids`: a new id after each EOS, counted from 0 in each row), derived from the tokens,
so the state and the order are the same with and without them.

Call c of `next_batch` on dp rank r returns global windows `c*D*B + r*B + [0, B)`
(D = dp_degree, B = local_batch_size), so optimizer step s with A accumulation calls covers
windows `[s*G, (s+1)*G)`, G = B*D*A, whatever the mesh. S is 1 (every rank reads the one
stream and keeps its windows) or a multiple of D*B, so rank r
reads only the S/D shards s with (s - W0) mod D*B in [r*B, r*B + B) (W0: the window where the
run started): it opens only its shards' files, or, with fewer files than shards, parses every
row but tokenizes only its own. The training data work per rank falls as 1/D. Validation
(any split but "train") is one shard read in order: every rank reads the validation stream
and keeps its slice, so all ranks agree where it ends.

With `dataset_shards = 0` (auto), a data set that would leave one of the auto shards without a
non-empty document (one document of any size, a few documents, one paragraph of text) is read
as one shard: decided from the data alone, so the order stays mesh-independent.

The state (`state_dict`) is the global window count and each shard's position (epoch, block,
token offset in the block, windows taken), gathered from every rank (`gather`), so it is the
same on each and a checkpoint from D ranks resumes exactly on any D' that divides S / B'.
Resuming reads only the current block of each of the rank's shards again.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import logging
import math
import os
from collections.abc import Callable, Iterator

import numpy as np
import torch

from models.errors import ConfigError
from trainer.data.sources import Source, iter_texts, num_files, resolve_dataset

SHUFFLE_BLOCK_DOCS = 8192
DEFAULT_SHARDS = 64


def _block_order(n: int, seed: int, epoch: int, shard: int, block: int) -> list[int]:
    """A permutation of range(n) that depends only on its key: sorting by a keyed hash is
    stable across Python/NumPy versions, unlike their RNG streams."""
    key = f"{seed}/{epoch}/{shard}/{block}/".encode()
    return sorted(range(n), key=lambda i: hashlib.blake2b(key + str(i).encode(), digest_size=8).digest())


def shard_windows(windows: int, shard: int, num_shards: int) -> int:
    """How many of the first `windows` global windows come from `shard` (g mod S == shard)."""
    return max(0, -(-(windows - shard) // num_shards))


def auto_shards(global_micro_batch: int) -> int:
    """`training.dataset_shards = 0`: the smallest multiple of DEFAULT_SHARDS that the global
    micro-batch (dp degree x local batch) divides: 64 whenever the micro-batch divides 64.
    `build_dataloader` reads a data set that would leave one of them without text as one
    shard instead (`_every_shard_has_text`)."""
    return math.lcm(DEFAULT_SHARDS, global_micro_batch)


def _every_shard_has_text(source: Source, text_field: str, num_shards: int) -> bool:
    """Whether each of `num_shards` shards gets at least one non-empty document, decided from
    the data alone (the same answer on every rank and every mesh). With fewer files than
    shards (row i -> shard i mod S) the rows are parsed until every residue has a non-empty
    one: about S rows for a large data set, one pass (no tokenizing) for a small one. With at
    least S local files a shard is empty when all its files are 0 bytes (a stat, so that a rank
    still opens only its own files); a Hub dataset with >= S data files is not checked."""
    if num_shards == 1:
        return True
    if num_files(source) >= num_shards:
        if source.kind == "hub":
            return True
        return all(any(os.path.getsize(p) for p in source.files[s::num_shards]) for s in range(num_shards))
    missing = set(range(num_shards))
    for i, text in enumerate(iter_texts(source, text_field)):
        if text:
            missing.discard(i % num_shards)
            if not missing:
                return True
    return False


class _FileShards:
    """Shard s reads files s, s+S, s+2S, ... (used when there are at least S files): a rank opens
    only its own shards' files. Block b of a shard is rows [b*K, (b+1)*K) of its files."""

    def __init__(self, *, source: Source, text_field: str, num_shards: int, block_docs: int):
        self.source, self.text_field, self.num_shards, self.block_docs = source, text_field, num_shards, block_docs
        self._open: dict[int, tuple[int, Iterator[str]]] = {}  # shard -> (next block, its row iterator)

    def block(self, shard: int, epoch: int, block: int) -> list[str]:
        del epoch  # a block's rows do not depend on the epoch (its permutation does)
        nxt = self._open.get(shard)
        if nxt is not None and nxt[0] == block:
            rows = nxt[1]
        else:
            rows = iter_texts(
                self.source,
                self.text_field,
                skip_rows=block * self.block_docs,
                file_shard=(shard, self.num_shards) if self.num_shards > 1 else None,
            )
        texts = list(itertools.islice(rows, self.block_docs))
        self._open[shard] = (block + 1, rows)
        return texts


class _DealtDocs:
    """Row i of the data belongs to shard i mod S (used when there are fewer files than shards).
    Chunk b, rows [b*S*K, (b+1)*S*K), holds block b (K rows) of every shard, so one pass over
    the rows serves all of this rank's shards; other ranks' rows are parsed and dropped, never
    tokenized. Shards drift apart (documents differ in length), so a chunk's texts are kept for
    each of this rank's shards that reaches that block before its next epoch, and handed over
    once; a shard that finds nothing kept makes the chunk be read again (only after a resume or
    a drift of a whole epoch: correctness never depends on what is kept).

    Every rank parses every row once per epoch of its shards, and its shards go through their
    epochs D times as fast as the whole data set's: so the parsing (not the tokenizing) per
    rank grows with D. While this rank's rows fit in `store_rows` texts, they are stored for
    the whole run instead, and the data is parsed once (the bundled corpus: 456 rows).
    Large data should come as >= S files (`_FileShards`)."""

    def __init__(
        self,
        *,
        source: Source,
        text_field: str,
        num_shards: int,
        block_docs: int,
        shards: list[int],
        position,
        store_rows: int,
    ):
        self.source, self.text_field, self.num_shards, self.block_docs = source, text_field, num_shards, block_docs
        self.shards = set(shards)
        self.position = position  # shard -> (epoch, next block it loads)
        self._kept: dict[int, dict[int, list[str]]] = {}  # block -> shard -> texts, handed over once
        self._stored: dict[int, dict[int, list[str]]] = {}  # block -> shard -> texts, for every epoch
        self._store_left = store_rows
        self._rows: Iterator[str] | None = None
        self._next_chunk = 0

    def block(self, shard: int, epoch: int, block: int) -> list[str]:
        if block in self._stored:
            return self._stored[block].get(shard, [])
        kept = self._kept.get(block, {})
        if shard in kept:
            texts = kept.pop(shard)
            if not kept:
                del self._kept[block]
            return texts
        chunk = self._read_chunk(block)
        rows = sum(map(len, chunk.values()))
        if rows <= self._store_left:  # an empty chunk (the end of the data) is stored too
            self._store_left -= rows
            self._stored[block] = chunk
            return chunk.get(shard, [])
        for s, texts in chunk.items():
            e_s, b_s = self.position(s)
            if s != shard and (e_s if b_s <= block else e_s + 1) <= epoch:
                self._kept.setdefault(block, {})[s] = texts
        return chunk.get(shard, [])

    def _read_chunk(self, block: int) -> dict[int, list[str]]:
        rows = self.num_shards * self.block_docs
        if self._rows is None or block < self._next_chunk:
            self._rows = iter_texts(self.source, self.text_field, skip_rows=block * rows)
        elif block > self._next_chunk:
            collections.deque(itertools.islice(self._rows, (block - self._next_chunk) * rows), maxlen=0)
        chunk: dict[int, list[str]] = {s: [] for s in self.shards}
        for i, text in enumerate(itertools.islice(self._rows, rows)):
            texts = chunk.get(i % self.num_shards)  # the chunk starts at a multiple of S rows
            if texts is not None:
                texts.append(text)
        self._next_chunk = block + 1
        return chunk


class _ShardStream:
    """One virtual shard: its documents, permuted per (seed, epoch, shard, block), each as
    [BOS] tokens [EOS], concatenated over epochs and cut into windows of seq_len + 1."""

    def __init__(self, loader: TokenLoader, shard: int):
        self.loader, self.shard = loader, shard
        self.set_position(epoch=0, block=0, offset=0, windows=0)

    def set_position(self, *, epoch: int, block: int, offset: int, windows: int) -> None:
        self.epoch, self.block, self.windows = epoch, block, windows
        self.tokens = np.zeros(0, dtype=np.int32)  # current block, flattened
        self.pos = 0  # next token in self.tokens
        self.loaded = False
        self.pending_offset = offset  # applied when block `block` is (re)loaded
        # Tokens seen in this epoch, counted only when it was read from its first block here,
        # so that "no text" is never concluded from a partial epoch after resume.
        self.epoch_tokens = 0 if (block == 0 and offset == 0) else None

    def next_block_key(self) -> tuple[int, int]:
        return self.epoch, self.block + 1 if self.loaded else self.block

    def state(self) -> list[int]:
        return [self.epoch, self.block, self.pos if self.loaded else self.pending_offset, self.windows]

    def load_block(self) -> bool:
        """Read, permute and tokenize block `self.block`; False at the end of the epoch."""
        loader = self.loader
        texts = loader._reader().block(self.shard, self.epoch, self.block)
        if not texts:
            return False
        if loader.shuffle:
            texts = [texts[i] for i in _block_order(len(texts), loader.seed, self.epoch, self.shard, self.block)]
        texts = [t for t in texts if t]  # an empty document would only add BOS/EOS noise
        ids = loader.tokenizer.encode_batch(texts, bos=True, eos=True) if texts else []
        loader.docs_tokenized += len(texts)
        self.tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=sum(map(len, ids)))
        if self.pending_offset > len(self.tokens):
            raise ConfigError(
                f"checkpoint data loader state: offset {self.pending_offset} is past the end of "
                f"block {self.block} of shard {self.shard} of dataset {loader.source.spec}; the data "
                "changed since the checkpoint; allowed: the data set the checkpoint was written with"
            )
        self.pos, self.pending_offset = self.pending_offset, 0
        if self.epoch_tokens is not None:
            self.epoch_tokens += len(self.tokens)
        self.loaded = True
        return True

    def _next_block(self) -> bool:
        """Load the block after the current one, wrapping to a new epoch when the loader
        repeats. False when a non-repeating split is used up."""
        loader = self.loader
        if self.loaded:
            self.block += 1
        while not self.load_block():
            if self.epoch_tokens == 0:
                where = f"dataset {loader.source.spec}: no text in split {loader.source.split!r}"
                if loader.num_shards == 1:
                    raise ConfigError(f"{where} (0 tokens); allowed: rows with a non-empty {loader.text_field!r} field")
                raise ConfigError(
                    f"{where} for data shard {self.shard} of {loader.num_shards} (fewer non-empty "
                    f"documents than shards?); allowed: training.dataset_shards = 0 (auto: a data "
                    f"set this small is read as one shard) or <= the number of documents, and "
                    f"rows with a non-empty {loader.text_field!r} field"
                )
            if not loader.repeat:
                return False
            self.epoch, self.block, self.epoch_tokens = self.epoch + 1, 0, 0
        return True

    def read(self, n: int, out: np.ndarray | None) -> bool:
        """Copy the next n tokens into `out` (or just skip them when out is None)."""
        done = 0
        while done < n:
            if not self.loaded or self.pos == len(self.tokens):
                if not self._next_block():
                    return False
                if self.pos == len(self.tokens):
                    continue
            take = min(n - done, len(self.tokens) - self.pos)
            if out is not None:
                out[done : done + take] = self.tokens[self.pos : self.pos + take]
            self.pos += take
            done += take
        return True

    def skip_to(self, window: int) -> bool:
        """Advance to window `window` of this shard (skipping windows another rank reads)."""
        assert window >= self.windows, (self.shard, window, self.windows)
        if window > self.windows:
            if not self.read((window - self.windows) * (self.loader.seq_len + 1), None):
                return False
            self.windows = window
        return True

    def read_window(self, out: np.ndarray) -> bool:
        if not self.read(self.loader.seq_len + 1, out):
            return False
        self.windows += 1
        return True


def document_ids(inputs: np.ndarray, eos_id: int) -> np.ndarray:
    """int32 document ids [rows, seq] of packed input windows [rows, seq]: 0 from each row's first
    token, +1 at every token that follows an EOS (every document is `[BOS] tokens [EOS]`, so
    that is where the next one starts; a tokenizer without BOS, like Qwen's, is served alike).

    Local to the row: a document cut by the window edge keeps one id within each row it
    touches. A function of the window's tokens alone, so a resumed loader, which yields the same
    windows, yields the same ids. An EOS that ends a window's inputs starts no document inside it.
    """
    starts = np.zeros(inputs.shape, dtype=np.int32)
    starts[:, 1:] = inputs[:, :-1] == eos_id
    return np.cumsum(starts, axis=1, dtype=np.int32)


def merge_states(states: list[dict]) -> dict:
    """One loader state from every rank's `local_state()`: each shard's position comes from the
    rank that reads it (ranks that read the same shard, e.g. tensor-parallel peers, agree)."""
    merged = dict(states[0])
    shards = list(merged["shards"])
    for state in states[1:]:
        assert state["windows_consumed"] == merged["windows_consumed"], "ranks disagree on the data position"
        for s, entry in enumerate(state["shards"]):
            if entry is None:
                continue
            assert shards[s] is None or list(shards[s]) == list(entry), (s, shards[s], entry)
            shards[s] = entry
    merged["shards"] = shards
    return merged


class TokenLoader:
    """Yields this rank's micro-batches of the global window stream (see the module docstring)."""

    def __init__(
        self,
        *,
        source: Source,
        tokenizer,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_degree: int,
        seed: int,
        text_field: str = "text",
        shuffle: bool = True,
        repeat: bool = True,
        shuffle_block_docs: int = SHUFFLE_BLOCK_DOCS,
        num_shards: int = 1,
        gather: Callable[[dict], list[dict]] | None = None,
        document_ids: bool = False,
    ):
        assert 0 <= dp_rank < dp_degree, (dp_rank, dp_degree)
        assert shuffle_block_docs >= 1 and num_shards >= 1
        self.source, self.tokenizer, self.text_field = source, tokenizer, text_field
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.dp_rank, self.dp_degree, self.seed = dp_rank, dp_degree, seed
        self.shuffle, self.repeat, self.shuffle_block_docs = shuffle, repeat, shuffle_block_docs
        self.num_shards = num_shards
        self.shard_block_docs = -(-shuffle_block_docs // num_shards)  # K: a shard's shuffle block
        self.gather = gather  # every rank's local_state(), for state_dict (None: this process only)
        self.document_ids = document_ids  # batches also carry document ids (`[training] document_mask`)
        self.docs_tokenized = 0  # documents this loader has tokenized (tests, scripts/bench/bench_data.py)
        self._by_file: bool | None = None  # decided on first read (a Hub dataset must be opened)
        self.reset()

    # -- position ------------------------------------------------------------------------
    def reset(self) -> None:
        """Back to the first window (validation calls this before each evaluation)."""
        self._set_windows(0)

    def _set_windows(self, windows: int) -> None:
        self._windows = windows
        self._streams = {s: _ShardStream(self, s) for s in self.shards_read(windows)}
        self._reader_obj = None
        self._exhausted = False

    def shards_read(self, windows: int | None = None) -> list[int]:
        """The shards this rank reads from global window `windows` on: S/D of them when
        S is a multiple of D x B (the shards s with (s - windows) mod D*B in [r*B, r*B + B))."""
        windows = self._windows if windows is None else windows
        b, db, s = self.local_batch_size, self.dp_degree * self.local_batch_size, self.num_shards
        return sorted({(windows + c * db + self.dp_rank * b + j) % s for c in range(s) for j in range(b)})

    def _reader(self):
        if self._reader_obj is None:
            if self._by_file is None:
                self._by_file = self.num_shards == 1 or num_files(self.source) >= self.num_shards
            common = dict(
                source=self.source,
                text_field=self.text_field,
                num_shards=self.num_shards,
                block_docs=self.shard_block_docs,
            )
            if self._by_file:
                self._reader_obj = _FileShards(**common)
            else:
                self._reader_obj = _DealtDocs(
                    **common,
                    shards=list(self._streams),
                    position=lambda s: self._streams[s].next_block_key(),
                    store_rows=4 * self.shuffle_block_docs,
                )
        return self._reader_obj

    # -- public API ----------------------------------------------------------------------
    def next_batch(self) -> tuple[torch.Tensor, ...]:
        """(inputs, labels), both int64 [local_batch_size, seq_len], for this rank; with
        `document_ids` also their int32 document ids [local_batch_size, seq_len] (`document_ids`).
        Raises StopIteration when a non-repeating split has no full global micro-batch left."""
        if self._exhausted:
            raise StopIteration
        batch, num_shards = self.local_batch_size, self.num_shards
        start = self._windows
        out = np.empty((batch, self.seq_len + 1), dtype=np.int32)
        ok = True
        for j in range(batch):
            g = start + self.dp_rank * batch + j  # global window index
            stream = self._streams[g % num_shards]
            ok = ok and stream.skip_to(g // num_shards) and stream.read_window(out[j])
        end = start + self.dp_degree * batch
        for s, stream in self._streams.items():  # all ranks agree on every shard's position
            ok = ok and stream.skip_to(shard_windows(end, s, num_shards))
        if not ok:
            self._exhausted = True
            if start == 0:
                need = self.dp_degree * batch * (self.seq_len + 1)
                raise ConfigError(
                    f"dataset {self.source.spec}: split {self.source.split!r} has fewer "
                    f"tokens than one micro-batch across data-parallel ranks "
                    f"({self.dp_degree} x {batch} x {self.seq_len + 1} = {need}); allowed: a split of at least {need} "
                    "tokens, or a smaller batch or seq_len"
                )
            raise StopIteration
        self._windows = end
        tokens = torch.from_numpy(out).long()
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        if not self.document_ids:
            return inputs, labels
        return inputs, labels, torch.from_numpy(document_ids(out[:, :-1], self.tokenizer.eos_id))

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

    def local_state(self) -> dict:
        """This rank's part of the state: the positions of the shards it reads (None for the
        others). Valid between `next_batch` calls."""
        return {
            "windows_consumed": self._windows,
            "num_shards": self.num_shards,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "shuffle_block_docs": self.shuffle_block_docs,
            "shards": [self._streams[s].state() if s in self._streams else None for s in range(self.num_shards)],
        }

    def state_dict(self) -> dict:
        """The mesh-independent state: the global window count and every shard's position
        [epoch, block, token offset in the block, windows], gathered from all ranks (a
        collective when `gather` is set: call it on every rank), so it is the same on each."""
        local = self.local_state()
        return merge_states(self.gather(local) if self.gather is not None else [local])

    def load_state_dict(self, state: dict) -> None:
        names = {"num_shards": "training.dataset_shards"}
        for key in ("seq_len", "seed", "shuffle_block_docs", "num_shards"):
            if key not in state:
                raise ConfigError(
                    f"checkpoint data loader state: no {key!r} (written by an older loader "
                    "without data shards); allowed: resume it with the version that wrote it"
                )
            if int(state[key]) != getattr(self, key):
                raise ConfigError(
                    f"checkpoint data loader state: {names.get(key, key)} was {int(state[key])}, "
                    f"this run has {getattr(self, key)}; allowed: resume with the same value"
                )
        windows = int(state["windows_consumed"])
        self._set_windows(windows)
        for s, stream in self._streams.items():
            entry = state["shards"][s]
            if entry is None:
                raise ConfigError(
                    f"checkpoint data loader state: no position for data shard {s} (saved "
                    "without every rank's shards); it cannot resume; allowed: a checkpoint saved with every rank's shards"
                )
            epoch, block, offset, shard_window = (int(v) for v in entry)
            if shard_window != shard_windows(windows, s, self.num_shards):
                raise ConfigError(
                    f"checkpoint data loader state: shard {s} is at window {shard_window}, "
                    f"but {windows} global windows put it at "
                    f"{shard_windows(windows, s, self.num_shards)}; the state is corrupt; allowed: an intact checkpoint"
                )
            stream.set_position(epoch=epoch, block=block, offset=offset, windows=shard_window)
        # Load the saved blocks now, so a checkpoint that no longer fits the data fails at load.
        for s, stream in self._streams.items():
            if (stream.epoch, stream.block, stream.pending_offset) != (0, 0, 0) and not stream.load_block():
                raise ConfigError(
                    f"checkpoint data loader state: block {stream.block} of epoch {stream.epoch} "
                    f"of shard {s} is past the end of dataset {self.source.spec}; the data changed "
                    "since the checkpoint; allowed: the data set the checkpoint was written with"
                )


def build_dataloader(
    *,
    dataset: str,
    tokenizer,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_degree: int,
    seed: int,
    split: str = "train",
    text_field: str = "text",
    shuffle_block_docs: int = SHUFFLE_BLOCK_DOCS,
    num_shards: int = 0,
    gather: Callable[[dict], list[dict]] | None = None,
    document_ids: bool = False,
) -> TokenLoader:
    """Loader for `dataset` (see the module docstring). `split="train"` shuffles and repeats
    epochs over `num_shards` data shards (0: `auto_shards`); any other split (e.g.
    "validation") is one shard, read once, in order, from the start. `gather` (training, more
    than one process): returns every rank's object for one object of this rank. `document_ids`:
    batches are (inputs, labels, document ids) (`[training] document_mask`)."""
    if seq_len < 1:
        raise ConfigError(f"training.seq_len: {seq_len} must be >= 1; allowed: a positive integer")
    if local_batch_size < 1:
        raise ConfigError(f"training.local_batch_size: {local_batch_size} must be >= 1; allowed: a positive integer")
    if shuffle_block_docs < 1:
        raise ConfigError(f"shuffle_block_docs: {shuffle_block_docs} must be >= 1; allowed: a positive integer")
    train = split == "train"
    micro = dp_degree * local_batch_size
    source = resolve_dataset(dataset, split)
    if not train:
        num_shards = 1
    elif num_shards == 0:
        num_shards = auto_shards(micro)
        if not _every_shard_has_text(source, text_field, num_shards):
            # Fewer non-empty documents than shards (one document, a few, one text file): one
            # stream whose windows are dealt to the ranks in order, as before data shards. It
            # depends on the data only, and only data that the auto layout cannot read gets it.
            logging.getLogger(__name__).info(
                "dataset %s: some of %d data shards would hold no text (fewer non-empty documents "
                "than shards); reading it as one shard, which every rank tokenizes",
                dataset,
                num_shards,
            )
            num_shards = 1
    elif num_shards < 0 or num_shards % micro:
        raise ConfigError(
            f"training.dataset_shards: {num_shards} is not a multiple of the global micro-batch "
            f"(data-parallel degree {dp_degree} x local batch {local_batch_size} = {micro}); "
            f"allowed: 0 (auto) or a multiple of {micro}, e.g. {auto_shards(micro)}"
        )
    return TokenLoader(
        source=source,
        tokenizer=tokenizer,
        seq_len=seq_len,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        seed=seed,
        text_field=text_field,
        shuffle=train,
        repeat=train,
        shuffle_block_docs=shuffle_block_docs,
        num_shards=num_shards,
        gather=gather if train else None,
        document_ids=document_ids,
    )
