"""The local checkpoint tier: every rank writes its own shards to its host's disk, often.

Layout under `checkpoint.local_folder` (a path on each host's own disk):

    rank-R/step-N/       this rank's complete save: DCP files written without collectives
                         (`no_dist`: only this rank's shards), layout.json, manifest.json (last)
    rank-R/.tmp-step-N/  a save in progress (or one that was killed); ignored, removed by the next

R is the rank's place inside its slice (global rank mod ranks per slice; ranks are numbered
slice-major), so after a slice is lost and the job is relaunched on fewer slices, rank R of the
new job finds the files that rank R of a surviving slice wrote on the same host.

Why that is a replica of the lost slice's state: with the slices on `dp_replicate` (HSDP, the
default multislice layout), every slice holds the whole model and optimizer, sharded the same
way inside the slice; after each step's cross-slice all-reduce the same gradients enter the same
update, so rank R of every slice holds bitwise the same shards. A lost slice's local files are
therefore never needed: the surviving slices' files are copies of them. What is not replicated,
every rank's RNG state, is gathered before each save, and every rank's files carry all of them;
the data loader's state is a mesh-independent position, the same on every rank (trainer/data).
So any one surviving slice restores the global data order and the trajectory.

A save is written to `.tmp-step-N`, checksummed (manifest.json written last), then renamed; the
newest `KEEP` steps are kept. A save that fails on any rank (a full disk, a quota) removes that
rank's `.tmp-step-N` and stops every rank with the same one line (`LocalSaveFailed`: the folder and
the errno text); earlier steps and the persistent tier are untouched. A step is usable when every replica group of the resuming job (the
ranks with the same R across slices, `replica_groups`) has at least one rank that finds it
complete in its own `rank-R` folder with the same per-slice layout (`layout.json`); the manager
takes it when it is newer than the persistent tier's newest (trainer/checkpoint/manager.py).
A rank without the step (a replaced host: its disk is empty) receives it from the lowest rank of
its group that has it, which loaded its own files (`plan_restore`, `send_state`, `receive_state`).
"""

from __future__ import annotations

import json
import pickle
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.tensor import DTensor

from trainer.checkpoint.manifest import MANIFEST, CorruptCheckpointError, verify_checkpoint, write_manifest
from trainer.checkpoint.state import _DCP_ERRORS, _STEP_DIR, Stateful, _capture_rng, _fsync_dir, _rank, short_error
from trainer.runtime.atomic import errno_text, publish

LAYOUT = "layout.json"
KEEP = 2
"""Steps kept per rank: the newest complete one stays while the next is written."""


