"""FLUX data: the reader of a built data set folder and the loader (building: build.py beside it).

**Loader** (`build_flux_dataloader`): global sample order position q (0, 1, 2, ... across
epochs) is sample `order(q mod N)` of epoch `q div N`. Train: each epoch shuffles row
groups, then the rows inside blocks of `SHUFFLE_BLOCK_GROUPS` consecutive (shuffled) groups,
all by keyed hashes of (seed, epoch, block); other splits are read once, in order. Call c of
`next_batch` on dp rank r of D returns positions `c*G + r*B + [0, B)` (B = local batch,
G = B*D), reading only the row groups holding them. `index` is q, so it is mesh independent.
The state is one integer (positions consumed) plus checks of seed and data set.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator

import numpy as np
import torch

from models.errors import ConfigError
from trainer.flux_data.build import FORMAT_VERSION, ensure_procedural_dataset

SHUFFLE_BLOCK_GROUPS = 8
"""Row groups per train shuffle block (see the module docstring)."""


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------
class FluxDataset:
    """A built data set folder: metadata, row access by split position, captions, encoders."""

    def __init__(self, folder: str):
        meta_path = os.path.join(folder, "meta.json")
        if not os.path.isfile(meta_path):
            raise ConfigError(
                f"FLUX data set {folder}: no meta.json; allowed: a folder written by "
                "scripts/data/build_flux_data.py, or 'procedural'"
            )
        self.meta = _read_meta(meta_path)
        for name, split in self.meta["splits"].items():  # a lost shard is found now, not epochs later
            for shard in split["shards"]:
                if not os.path.isfile(os.path.join(folder, shard["file"])):
                    raise ConfigError(
                        f"FLUX data set: {os.path.join(folder, shard['file'])} (split {name!r}) is "
                        f"missing or not a file; {_REBUILD}"
                    )
        self.folder = folder
        self.latent_shape = tuple(self.meta["shapes"]["latent"])
        self.t5_shape = tuple(self.meta["shapes"]["t5"])
        self.clip_shape = tuple(self.meta["shapes"]["clip"])
        self._files: dict = {}

    def num_rows(self, split: str) -> int:
        return self._split(split)["rows"]

    def _split(self, split: str) -> dict:
        if split not in self.meta["splits"]:
            raise ConfigError(
                f"FLUX data set {self.folder}: no split {split!r}; allowed: {', '.join(self.meta['splits'])}"
            )
        return self.meta["splits"][split]

    def row_groups(self, split: str) -> list[tuple[str, int, int, int]]:
        """(file, row group, first row, rows) of each row group of `split`, in row order."""
        out, first = [], 0
        for shard in self._split(split)["shards"]:
            pf = self._file(shard["file"])
            rows = 0
            for g in range(pf.num_row_groups):
                n = pf.metadata.row_group(g).num_rows
                out.append((shard["file"], g, first, n))
                first += n
                rows += n
            if rows != shard["rows"]:
                raise ConfigError(
                    f"FLUX data set: {os.path.join(self.folder, shard['file'])} holds {rows} rows, "
                    f"meta.json says {shard['rows']}; {_REBUILD}"
                )
        return out

    def _file(self, name: str):
        import pyarrow.parquet as pq

        if name not in self._files:
            path = os.path.join(self.folder, name)
            try:
                self._files[name] = pq.ParquetFile(path)
            except (OSError, ValueError) as e:
                raise ConfigError(
                    f"FLUX data set: cannot read {path} ({type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else e!r}); {_REBUILD}"
                ) from None
        return self._files[name]

    def read_group(self, file: str, group: int) -> dict[str, np.ndarray]:
        import pyarrow as pa

        path = os.path.join(self.folder, file)
        try:
            table = self._file(file).read_row_group(group, columns=["index", "latent", "t5", "clip"])

            def floats(name, shape):
                col = table.column(name).combine_chunks()
                values = col.values.to_numpy(zero_copy_only=False)
                if values.dtype != np.float32:
                    raise ValueError(f"column {name} holds {values.dtype}, expected float32")
                return values.reshape(len(table), *shape)

            out = {
                "index": table.column("index").to_numpy(),
                "latent": floats("latent", self.latent_shape),
                "t5": floats("t5", self.t5_shape),
                "clip": floats("clip", self.clip_shape),
            }
        except (OSError, ValueError, KeyError, AttributeError, pa.ArrowException) as e:
            raise ConfigError(
                f"FLUX data set: cannot read row group {group} of {path} "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e!r}); {_REBUILD}"
            ) from None
        for name, values in out.items():
            if name != "index" and not np.isfinite(values).all():
                raise ConfigError(
                    f"FLUX data set: row group {group} of {path}: column {name} holds non-finite values; {_REBUILD}"
                )
        return out

    def captions(self, split: str) -> list[dict]:
        """{index, caption, colour, shape, position} of every row of `split`, in row order."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = []
        for shard in self._split(split)["shards"]:
            path = os.path.join(self.folder, shard["file"])
            try:
                table = pq.read_table(path, columns=["index", "caption", "colour", "shape", "position"])
            except (OSError, ValueError, KeyError, pa.ArrowException) as e:
                raise ConfigError(
                    f"FLUX data set: cannot read {path} ({type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else e!r}); {_REBUILD}"
                ) from None
            rows.extend(table.to_pylist())
        return rows

    def text_conditioner(self):
        """The encoders the data set was built with (`TextConditioner`), for sampling prompts."""
        from models.flux import conditioning as cond

        bpe = None
        if self.meta["text_ids"] == "bundled-bpe":
            from trainer.data.tokenizer import build_tokenizer

            bpe = build_tokenizer("bundled")
        p = self.meta["params"]
        # Hugging Face tokenizers were saved next to their encoders (TextConditioner.save).
        return cond.load_text_conditioner(
            t5_path=os.path.join(self.folder, "encoders", "t5"),
            clip_path=os.path.join(self.folder, "encoders", "clip"),
            max_length=p["text_length"],
            bpe=bpe,
        )

    def vae(self):
        """The VAE the latents were encoded with (`FluxVae`: `decode(latents) -> images in [0, 1]`)."""
        from models.flux import conditioning as cond

        return cond.load_vae(os.path.join(self.folder, "vae"))


