"""Training metrics: progress bar, console lines, metrics.jsonl and TensorBoard.

The loop calls `MetricsLogger.log(step, tokens=..., loss=..., ...)` after every step. Most
calls only advance the progress bar (shown when stderr is a terminal) and a token counter (no
device sync); every `log_freq`
steps (and on the first and the last step) the logger turns the values into floats, computes
throughput over the time since the previous logged step, and writes one record to the console,
`metrics.jsonl` and `tb/`. All of it happens on rank 0 only; the values passed in are expected
to be already reduced across ranks where that matters (the loss), and per device otherwise
(tokens, memory).

Record keys: step, loss, grad_norm, lr, tokens_per_sec (or samples_per_sec for a run whose
unit is samples: FLUX), tflops, mfu_pct, mfu_pct_causal, mem_gib, elapsed_s, plus any extra
keyword the caller logs. The throughput and tflops are per device; mfu_pct is null when the
device's peak is unknown.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from trainer.runtime.atomic import WriteFailed, atomic_file, write_error_text

_GIB = 1024**3


def _to_float(value: Any) -> float | None:
    """A logged value as a JSON-friendly float (tensors synced here, on logged steps only)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"metric must be a scalar, got a tensor of shape {tuple(value.shape)}")
        value = value.detach().float().item()  # a DTensor's .item() reads its (replicated) value
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    raise TypeError(f"metric must be a number or a scalar tensor, got {type(value).__name__}")