def slice_layout(*, mesh_shape: tuple, dcn_mesh_shape: tuple, ep: int, world_size: int, num_slices: int) -> dict:
    """What must match for one rank's local files to restore the same rank of another job: the
    mesh inside one slice (dp_replicate, dp_shard, cp, tp over the slice) and ep."""
    ici = [m // d for m, d in zip(mesh_shape, dcn_mesh_shape)]
    return {"ranks_per_slice": world_size // num_slices, "slice_mesh": ici, "ep": ep}


def replica_groups(world_size: int, ranks_per_slice: int) -> list[list[int]]:
    """The ranks that hold the same shards: rank R of every slice (ranks are numbered slice-major,
    so global rank g is slice g // ranks_per_slice, place g % ranks_per_slice)."""
    return [list(range(r, world_size, ranks_per_slice)) for r in range(ranks_per_slice)]


def plan_restore(holdings: list, ranks_per_slice: int) -> tuple[int, dict[int, int]]:
    """The newest step every replica group can restore, and where each rank without it gets it.

    holdings[g]: the steps global rank g has complete with this job's layout. Returns (step,
    {rank: source}) for the newest step that at least one rank of every replica group holds; a
    rank of the group that lacks it receives it from the group's lowest rank that has it (so every
    rank computes the same plan from the same gathered lists). (0, {}) when no step qualifies.
    """
    held = [set(h) for h in holdings]
    groups = replica_groups(len(held), ranks_per_slice)
    covered = set.intersection(*(set().union(*(held[g] for g in group)) for group in groups)) if groups else set()
    if not covered:
        return 0, {}
    step = max(covered)
    sources = {}
    for group in groups:
        source = min(g for g in group if step in held[g])
        sources.update({g: source for g in group if step not in held[g]})
    return step, sources


def _local(value: Any) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def send_state(state_dict: dict[str, Any], dst: int, group: Any) -> None:
    """Send a loaded state dict to rank `dst` (global) over `group` (gloo): first its non-tensor
    entries, the tensor names and the nesting (one pickled object), then every tensor (this rank's shard of a
    DTensor), in name order. `dst` holds the same shards (the same place in another slice)."""
    flat, mapping = flatten_state_dict(state_dict)
    names = sorted(k for k, v in flat.items() if isinstance(v, torch.Tensor))
    objects = {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}
    head = {"names": names, "objects": objects, "mapping": mapping}
    dist.send_object_list([head], dst=dst, group=group)
    for name in names:
        dist.send(_local(flat[name]).detach().cpu().contiguous(), dst=dst, group=group)


def receive_state(template: dict[str, Any], src: int, group: Any) -> dict[str, Any]:
    """The state dict `send_state` sent from rank `src`, received into this rank's `template` (the
    states' own state dicts: same names, shapes and shards); what to pass to `load_state_dict`."""
    flat, _ = flatten_state_dict(template)
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=group)
    head = box[0]
    missing = [k for k in head["names"] if not isinstance(flat.get(k), torch.Tensor)]
    if missing:
        raise RuntimeError(f"rank {src}'s local-tier state has tensors this rank lacks, e.g. {missing[:3]}")
    out: dict[str, Any] = dict(head["objects"])
    with torch.no_grad():
        for name in head["names"]:
            local = _local(flat[name])
            buffer = torch.empty(local.shape, dtype=local.dtype)
            dist.recv(buffer, src=src, group=group)
            local.copy_(buffer)
            out[name] = flat[name]
    return unflatten_state_dict(out, head["mapping"])  # the sender's nesting (its rng.rank_<r> entries)


class LocalSaveFailed(RuntimeError):
    """A rank's local-tier save failed (a full disk, a quota...): one line naming its folder and the
    errno text, raised on every rank; the partial `.tmp-step-N` is removed, earlier steps are kept."""


class LocalTier:
    """One rank's local tier: save every `interval` steps into `root/rank-R`, list complete steps.

    root: checkpoint.local_folder (absolute, on this host's disk). slice_rank: R, this rank's place
    inside its slice. layout: `slice_layout(...)` of this job. group: the checkpoint's gloo group
    (the RNG gather before a save), or None in a single process. writer: path -> DCP storage
    writer (the manager's, which keeps a full disk's errno).
    """

    def __init__(
        self, *, root: str, interval: int, slice_rank: int, layout: dict, group: Any, writer: Callable[[Path], Any]
    ):
        self.root = Path(root)
        self.folder = self.root / f"rank-{slice_rank}"
        self.interval = interval
        self.layout = layout
        self.group = group
        self.writer = writer

    def step_path(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    def save(self, step: int, states: dict[str, Stateful]) -> float:
        """Write this rank's shards of `states` as rank-R/step-N; the seconds it took. A collective
        (every rank's RNG is gathered first, every rank's outcome after): call it on every rank at
        the same step. A failed write on any rank raises LocalSaveFailed on every rank."""
        t0 = time.perf_counter()
        blob = pickle.dumps(_capture_rng())
        if self.group is not None:
            blobs: list[Any] = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(blobs, blob, group=self.group)
        else:
            blobs = [blob]
        state_dict = {name: state.state_dict() for name, state in states.items()}
        if "train_state" in state_dict:
            state_dict["train_state"]["rng"] = {f"rank_{r}": b for r, b in enumerate(blobs)}
        tmp = self.folder / f".tmp-step-{step}"
        problem = None
        try:
            self._write(step, state_dict, tmp)
        except _DCP_ERRORS as e:  # any failure of this rank's write: every rank stops alike
            shutil.rmtree(tmp, ignore_errors=True)  # nothing of the failed save stays on this disk
            why = errno_text(e, self.folder) or short_error(e)
            problem = f"checkpoint: saving step {step} to the local tier {tmp} failed: {why}"
        # Every rank learns whether one failed (a full disk on one host), so that all stop with the
        # same line instead of the others waiting in the next collective for a rank that left.
        every = self.gather(problem)
        failed = [(g, p) for g, p in enumerate(every) if p is not None]
        if failed:
            rank, first = failed[0]
            by = f" (rank {rank})" if len(every) > 1 else ""
            raise LocalSaveFailed(
                f"{first}{by}; its partial files were removed; earlier steps in {self.root} and the persistent "
                "checkpoint tier are intact"
            )
        for old in self.complete_steps()[:-KEEP]:
            aside = self.folder / f".old-step-{old}"
            self.step_path(old).rename(aside)
            shutil.rmtree(aside, ignore_errors=True)
        return time.perf_counter() - t0

    def _write(self, step: int, state_dict: dict[str, Any], tmp: Path) -> None:
        """Write `state_dict` to `tmp`, checksum it and publish it as step-N (the rename)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for entry in self.folder.iterdir():
            if entry.name.startswith((".tmp-step-", ".old-step-")) and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
        dcp.save(state_dict, storage_writer=self.writer(tmp), no_dist=True)
        (tmp / LAYOUT).write_text(json.dumps({**self.layout, "step": step, "saved_by_rank": _rank()}))
        write_manifest(tmp)  # the commit point of this rank's save
        publish(tmp, self.step_path(step), replace=True)
        _fsync_dir(self.folder)

    def complete_steps(self) -> list[int]:
        """Steps this rank has complete (DCP metadata, manifest) with this job's layout, ascending."""
        if not self.folder.is_dir():
            return []
        steps = []
        for entry in self.folder.iterdir():
            match = _STEP_DIR.match(entry.name)
            if not (match and (entry / ".metadata").is_file() and (entry / MANIFEST).is_file()):
                continue
            try:
                saved = json.loads((entry / LAYOUT).read_text())
            except (OSError, ValueError):
                continue
            if all(saved.get(k) == v for k, v in self.layout.items()):
                steps.append(int(match.group(1)))
        return sorted(steps)

    def verify(self, step: int, *, holds: bool = True) -> list[str | None]:
        """This rank's files of `step` against their manifest (when it `holds` the step); every
        rank's verdict, indexed by global rank (None: intact or not held). A collective."""
        problem = None
        if holds:
            try:
                verify_checkpoint(self.step_path(step))
            except CorruptCheckpointError as e:
                problem = short_error(e)
        return self.gather(problem)

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, indexed by global rank. A collective."""
        if self.group is None:
            return [value]
        every: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(every, value, group=self.group)
        return every
