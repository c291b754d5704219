"""Where text documents come from: a data set spec resolved to files or a Hub dataset, and its rows
read as document strings (trainer/data/text.py packs them into token windows).

Specs (`[training] dataset`, `[validation] dataset`): `"bundled"` (assets/corpus/), a local
`.json`/`.jsonl`/`.parquet`/`.txt` file, folder or glob (optionally compressed; one kind per spec),
or a Hub name `owner/name[:config]` (`resolve_dataset` -> `Source`). `iter_texts` streams one
shard's documents through `datasets` (`_load_streaming`); a malformed row or a missing
`text_field` is one `ConfigError` naming the file and the row.
"""

from __future__ import annotations

import glob as globlib
import itertools
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

from models.errors import ConfigError

_ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "assets")
BUNDLED_CORPUS_DIR = os.path.join(_ASSETS, "corpus")

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
class Source:
    """Where documents come from: local files of one kind ("json", "parquet", "text"), or a
    Hub dataset (kind "hub")."""

    spec: str
    kind: str
    files: list[str] | None = None
    hub_path: str | None = None
    hub_config: str | None = None
    split: str = "train"


def resolve_dataset(spec: str, split: str = "train") -> Source:
    """Parse a dataset spec (see the module docstring); ConfigError if it names nothing usable."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"dataset: {spec!r} is empty; allowed: {_ALLOWED}")
    if spec == "bundled":
        if split not in ("train", "validation"):
            raise ConfigError(f"dataset 'bundled': no split {split!r}; allowed: train, validation")
        path = os.path.join(BUNDLED_CORPUS_DIR, f"{split}.jsonl.gz")
        if not os.path.isfile(path):
            raise ConfigError(
                f"dataset 'bundled': {path} is missing; allowed: regenerate it with scripts/data/build_corpus.py"
            )
        return Source(spec=spec, kind="json", files=[path], split=split)

    path = os.path.expanduser(spec)
    if any(ch in path for ch in "*?["):
        matches = [p for p in globlib.glob(path, recursive=True) if os.path.isfile(p)]
        if not matches:
            raise ConfigError(f"dataset {spec}: the glob matches no file; allowed: {_ALLOWED}")
    elif os.path.isdir(path):
        matches = [
            p
            for p in globlib.glob(os.path.join(path, "**", "*"), recursive=True)
            if os.path.isfile(p) and _file_kind(p)
        ]
        if not matches:
            raise ConfigError(
                f"dataset {spec}: the folder holds no .json/.jsonl/.parquet/.txt file; allowed: {_ALLOWED}"
            )
    elif os.path.isfile(path):
        matches = [path]
    elif _file_kind(path) or path.startswith((".", "/", "~")) or not _HUB_NAME.match(spec):
        raise ConfigError(f"dataset {spec}: no such file; allowed: {_ALLOWED}")
    else:
        name, _, config = spec.partition(":")
        return Source(spec=spec, kind="hub", hub_path=name, hub_config=config or None, split=split)

    matches = sorted(matches)
    kinds = {}
    for p in matches:
        kind = _file_kind(p)
        if kind is None:
            raise ConfigError(
                f"dataset {spec}: file {p} has an unsupported type; allowed: "
                ".json .jsonl .parquet .txt (optionally .gz .bz2 .xz)"
            )
        kinds.setdefault(kind, p)
        if not os.access(p, os.R_OK):
            raise ConfigError(f"dataset {spec}: file {p} is not readable; allowed: readable files")
    if len(kinds) > 1:
        raise ConfigError(
            f"dataset {spec}: mixes file kinds {sorted(kinds)} (e.g. {list(kinds.values())}); allowed: one kind per dataset"
        )
    return Source(spec=spec, kind=next(iter(kinds)), files=matches, split=split)


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


def _open_hub(source: Source):
    try:
        return _load_streaming(source.hub_path, local=False, name=source.hub_config, split=source.split)
    except Exception as e:  # noqa: BLE001 - any failure to open a hub dataset is a bad spec or no network
        raise ConfigError(
            f"dataset {source.spec}: not a local file or folder, and cannot open it from the "
            f"Hugging Face Hub (split {source.split!r}; offline?): {type(e).__name__}: {e}; allowed: {_ALLOWED}"
        ) from None


def num_files(source: Source) -> int:
    """Files of the dataset: local files, or the Hub dataset's data files (`n_shards`)."""
    return len(source.files) if source.kind != "hub" else int(getattr(_open_hub(source), "num_shards", 1) or 1)


def iter_texts(
    source: Source, text_field: str, skip_rows: int = 0, file_shard: tuple[int, int] | None = None
) -> Iterator[str]:
    """Document texts in a fixed order, starting after `skip_rows` rows (skipped rows are
    parsed, not tokenized). A row whose field is None or empty yields "" so that row
    positions stay stable. `file_shard=(s, S)` reads only files s, s+S, s+2S, ... (for a Hub
    dataset: its data files, with `IterableDataset.shard(S, s, contiguous=False)`)."""
    if source.kind == "hub":
        ds = _open_hub(source)
        if file_shard is not None:
            ds = ds.shard(num_shards=file_shard[1], index=file_shard[0], contiguous=False)
        yield from itertools.islice(_rows_to_texts(ds, source.spec, text_field), skip_rows, None)
        return
    extra = {"sample_by": "paragraph"} if source.kind == "text" else {}
    files = source.files if file_shard is None else source.files[file_shard[0] :: file_shard[1]]
    for path in files:
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
            raise ConfigError(
                f"dataset {source.spec}: file {path} is not valid UTF-8 ({e.reason} at byte "
                f"{e.start}); allowed: UTF-8 text"
            ) from None
        except StopIteration:
            continue  # datasets raises it for an empty json file: no rows
        except Exception as e:  # noqa: BLE001 - a malformed or unreadable file, reported by name
            where = _json_error_line(path, rows, str(e)) if source.kind == "json" else None
            if where is not None:
                line, reason = where
                raise ConfigError(
                    f"dataset {source.spec}: file {path} line {line} is not valid JSON ({reason}); "
                    "allowed: one JSON object per line"
                ) from None
            raise ConfigError(
                f"dataset {source.spec}: cannot read file {path} as {source.kind}: "
                f"{type(e).__name__}: {_one_line(str(e))}; allowed: readable {source.kind} files"
            ) from None


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
        for start in (guess, 0) if guess else (0,):
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
            raise ConfigError(
                f"dataset {where}: rows have no field {text_field!r}; fields found: "
                f"{sorted(row)}; allowed: one of them as the text field"
            )
        text = row[text_field]
        if text is None:
            text = ""
        if not isinstance(text, str):
            raise ConfigError(
                f"dataset {where}: field {text_field!r} holds {type(text).__name__}, not text; allowed: a field of strings"
            )
        yield text
