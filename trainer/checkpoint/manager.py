"""Distributed checkpoints (DCP): atomic save, resume, retention, async, initial weights.

Layout under the checkpoint folder:

    step-N/          a complete checkpoint (DCP files + .metadata), the only thing `load` reads
    .tmp-step-N/     a save in progress (or one that crashed); ignored, removed by the next save
    .old-step-N/     a checkpoint being deleted or replaced; ignored, removed by the next save

A save writes `.tmp-step-N`, waits until every rank's shards and the metadata are on disk, and
then rank 0 renames it to `step-N` (atomic on POSIX), so a job killed half-way never leaves a
newest `step-N` that fails to load. Deletion renames before removing, for the same reason.

The DCP state dict has one top-level key per state: `model`, `optimizer`, `lr_scheduler`,
`dataloader`, `train_state`; model parameters therefore appear as
`model.layers.0.attention.wq.weight` (scripts and the HF converter rely on it). Model and
optimizer go through `torch.distributed.checkpoint.state_dict`, so DTensor-sharded (SimpleFSDP,
TP, EP) states save and load across different meshes and world sizes. The learning-rate schedule
and the data loader are saved as they are: their states are plain values, the same on every rank
(trainer/data/text.py keeps a mesh-independent position), so DCP keeps one copy. The RNG states
differ per rank and are stored under `train_state.rng.rank_<r>`; a rank that has no entry (the
run resumed on more ranks) keeps its seeded RNG and says so.

All ranks must share the checkpoint folder (a shared or network file system across hosts). The
local tier (`local_folder`, trainer/checkpoint/local.py) is per host instead: each rank writes its
own shards there more often, and a resume takes it when it is newer (docs/checkpointing.md,
"Multi-tier checkpoints").
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

from models.errors import ConfigError
from trainer.checkpoint import remote
from trainer.checkpoint.local import LocalSaveFailed, LocalTier, plan_restore, receive_state, send_state
from trainer.checkpoint.manifest import MANIFEST, CorruptCheckpointError, verify_checkpoint, write_manifest
from trainer.checkpoint.state import (
    _DCP_ERRORS,
    _STEP_DIR,
    ASYNC_MODES,
    Stateful,
    _dist_on,
    _drop_missing_rank_entries,
    _fsync_dir,
    _rank,
    _say,
    logger,
    short_error,
)
from trainer.runtime import storage
from trainer.runtime.atomic import errno_text, publish
from trainer.runtime.device import collective_timeout, cpu_backend

# ---------------------------------------------------------------------------------------------
# Key and shape checks: every load path refuses a state that does not match in either direction.


def _natural(key: str) -> list:
    """Sort key that puts layers.2 before layers.10."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", key)]


def check_entries(
    *,
    expected: dict[str, tuple | None],
    stored: dict[str, tuple | None],
    key: str,
    where: str,
    what: str = "the model",
    fix: str = "",
) -> None:
    """ConfigError naming the first differing entries unless `stored` has exactly the names of
    `expected` and the same shapes (None = not a tensor, shape not compared).

    expected: what this run needs (name -> shape); stored: what the file holds. Used by every
    load path (resume, initial dcp/hf weights, scripts/convert.py both ways), so a checkpoint
    with more or fewer layers, or other widths, is refused before anything is loaded or written.
    """
    missing = sorted(set(expected) - set(stored), key=_natural)
    unexpected = sorted(set(stored) - set(expected), key=_natural)
    reshaped = [
        k
        for k in sorted(set(expected) & set(stored), key=_natural)
        if expected[k] is not None and stored[k] is not None and tuple(expected[k]) != tuple(stored[k])
    ]
    if not (missing or unexpected or reshaped):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} entries of {what} are not in it (first: {', '.join(missing[:3])})")
    if unexpected:
        parts.append(f"it has {len(unexpected)} entries {what} lacks (first: {', '.join(unexpected[:3])})")
    if reshaped:
        k = reshaped[0]
        parts.append(
            f"{len(reshaped)} entries differ in shape (first: {k} is {list(stored[k])} there, "
            f"{list(expected[k])} in {what})"
        )
    raise ConfigError(
        f"{key}: {where} does not match {what}: "
        + "; ".join(parts)
        + (f"; allowed: {fix}" if fix else "; allowed: a checkpoint of the same model args (n_layers, dim, ...)")
    )