_REBUILD = "allowed: a data set rebuilt with scripts/data/build_flux_data.py"


def _read_meta(path: str) -> dict:
    """meta.json of a data set folder, its shape checked (what the reader and the loader use):
    ConfigError naming the file and the key otherwise."""

    def refuse(what: str):
        raise ConfigError(f"FLUX data set {path}: {what}; {_REBUILD}")

    def count(value, key: str, least: int = 0) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            refuse(f"{key} = {value!r}; allowed: an integer >= {least}")
        return value

    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        refuse(f"cannot read as JSON ({reason})")
    if not isinstance(meta, dict):
        refuse(f"expected a JSON object, got {type(meta).__name__}")
    if meta.get("format") != FORMAT_VERSION:
        raise ConfigError(
            f"FLUX data set {os.path.dirname(path)}: format {meta.get('format')}; this version reads "
            f"format {FORMAT_VERSION}; allowed: a data set rebuilt with scripts/data/build_flux_data.py"
        )
    shapes = meta.get("shapes")
    if not isinstance(shapes, dict):
        refuse("shapes is not an object of latent, t5, clip")
    for name, dims in (("latent", 3), ("t5", 2), ("clip", 1)):
        shape = shapes.get(name)
        if not isinstance(shape, list) or len(shape) != dims:
            refuse(f"shapes.{name} = {shape!r}; allowed: a list of {dims} sizes")
        for i, n in enumerate(shape):
            count(n, f"shapes.{name}[{i}]", 1)
    splits = meta.get("splits")
    if not isinstance(splits, dict) or not splits:
        refuse("splits is not a non-empty object of split name -> {rows, shards}")
    for name, split in splits.items():
        if not isinstance(split, dict) or not isinstance(split.get("shards"), list):
            refuse(f"splits.{name} is not an object with rows and a list of shards")
        total = 0
        for i, shard in enumerate(split["shards"]):
            if not isinstance(shard, dict) or not isinstance(shard.get("file"), str) or not shard["file"]:
                refuse(f"splits.{name}.shards[{i}] is not an object with a file name")
            total += count(shard.get("rows"), f"splits.{name}.shards[{i}].rows")
        if count(split.get("rows"), f"splits.{name}.rows") != total:
            refuse(f"splits.{name}.rows = {split['rows']}, its shards hold {total}")
    params = meta.get("params")
    if not isinstance(params, dict):
        refuse("params is not an object")
    count(params.get("text_length"), "params.text_length", 1)
    if not isinstance(meta.get("text_ids"), str):
        refuse(f"text_ids = {meta.get('text_ids')!r}; allowed: a string")
    return meta