def _hms(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def peak_memory_gib(device: torch.device) -> float | None:
    """Peak memory of this process on `device`, in GiB (None if the backend cannot say).

    cuda: torch.cuda.max_memory_allocated (tensors, not the caching allocator's reserve).
    tpu and other accelerators: torch.accelerator.max_memory_allocated when the backend has it.
    cpu: the process's peak resident set size (ru_maxrss, KiB on Linux, bytes on macOS).
    """
    if device.type == "cpu":
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss / (_GIB if sys.platform == "darwin" else 1024**2)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / _GIB
    try:
        return torch.accelerator.max_memory_allocated(device) / _GIB
    except Exception:  # backend without memory stats
        return None


ROLLED_BACK = "metrics.rolled_back.jsonl"


def append_whole(f, data: bytes) -> None:
    """Append `data` to the unbuffered binary file `f` whole or not at all: a write cut short (a
    full disk, a quota) is truncated back to where it started before the OSError propagates, so
    the file never ends in part of a record."""
    start = f.seek(0, os.SEEK_END)
    try:
        view = memoryview(data)
        while view:
            view = view[f.write(view) :]  # FileIO.write may write part and raise on the next call
    except OSError:
        with contextlib.suppress(OSError):
            f.truncate(start)
        raise


def set_aside(path: Path, start_step: int) -> int:
    """Move the records of `path` with step > start_step (and unreadable lines, e.g. a line
    cut short by a kill) to metrics.rolled_back.jsonl next to it, each tagged with
    `"rolled_back_at": start_step`; rewrite `path` atomically. Returns how many moved."""
    if not path.is_file():
        return 0
    keep, moved = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                step = int(record["step"])
            except (ValueError, KeyError, TypeError):
                moved.append(json.dumps({"rolled_back_at": start_step, "unreadable": line.rstrip("\n")}))
                continue
            if step <= start_step:
                keep.append(line if line.endswith("\n") else line + "\n")
            else:
                moved.append(json.dumps({**record, "rolled_back_at": start_step}))
    if not moved:
        return 0
    with open(path.with_name(ROLLED_BACK), "ab", buffering=0) as f:
        append_whole(f, "".join(m + "\n" for m in moved).encode("utf-8"))
    with atomic_file(path, what="metrics") as f:
        f.write("".join(keep).encode("utf-8"))
    return len(moved)


class MetricsLogger:
    """Progress bar + console + metrics.jsonl + TensorBoard for one training run.

    dump_folder: where metrics.jsonl and tb/ go (created on rank 0).
    log_freq: log every this many steps (and always the first and the last step).
    total_steps: the run's last step, for the progress bar and its ETA.
    start_step: the step the run resumed from (0 for a fresh run): metrics.jsonl keeps the
        records up to it and is appended to; records after it (from a run that was interrupted
        or rolled back with load_step) move to metrics.rolled_back.jsonl, so metrics.jsonl holds
        one record per step. TensorBoard likewise hides the stale events after it.
    flops_per_token: FLOPs per unit: trainer.runtime.flops.flops_per_token(...) (a dict with "palm" and
        "causal") or a number (PaLM convention; per sample for unit = "samples"); None reports
        no TFLOP/s or MFU.
    unit: what throughput counts, "tokens" (LMs) or "samples" (FLUX): the record key is
        `<unit>_per_sec` and `log` takes the count as `tokens=` or `samples=`.
    peak_flops: peak FLOP/s of one device (trainer.runtime.flops.peak_flops_per_device); None -> MFU is null.
    peak_name: where the peak comes from, for the banner.
    device: the training device, for memory readings (cpu if None).
    """

    def __init__(
        self,
        *,
        dump_folder: str | os.PathLike,
        log_freq: int,
        enable_tensorboard: bool,
        total_steps: int,
        is_rank0: bool,
        start_step: int = 0,
        flops_per_token: dict[str, float] | float | None = None,
        peak_flops: float | None = None,
        peak_name: str = "given",
        device: torch.device | None = None,
        unit: str = "tokens",
    ):
        assert unit in ("tokens", "samples"), unit
        self.unit = unit
        assert log_freq >= 1 and total_steps >= 0 and start_step >= 0, (log_freq, total_steps, start_step)
        self.log_freq = log_freq
        self.total_steps = total_steps
        self.start_step = start_step
        self.is_rank0 = is_rank0
        self.device = device if device is not None else torch.device("cpu")
        self._flops: dict[str, float] = {}
        self.peak_flops: float | None = None
        self.peak_name = "none"
        self.set_flops(flops_per_token=flops_per_token, peak_flops=peak_flops, peak_name=peak_name)

        self._start_time = time.perf_counter()
        self._last_time = self._start_time
        self._first_log: tuple[int, float] | None = None  # (step, time) of the first record, for the ETA
        self._tokens_since_log = 0
        self._data_s_since_log, self._steps_since_log = 0.0, 0  # batch waits, for data_loading_*
        self._last_step = start_step
        self._jsonl = None
        self._tb = None
        self._pbar = None
        self.jsonl_path = Path(dump_folder) / "metrics.jsonl"
        if not is_rank0:
            return
        # Append: a resumed run keeps the records of the run it continues, up to its step.
        with self._failed_write():
            self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
            set_aside(self.jsonl_path, start_step)
            self._jsonl = open(self.jsonl_path, "ab", buffering=0)  # records appended whole (append_whole)
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides events >= start_step + 1 that an interrupted run wrote after the
            # checkpoint we resumed from, so curves do not fold back on themselves.
            purge = start_step + 1 if start_step > 0 else None
            self._tb = SummaryWriter(log_dir=str(Path(dump_folder) / "tb"), purge_step=purge)
        # The bar only on a terminal: in a batch job's log its \r redraws are noise, and the
        # console lines carry the ETA anyway.
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._pbar = tqdm(
                total=total_steps,
                initial=start_step,
                desc="train",
                unit="step",
                file=sys.stderr,
                dynamic_ncols=True,
                leave=True,
            )

    def set_flops(
        self, *, flops_per_token: dict[str, float] | float | None, peak_flops: float | None, peak_name: str = "given"
    ) -> None:
        """Set the model FLOPs per token and the device peak used for TFLOP/s and MFU.

        flops_per_token: trainer.runtime.flops.flops_per_token(...) ({"palm", "causal"}) or a number
            (PaLM convention). peak_flops: FLOP/s of one device, None -> MFU is null.
        """
        if isinstance(flops_per_token, dict):
            assert "palm" in flops_per_token, flops_per_token
            self._flops = {k: float(v) for k, v in flops_per_token.items()}
        elif flops_per_token is not None:
            self._flops = {"palm": float(flops_per_token)}
        else:
            self._flops = {}
        self.peak_flops = float(peak_flops) if peak_flops else None
        self.peak_name = peak_name if self.peak_flops else "none"

    def should_log(self, step: int) -> bool:
        return step % self.log_freq == 0 or step == self.start_step + 1 or step == self.total_steps

    def log(
        self, step: int, *, tokens: int = 0, samples: float = 0, data_s: float = 0.0, force: bool = False, **values: Any
    ) -> dict[str, Any] | None:
        """Account one step; on a logging step write and return its record (else None).

        tokens / samples: what this device processed in this step (all micro-batches), in the
            logger's unit (the other stays 0).
        data_s: seconds this step spent getting its batches on the host (reading, tokenizing, packing;
            not the copy to the device, which can wait for steps still queued there).
        values: loss, grad_norm, lr and any extra scalar (floats or 0-d tensors; tensors are only
            read on logging steps, so passing them every step costs no sync).
        """
        self._tokens_since_log += tokens if self.unit == "tokens" else samples
        self._data_s_since_log += data_s
        self._steps_since_log += 1
        if self._pbar is not None:
            self._pbar.update(step - self._last_step if step > self._last_step else 1)
        self._last_step = step
        if not (force or self.should_log(step)):
            return None
        # Read the values first: on an async device .item() waits for the step to finish, so
        # the clock below includes it.
        record: dict[str, Any] = {"step": step}
        for key in ("loss", "grad_norm", "lr"):
            record[key] = _to_float(values.pop(key, None))
        now = time.perf_counter()
        interval = max(now - self._last_time, 1e-9)
        tokens_per_sec = self._tokens_since_log / interval  # units (tokens or samples) per second
        record[f"{self.unit}_per_sec"] = tokens_per_sec
        achieved = tokens_per_sec * self._flops["palm"] if "palm" in self._flops else None
        record["tflops"] = achieved / 1e12 if achieved is not None else None
        record["mfu_pct"] = 100.0 * achieved / self.peak_flops if achieved is not None and self.peak_flops else None
        if "causal" in self._flops and self.peak_flops:
            record["mfu_pct_causal"] = 100.0 * tokens_per_sec * self._flops["causal"] / self.peak_flops
        record["data_loading_s"] = self._data_s_since_log / self._steps_since_log
        record["data_loading_pct"] = 100.0 * self._data_s_since_log / interval
        record["mem_gib"] = peak_memory_gib(self.device)
        record["elapsed_s"] = now - self._start_time
        for key, value in values.items():
            record[key] = _to_float(value)
        self._last_time = now
        self._tokens_since_log = 0
        self._data_s_since_log, self._steps_since_log = 0.0, 0
        # ETA from the steps after the first record, which carries start-up and compilation.
        eta_s = None
        if self._first_log is None:
            self._first_log = (step, now)
        elif step > self._first_log[0]:
            eta_s = max(0, self.total_steps - step) * (now - self._first_log[1]) / (step - self._first_log[0])
        if self.is_rank0:
            self._write(record, eta_s)
        return record

    @contextlib.contextmanager
    def _failed_write(self):
        """A failed write of metrics.jsonl (disk full, quota, read-only, permission) ends the run
        with one line naming the file and the cause (WriteFailed: `error: ...`, exit 1); the
        records written before it stay whole (`append_whole`)."""
        try:
            yield
        except OSError as e:
            raise WriteFailed(
                f"writing metrics {self.jsonl_path} failed: {write_error_text(e, self.jsonl_path.parent)}"
            ) from e

    def _write(self, record: dict[str, Any], eta_s: float | None) -> None:
        step = record["step"]
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        # NaN/inf losses are real events: JSON has no literal for them, so they become null
        # there and stay visible on the console and in TensorBoard.
        with self._failed_write():
            append_whole(self._jsonl, (json.dumps(clean) + "\n").encode("utf-8"))
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and value is not None:
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        line = self.format_line(record, self.total_steps, eta_s)
        if self._pbar is not None:
            self._pbar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    @staticmethod
    def format_line(record: dict[str, Any], total_steps: int, eta_s: float | None = None) -> str:
        """The console line of one record; missing values print as '-'."""

        def fmt(label: str, key: str, spec: str, suffix: str = "") -> str:
            value = record.get(key)
            return f"{label} {'-' if value is None else format(value, spec) + suffix}"

        width = len(str(total_steps))
        return "  ".join(
            [
                f"step {record['step']:>{width}}/{total_steps}",
                fmt("loss", "loss", ".4f"),
                fmt("grad_norm", "grad_norm", ".3f"),
                fmt("lr", "lr", ".2e"),
                fmt("tok/s", "tokens_per_sec", ",.0f")
                if "samples_per_sec" not in record
                else fmt("samples/s", "samples_per_sec", ",.3g"),
                fmt("TFLOP/s", "tflops", ".3g"),
                fmt("MFU", "mfu_pct", ".2f", "%"),
                fmt("mem", "mem_gib", ".2f", " GiB"),
                "eta " + ("-" if eta_s is None else _hms(eta_s)),
            ]
        )

    def log_image(self, tag: str, image: torch.Tensor, step: int) -> None:
        """Write a [3, H, W] image in [0, 1] to TensorBoard (rank 0 with TensorBoard on; else nothing)."""
        if self._tb is not None:
            self._tb.add_image(tag, image.clamp(0, 1), step)
            self._tb.flush()

    def close(self) -> None:
        """Flush and close the files and the bar; safe to call twice."""
        if self._pbar is not None:
            self._pbar.close()
            self._pbar = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