def _shape(value: Any) -> tuple | None:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _reader(path: Path | str):
    """DCP's reader for a local step folder or a gs:// step (trainer/runtime/storage.py)."""
    if storage.is_remote(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        storage.filesystem(key="checkpoint.folder")  # gcsfs present, its zonal probe off
        return FsspecReader(str(path), **storage.fs_kwargs())
    return dcp.FileSystemReader(str(path))


def _stored_shapes(path: Path) -> dict[str, tuple | None]:
    """name -> global shape (None for non-tensor entries) from a DCP checkpoint's metadata."""
    metadata = _reader(path).read_metadata().state_dict_metadata
    return {k: (tuple(v.size) if hasattr(v, "size") else None) for k, v in metadata.items()}


# ---------------------------------------------------------------------------------------------
# The manager.


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed (disk full, permissions...); earlier checkpoints are intact."""


class _ErrnoKeepingFileSystem(FileSystem):
    """DCP's local file system, except that a write which fails inside `torch.save` fails with its
    OSError. torch's zip writer reports a full disk as "unexpected pos 704 vs 598" and keeps the
    OSError only as the exception's `__context__`, which DCP's gather of the per-rank failures
    (pickled, even for one rank) drops; so it is recovered here, on the rank that wrote."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str):
        with super().create_stream(path, mode) as stream:
            try:
                yield stream
            except Exception as e:
                lost = e.__cause__ or e.__context__
                while lost is not None and not (isinstance(lost, OSError) and lost.errno):
                    lost = lost.__cause__ or lost.__context__
                if isinstance(e, OSError) or lost is None:
                    raise
                raise OSError(lost.errno, os.strerror(lost.errno), str(path)) from e


def _storage_writer(path: Path | str) -> FileSystemWriter:
    """DCP's writer for a local checkpoint folder (what `checkpoint_id=path` picks) on the file
    system above; for a gs:// step, DCP's fsspec writer (one file per rank, like the local one)."""
    if storage.is_remote(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        storage.filesystem(key="checkpoint.folder")
        writer = FsspecWriter(str(path), sync_files=False, **storage.fs_kwargs())
        # Object storage has no rename, and gcsfs's move API is missing from emulators (it retries
        # ~30 s before it copies): DCP's `.metadata.tmp` -> `.metadata` is a copy and a delete.
        dcp_fs = writer.fs

        def rename(path, new_path) -> None:
            dcp_fs.fs.copy(str(path), str(new_path))
            dcp_fs.fs.rm_file(str(path))

        dcp_fs.rename = rename
        return writer
    writer = FileSystemWriter(str(path))
    writer.fs = _ErrnoKeepingFileSystem()
    return writer


def _then_manifest(future: Any, folder: Path) -> None:
    """Rank 0's async save: wait for DCP's write (every rank's files and .metadata), then write
    the manifest, in the background thread, before the checkpoint is published."""
    future.result()
    (remote.write_manifest if storage.is_remote(folder) else write_manifest)(folder)


def _save_failed(error: BaseException, what: str, tmp: Path, *, remove: bool) -> CheckpointSaveError:
    """One line for a failed save: what failed and why (the errno text when the error carries one:
    "No space left on device", "File too large", "Permission denied"); `remove` (rank 0) deletes
    the partial `.tmp-step-N` first, so nothing of the failed save stays on disk."""
    if storage.is_remote(tmp):
        if remove:
            try:
                remote.remove_step(tmp)
            except Exception:  # noqa: BLE001 - without a manifest the step is ignored anyway
                pass
        why = storage.error_text(error, tmp)
        gone = "its partial objects were removed; " if remove else ""
        return CheckpointSaveError(
            f"checkpoint: {what} failed: {why}; {gone}earlier checkpoints in {tmp.rsplit('/', 1)[0]} are intact"
        )
    if remove:
        shutil.rmtree(tmp, ignore_errors=True)
    why = errno_text(error, tmp.parent) or short_error(error)
    gone = "its partial files were removed; " if remove else ""
    return CheckpointSaveError(
        f"checkpoint: {what} failed: {why}; {gone}earlier checkpoints in {tmp.parent} are intact"
    )


def complete_steps(folder: str | os.PathLike) -> list[int]:
    """Steps with a complete checkpoint under `folder` (step-N with DCP metadata; on gs://, step-N
    with its manifest, the commit point), ascending."""
    if storage.is_remote(folder):
        return remote.complete_steps(str(folder))
    folder = Path(folder)
    if not folder.is_dir():
        return []
    steps = []
    for entry in folder.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and (entry / ".metadata").is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


class CheckpointManager:
    """Save every `interval` steps, resume from the newest complete checkpoint.

    folder: the checkpoint folder (absolute, or relative to the working directory; the trainer
        passes dump_folder/checkpoint.folder).
    keep_latest_k: keep only the newest k complete checkpoints (0 keeps all).
    async_mode: "disabled" (blocking dcp.save) or "async" (dcp.async_save: states are copied to
        host memory, written in a background thread over a dedicated gloo group, and renamed to
        step-N once the write has finished; `wait()` blocks until then).
    load_step: -1 resumes from the newest complete checkpoint (or starts fresh if none); N >= 0
        loads step-N and fails with ConfigError if it is missing or broken.
    fallback_on_corrupt: when the newest checkpoint fails its checksums (load_step -1), load the
        newest older one that passes instead of stopping with an error (which names the file
        and the older step to use).
    local_folder, local_interval: the local tier (trainer/checkpoint/local.py), "" for none;
        slice_rank and layout place this rank inside its slice (`local.slice_layout`). A resume
        (load_step -1) takes the local tier's newest step that some rank of every replica group
        has complete when it is newer than the persistent tier's newest (ranks without it receive
        it from a peer); `resumed` says which tier and step were loaded (and, from the local tier,
        `from_peer` ranks restored from a peer in `peer_s` seconds).
    Every save writes manifest.json (per-file CRC-32s) into the checkpoint before it becomes
    visible; every load checks it first.
    Every rank constructs the manager and calls every method (the calls hold collectives).
    """

    def __init__(
        self,
        *,
        folder: str | os.PathLike,
        interval: int,
        keep_latest_k: int,
        async_mode: str,
        enable: bool,
        load_step: int = -1,
        fallback_on_corrupt: bool = False,
        local_folder: str = "",
        local_interval: int = 1,
        slice_rank: int = 0,
        layout: dict | None = None,
        entries_per_rank: bool = False,
    ):
        """`entries_per_rank`: the ranks hold different parameters (pipeline parallelism: each pp
        rank its own layers), so a checkpoint's entries are checked against their union."""
        if async_mode not in ASYNC_MODES:
            raise ConfigError(f"checkpoint.async_mode: {async_mode!r} is not a mode; allowed: {', '.join(ASYNC_MODES)}")
        if interval < 1:
            raise ConfigError(f"checkpoint.interval: {interval} must be >= 1; allowed: a positive integer")
        if keep_latest_k < 0:
            raise ConfigError(
                f"checkpoint.keep_latest_k: {keep_latest_k} must be >= 0 (0 keeps all); allowed: an integer >= 0"
            )
        if load_step < -1:
            raise ConfigError(f"checkpoint.load_step: {load_step}; allowed: -1 (newest) or a saved step >= 0")
        self._remote = storage.is_remote(folder)
        if self._remote:
            storage.split_url(str(folder), key="checkpoint.folder")
        self.folder = str(folder).rstrip("/") if self._remote else Path(folder)
        self.interval = interval
        self.keep_latest_k = keep_latest_k
        self.async_mode = async_mode
        self.enable = enable
        self.load_step = load_step
        self.fallback_on_corrupt = fallback_on_corrupt
        self._entries_per_rank = entries_per_rank
        self._pending: tuple[Any, int] | None = None  # (future, step) of an async save
        self._hasher: ThreadPoolExecutor | None = None  # rank 0: writes an async save's manifest
        self._last_saved_step: int | None = None
        self._distributed = _dist_on()
        self._is_rank0 = _rank() == 0
        # Checkpoint coordination (DCP's plan exchange, barriers, async saves) runs on its own
        # gloo group: async saves talk from a background thread and must not interleave with
        # the training collectives, and gloo works whatever the device backend is.
        self._pg = (
            dist.new_group(backend=cpu_backend(), timeout=collective_timeout())
            if (enable and self._distributed)
            else None
        )
        # The local tier gathers on a group of its own: an async save of the persistent tier may be
        # talking on `_pg` from its background thread at the same time.
        self._local_pg = (
            dist.new_group(backend=cpu_backend(), timeout=collective_timeout())
            if (enable and local_folder and self._distributed)
            else None
        )
        self.local = (
            LocalTier(
                root=local_folder,
                interval=local_interval,
                slice_rank=slice_rank,
                layout=layout or {},
                group=self._local_pg,
                writer=_storage_writer,
            )
            if (enable and local_folder)
            else None
        )
        self.resumed: dict[str, Any] | None = None  # {"tier": "local" | "persistent", "step": N}
        self.save_seconds: dict[str, float] = {}  # since the last `take_save_seconds`
        if enable and not self._remote and self.folder.exists() and not self.folder.is_dir():
            raise ConfigError(
                f"checkpoint.folder: {self.folder} exists and is not a directory; allowed: a folder or a path not yet used"
            )

    # -- queries ----------------------------------------------------------------------------

    def complete_steps(self) -> list[int]:
        """Steps with a complete checkpoint (step-N with DCP metadata), ascending."""
        return complete_steps(self.folder)

    def step_path(self, step: int) -> Path:
        return f"{self.folder}/step-{step}" if self._remote else self.folder / f"step-{step}"

    def _tmp_path(self, step: int) -> Path:
        """Where a save of `step` is written: `.tmp-step-N`, renamed when complete; on gs://, step-N
        itself (no rename there: the manifest, written last, is the commit point)."""
        return self.step_path(step) if self._remote else self.folder / f".tmp-step-{step}"

    # -- load -------------------------------------------------------------------------------

    def load(self, states: dict[str, Stateful]) -> int:
        """Restore `states` from the newest complete checkpoint (or step `load_step`).

        Returns the step loaded, or 0 when checkpointing is off or there is nothing to resume.
        A missing or unreadable checkpoint named by load_step, a checkpoint whose files fail
        their checksums, or one that does not fit the states (other keys or shapes: another
        model, more or fewer layers) raises ConfigError; nothing on disk is changed. Prints
        (rank 0) what was taken from the checkpoint and what from the config.
        """
        if not self.enable:
            return 0
        available = self.complete_steps()
        if self.local is not None and self.load_step < 0:
            step = self._load_local(states, newest_persistent=max(available, default=0))
            if step:
                return step
        if self.load_step >= 0:
            key = "checkpoint.load_step"
            if self.load_step not in available:
                raise ConfigError(
                    f"checkpoint.load_step: {self.step_path(self.load_step)} is not a complete checkpoint; "
                    f"allowed: -1 (newest) or one of the saved steps {available or '(none)'}"
                )
            candidates = [self.load_step]
        else:
            key = "checkpoint.folder"
            if not available:
                return 0
            candidates = available[::-1]
        for i, step in enumerate(candidates):
            path = self.step_path(step)
            problem = self._verify(path)
            if problem is None:
                break
            older = candidates[i + 1 :] if self.load_step < 0 else [s for s in available if s < step][::-1]
            if self.load_step < 0 and self.fallback_on_corrupt and older:
                _say(f"checkpoint: {problem}; checkpoint.fallback_on_corrupt is set: trying step-{older[0]}")
                continue
            if older:
                hint = (
                    f"allowed: to resume from the previous checkpoint set checkpoint.load_step = {older[0]} "
                    "(or checkpoint.fallback_on_corrupt = true)"
                )
            else:
                hint = "no older checkpoint to fall back to; allowed: move the folder away to start fresh"
            raise ConfigError(f"{key}: {path} is corrupt: {problem}; {hint}")
        self._load_path(path, states, key)
        tier = "the persistent tier " if self.local is not None else ""
        _say(
            f"checkpoint: resumed from {tier}{path} (step {step}): weights, optimizer moments, lr-schedule step, "
            "data position and RNG from the checkpoint; lr, schedule, betas, eps and weight_decay from the config"
        )
        self._resumed("persistent", step, states)
        return step

    def _resumed(self, tier: str, step: int, states: dict[str, Stateful]) -> None:
        self.resumed = {"tier": tier, "step": step}
        for state in states.values():
            for note in getattr(state, "resume_notes", ()):
                _say(f"checkpoint:   {note}")

    def _load_local(self, states: dict[str, Stateful], *, newest_persistent: int) -> int:
        """Resume from the local tier when its newest step that every replica group holds is newer
        than the persistent tier's (a collective); 0 when it is not. Ranks that hold the step load
        their own files; a rank without it (a replaced host) receives it from a peer that does
        (`local.plan_restore`). A holder whose files fail their checksums is not used: another
        holder of its group serves instead, else an older step, else the persistent tier."""
        local = self.local
        holdings = local.gather([*local.complete_steps()])
        rank = _rank()
        per_slice = local.layout.get("ranks_per_slice") or len(holdings)
        while True:
            step, sources = plan_restore(holdings, per_slice)
            if step <= newest_persistent:
                if step:
                    _say(f"checkpoint: local tier's newest complete step {step} is not newer than {self.folder}'s")
                return 0
            problems = local.verify(step, holds=rank not in sources)
            if not any(problems):
                break
            for g, problem in enumerate(problems):
                if problem is not None:
                    _say(f"checkpoint: local tier step {step}: {problem} (rank {g}); not restoring from those files")
                    holdings[g] = [s for s in holdings[g] if s != step]
        path = local.step_path(step)
        # Every rank builds its state dicts here, at the same point: building them may run
        # collectives of the training mesh (DTensor states), which must not cross the gathers below.
        state_dict = {name: state.state_dict() for name, state in states.items()}
        receivers = sorted(g for g, src in sources.items() if src == rank)
        rng = state_dict.get("train_state", {}).get("rng")
        if isinstance(rng, dict):  # a source also reads its receivers' RNG (every rank's files hold all)
            for dst in receivers:
                rng.setdefault(f"rank_{dst}", b"")
        error = None
        if rank not in sources:
            try:
                state_dict = self._read_path(path, states, "checkpoint.local_folder", no_dist=True, into=state_dict)
            except ConfigError as e:
                error = str(e)
        first = next((e for e in local.gather(error) if e), None)
        if first is not None:
            raise ConfigError(first)
        t0 = time.perf_counter()
        if rank in sources:
            state_dict = receive_state(state_dict, sources[rank], local.group)
        for dst in receivers:
            send_state(state_dict, dst, local.group)
        peer_s = max(local.gather(time.perf_counter() - t0 if rank in sources else 0.0))
        self._apply(states, state_dict)
        persistent = f"step {newest_persistent}" if newest_persistent else "none"
        peers = f"{len(sources)} of {len(holdings)} ranks restored from a peer" + (
            f" in {peer_s:.2f} s" if sources else ""
        )
        _say(
            f"checkpoint: resumed from the local tier {local.root}/rank-*/step-{step} (step {step}; newest in "
            f"{self.folder}: {persistent}; {peers}): weights, optimizer moments, lr-schedule step, data position "
            "and RNG from the checkpoint; lr, schedule, betas, eps and weight_decay from the config"
        )
        self._resumed("local", step, states)
        self.resumed.update(from_peer=len(sources), peer_s=round(peer_s, 3))
        return step

    def _verify(self, path: Path) -> str | None:
        """Rank 0 checks the manifest (one read of the files, not one per rank); every rank gets
        the verdict: None if the checkpoint is intact (or has no manifest), else the reason."""
        problem = None
        if self._is_rank0:
            try:
                if not (remote.verify_checkpoint if self._remote else verify_checkpoint)(path):
                    logger.warning("checkpoint: %s has no %s (written before checksums); not verified", path, MANIFEST)
            except CorruptCheckpointError as e:
                problem = str(e)
        if self._distributed:
            box = [problem]
            dist.broadcast_object_list(box, src=0, group=self._pg)
            problem = box[0]
        return problem

    def _load_path(self, path: Path, states: dict[str, Stateful], key: str) -> None:
        """Load `path` into `states`."""
        self._apply(states, self._read_path(path, states, key))

    @staticmethod
    def _apply(states: dict[str, Stateful], state_dict: dict[str, Any]) -> None:
        for name, state in states.items():
            state.load_state_dict(state_dict[name])

    def _read_path(
        self, path: Path, states: dict[str, Stateful], key: str, *, no_dist: bool = False, into: dict | None = None
    ) -> dict:
        """`states`' state dicts (`into`, when already built) with the values of `path`, checked
        against its entries first; no_dist: this rank reads its own files alone (a local-tier step
        holds this rank's shards, written without collectives)."""
        try:
            stored = _stored_shapes(path)
        except Exception as e:
            raise ConfigError(
                f"{key}: {path} is not a readable DCP checkpoint ({short_error(e)}); allowed: a DCP checkpoint folder"
            ) from e
        state_dict = into if into is not None else {name: state.state_dict() for name, state in states.items()}
        _drop_missing_rank_entries(state_dict, set(stored))
        flat = flatten_state_dict(state_dict)[0]
        # Model and optimizer moments must match exactly, in both directions (a checkpoint with
        # more layers must not load into fewer); the small states only need what this run reads.
        strict = ("model.", "optimizer.state.")
        expected = {k: _shape(v) for k, v in flat.items() if k.startswith(strict)}
        if self._entries_per_rank and self._pg is not None and not no_dist:
            # Pipeline parallelism: the run's model is every pp rank's layers together.
            every: list[Any] = [None] * dist.get_world_size(self._pg)
            dist.all_gather_object(every, expected, group=self._pg)
            expected = {k: v for part in every for k, v in part.items()}
        check_entries(
            expected=expected,
            stored={k: v for k, v in stored.items() if k.startswith(strict)},
            key=key,
            where=str(path),
            what="this run's model and optimizer",
        )
        missing = [k for k in flat if k not in stored]
        if missing:
            raise ConfigError(
                f"{key}: {path} does not match this run: {len(missing)} entries missing, e.g. {missing[:3]} "
                "(another model or optimizer?); allowed: a checkpoint of this run's model and optimizer"
            )
        try:
            dcp.load(
                state_dict,
                checkpoint_id=str(path),
                storage_reader=_reader(path),
                process_group=None if no_dist else self._pg,
                no_dist=no_dist or not self._distributed,
            )
        except _DCP_ERRORS as e:
            raise ConfigError(
                f"{key}: cannot load {path}: {short_error(e)}; allowed: a DCP checkpoint of this run"
            ) from e
        return state_dict

    # -- save -------------------------------------------------------------------------------

    def maybe_save(self, step: int, states: dict[str, Stateful], *, force: bool = False) -> bool:
        """Save at every `interval`-th step (or when `force`, e.g. the last step).

        Also finishes an earlier async save whose write has completed. Returns True if a save
        of `step` was started.
        """
        if not self.enable:
            return False
        self._poll_async()
        if step == self._last_saved_step or not (force or step % self.interval == 0):
            return False
        self.save(step, states)
        return True

    def local_due(self, step: int) -> bool:
        """A local-tier save is due after `step` (every rank agrees: the same step everywhere)."""
        return self.local is not None and self.local.due(step)

    def save_local(self, step: int, states: dict[str, Stateful]) -> None:
        """Write this rank's shards to the local tier (blocking; a collective for the RNG gather)."""
        try:
            self.save_seconds["ckpt_local_s"] = self.local.save(step, states)
        except LocalSaveFailed as e:  # one line, the same on every rank
            raise CheckpointSaveError(str(e)) from None

    def take_save_seconds(self) -> dict[str, float]:
        """Seconds the saves since the last call blocked the loop (ckpt_local_s, ckpt_save_s)."""
        out, self.save_seconds = self.save_seconds, {}
        return {k: round(v, 4) for k, v in out.items()}

    def save(self, step: int, states: dict[str, Stateful]) -> None:
        """Write `states` as step-N now (blocking, or started in the background when async)."""
        assert self.enable
        t0 = time.perf_counter()
        try:
            self._save(step, states)
        finally:
            self.save_seconds["ckpt_save_s"] = time.perf_counter() - t0

    def _save(self, step: int, states: dict[str, Stateful]) -> None:
        self.wait()  # one save in flight at a time; also publishes the previous one
        tmp = self._tmp_path(step)
        if self._is_rank0:
            try:
                if self._remote:
                    self._remove_leftovers()
                    remote.remove_step(tmp)  # a re-saved step: its manifest goes first
                else:
                    self.folder.mkdir(parents=True, exist_ok=True)
                    self._remove_leftovers()
            except Exception if self._remote else OSError as e:
                raise _save_failed(e, f"saving step {step} into {self.folder}", tmp, remove=False) from e
        self._barrier()
        state_dict = {name: state.state_dict() for name, state in states.items()}
        self._last_saved_step = step
        try:
            if self.async_mode == "async":
                future = dcp.async_save(
                    state_dict,
                    storage_writer=_storage_writer(tmp),
                    process_group=self._pg,
                    no_dist=not self._distributed,
                )
                if self._is_rank0:
                    # The manifest is written in the background too, once DCP's write is done.
                    self._hasher = self._hasher or ThreadPoolExecutor(1, thread_name_prefix="ckpt-manifest")
                    future = self._hasher.submit(_then_manifest, future, tmp)
                self._pending = (future, step)
                return
            dcp.save(
                state_dict, storage_writer=_storage_writer(tmp), process_group=self._pg, no_dist=not self._distributed
            )
        except _DCP_ERRORS as e:
            raise _save_failed(e, f"saving step {step} to {tmp}", tmp, remove=self._is_rank0) from e
        self._barrier()  # every rank's shards are written before the checkpoint becomes visible
        if self._is_rank0:
            try:
                (remote.write_manifest if self._remote else write_manifest)(tmp)
                self._publish(step)
            except Exception if self._remote else OSError as e:
                raise _save_failed(e, f"writing {tmp / MANIFEST} and publishing step {step}", tmp, remove=True) from e
        self._barrier()

    def _poll_async(self) -> None:
        """Publish a finished async save without blocking (called every step)."""
        if self._pending is None:
            return
        future, step = self._pending
        if not future.done():
            return
        self._pending = None
        self._result(future, step)  # re-raise a failed write on every rank
        # DCP's coordinator (rank 0) writes .metadata only after gathering every rank's write
        # results, so on rank 0 a finished future means the whole checkpoint is on disk.
        if self._is_rank0:
            self._publish(step)

    def wait(self) -> None:
        """Block until an in-flight async save is written and published as step-N."""
        if self._pending is None:
            return
        future, step = self._pending
        self._pending = None
        self._result(future, step)
        if self._is_rank0:
            self._publish(step)
        self._barrier()

    def _result(self, future: Any, step: int) -> None:
        try:
            future.result()
        except _DCP_ERRORS as e:
            tmp = self._tmp_path(step)
            raise _save_failed(e, f"saving step {step} to {tmp}", tmp, remove=self._is_rank0) from e

    def close(self) -> None:
        """Finish any in-flight save and release the checkpoint process group."""
        self.wait()
        for group in (self._pg, self._local_pg):
            if group is not None and _dist_on():
                dist.destroy_process_group(group)
        self._pg = self._local_pg = None
        if self._hasher is not None:
            self._hasher.shutdown()
            self._hasher = None

    # -- rank-0 file operations -----------------------------------------------------------------

    def _publish(self, step: int) -> None:
        if self._remote:  # the manifest, written last, published it
            logger.info("checkpoint: saved %s", self.step_path(step))
            self._purge()
            return
        tmp = self.folder / f".tmp-step-{step}"
        final = self.step_path(step)
        assert (tmp / ".metadata").is_file(), f"{tmp} has no .metadata after a finished save"
        # Re-saving a step (resumed from an older one) moves the old copy aside first, so `final`
        # is at every instant either absent or complete (the one publisher, trainer/runtime/atomic.py).
        publish(tmp, final, replace=True)
        _fsync_dir(self.folder)
        logger.info("checkpoint: saved %s", final)
        self._purge()

    def _purge(self) -> None:
        if self.keep_latest_k <= 0:
            return
        for step in self.complete_steps()[: -self.keep_latest_k]:
            if self._remote:
                remote.remove_step(self.step_path(step))  # manifest first: invisible before any file goes
                continue
            old = self.folder / f".old-step-{step}"
            self.step_path(step).rename(old)  # invisible to load before any file is removed
            shutil.rmtree(old, ignore_errors=True)

    def _remove_leftovers(self) -> None:
        if self._remote:  # steps without a manifest: saves that were killed or failed
            for url in remote.incomplete_steps(self.folder):
                remote.remove_step(url)
            return
        for entry in self.folder.iterdir():
            if entry.name.startswith((".tmp-step-", ".old-step-")) and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)

    def _barrier(self) -> None:
        if self._distributed:
            dist.barrier(group=self._pg)