def resolve_flux_dataset(path: str | None, *, cache_root: str | None = None) -> FluxDataset:
    """`"procedural"` / None: the default procedural set (built and cached on first use);
    otherwise a folder written by scripts/data/build_flux_data.py."""
    if path in (None, "", "procedural"):
        return FluxDataset(ensure_procedural_dataset(cache_root=cache_root))
    folder = os.path.expanduser(path)
    if not os.path.isdir(folder):
        raise ConfigError(
            f"FLUX data set {path}: no such folder; allowed: 'procedural' or a folder written by "
            "scripts/data/build_flux_data.py"
        )
    return FluxDataset(folder)


def _hash_order(n: int, key: str) -> list[int]:
    """A permutation of range(n) that depends only on `key` (sorting by a keyed hash: stable
    across NumPy/Python versions, unlike their RNG streams)."""
    k = key.encode()
    return sorted(range(n), key=lambda i: hashlib.blake2b(k + str(i).encode(), digest_size=8).digest())


class FluxLoader:
    """This rank's micro-batches of the global sample order (see the module docstring)."""

    def __init__(
        self,
        *,
        dataset: FluxDataset,
        split: str,
        local_batch_size: int,
        dp_rank: int,
        dp_degree: int,
        seed: int,
        shuffle: bool,
        repeat: bool,
    ):
        assert 0 <= dp_rank < dp_degree, (dp_rank, dp_degree)
        self.dataset, self.split = dataset, split
        self.local_batch_size, self.dp_rank, self.dp_degree = local_batch_size, dp_rank, dp_degree
        self.seed, self.shuffle, self.repeat = seed, shuffle, repeat
        self.groups = dataset.row_groups(split)
        self.num_samples = sum(g[3] for g in self.groups)
        self._epoch_blocks: tuple | None = None  # (epoch, group order, block starts)
        self._block_order: tuple | None = None  # (epoch, block, [(group, row)])
        self._cache: dict[int, dict[str, np.ndarray]] = {}
        self.position = 0

    def reset(self) -> None:
        self.position = 0

    def _blocks(self, epoch: int) -> tuple[list[int], np.ndarray]:
        """(row groups in epoch order, first epoch position of each shuffle block)."""
        if self._epoch_blocks is None or self._epoch_blocks[0] != epoch:
            num_groups = len(self.groups)
            perm = (
                _hash_order(num_groups, f"flux/{self.seed}/{epoch}/groups") if self.shuffle else list(range(num_groups))
            )
            sizes = [
                sum(self.groups[g][3] for g in perm[lo : lo + SHUFFLE_BLOCK_GROUPS])
                for lo in range(0, num_groups, SHUFFLE_BLOCK_GROUPS)
            ]
            self._epoch_blocks = (epoch, perm, np.cumsum([0] + sizes[:-1]))
        return self._epoch_blocks[1], self._epoch_blocks[2]

    def _block_members(self, epoch: int, block: int) -> list[tuple[int, int]]:
        """(row group, row in group) of each position of one shuffle block, computed for one
        block at a time so that an epoch of a large data set costs nothing up front."""
        if self._block_order is None or self._block_order[:2] != (epoch, block):
            perm, _ = self._blocks(epoch)
            lo = block * SHUFFLE_BLOCK_GROUPS
            members = [(g, r) for g in perm[lo : lo + SHUFFLE_BLOCK_GROUPS] for r in range(self.groups[g][3])]
            if self.shuffle:
                members = [members[i] for i in _hash_order(len(members), f"flux/{self.seed}/{epoch}/{block}")]
            self._block_order = (epoch, block, members)
        return self._block_order[2]

    def _rows(self, positions: range) -> dict[str, np.ndarray]:
        parts = {k: [] for k in ("index", "latent", "t5", "clip")}
        for q in positions:
            epoch, p = divmod(q, self.num_samples)
            _, starts = self._blocks(epoch)
            block = int(np.searchsorted(starts, p, side="right")) - 1
            g, r = self._block_members(epoch, block)[p - int(starts[block])]
            if g not in self._cache:
                if len(self._cache) >= 2 * SHUFFLE_BLOCK_GROUPS:
                    self._cache.pop(next(iter(self._cache)))
                file, group = self.groups[g][0], self.groups[g][1]
                self._cache[g] = self.dataset.read_group(file, group)
            data = self._cache[g]
            for k in ("latent", "t5", "clip"):
                parts[k].append(data[k][r])
            parts["index"].append(q)
        return {k: np.stack(v) for k, v in parts.items()}

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(latents [B, 16, h, w], t5 [B, S, D], clip [B, D]) float32 and index [B] int64.
        Raises StopIteration when a non-repeating split has no full global micro-batch left."""
        b, d = self.local_batch_size, self.dp_degree
        global_batch = b * d
        if not self.repeat and self.position + global_batch > self.num_samples:
            if self.position == 0:
                raise ConfigError(
                    f"FLUX data set {self.dataset.folder}: split {self.split!r} has "
                    f"{self.num_samples} samples, fewer than one micro-batch across data-parallel "
                    f"ranks ({d} x {b}); allowed: a split of at least {d * b} samples, or a smaller batch"
                )
            raise StopIteration
        start = self.position + self.dp_rank * b
        rows = self._rows(range(start, start + b))
        self.position += global_batch
        return (
            torch.from_numpy(rows["latent"]),
            torch.from_numpy(rows["t5"]),
            torch.from_numpy(rows["clip"]),
            torch.from_numpy(rows["index"]).long(),
        )

    def check(self, micro_batches: int) -> int:
        """Read the first `micro_batches` micro-batches now, then start over; returns how many
        complete ones there are (at most `micro_batches`)."""
        count = sum(1 for _ in zip(range(micro_batches), self))
        self.reset()
        return count

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        while True:
            try:
                yield self.next_batch()
            except StopIteration:
                return

    def state_dict(self) -> dict:
        """Mesh-independent position (plain ints), valid between `next_batch` calls."""
        return {"position": self.position, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "num_samples"):
            if int(state[key]) != getattr(self, key):
                raise ConfigError(
                    f"checkpoint data loader state: {key} was {int(state[key])}, this run has "
                    f"{getattr(self, key)}; allowed: resume with the same seed and FLUX data set"
                )
        self.position = int(state["position"])


def build_flux_dataloader(
    *,
    path: str | None,
    local_batch_size: int,
    dp_rank: int,
    dp_degree: int,
    seed: int,
    split: str = "train",
    cache_root: str | None = None,
) -> FluxLoader:
    """Loader over the FLUX data set at `path` ('procedural' / None: the cached debug set).
    `split="train"` shuffles and repeats epochs; any other split is read once, in order."""
    if local_batch_size < 1:
        raise ConfigError(f"training.local_batch_size: {local_batch_size} must be >= 1; allowed: a positive integer")
    dataset = resolve_flux_dataset(path, cache_root=cache_root)
    train = split == "train"
    return FluxLoader(
        dataset=dataset,
        split=split,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        seed=seed,
        shuffle=train,
        repeat=train,
    )
