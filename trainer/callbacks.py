"""The training loop's side concerns, as small callbacks (trainer/train.py `_loop` keeps the step).

The loop calls every callback, in list order, at fixed points of each step (TorchTitan's and
Levanter's shape):
- `on_step_start(step)`: before the step's data is read;
- `on_step_end(step, out)`: after the step and the lr update (device work queued, no host sync);
- `on_sync(step)`: on a step that logs or saves, before either (host syncs allowed; may raise);
- `on_log(step, out, values)`: on a logged step, adds its optional keys to `values`, in order;
- `close()`: when the loop ends, also on an error.
Each hook does nothing by default. Validation (which decides whether a step logs) and the
preemption handler (which decides whether it saves) are the loop's, not callbacks.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from models.errors import NonFiniteLoss
from trainer.runtime import StepWatchdog, global_mean
from trainer.runtime.tpu_env import CacheMissCounter


class Callback:
    """A side concern of the loop (module docstring); every hook is a no-op here."""

    def on_step_start(self, step: int) -> None:
        pass

    def on_step_end(self, step: int, out) -> None:
        pass

    def on_sync(self, step: int) -> None:
        pass

    def on_log(self, step: int, out, values: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class NonFiniteTracker:
    """Non-finite gradient norms, tracked on the device so that steps need no host sync.

    The steps skip a non-finite update on the device (fused AdamW's `found_inf`, or the graph
    step's gated update), so weights stay finite. This records the first such step and the
    count; `read()` (a host sync) runs only on logged steps and before a checkpoint is written.
    The gradient norm is global (equal on every rank), so every rank reaches the same verdict.
    """

    def __init__(self, device: torch.device, start_step: int = 0):
        self.first_bad_step = torch.zeros((), dtype=torch.int64, device=device)
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)
        # The step number lives on the device and counts there: a Python int in the update
        # would be a constant of its program, a new program per step on a TPU (one compile each).
        self.step = torch.full((), start_step, dtype=torch.int64, device=device)

    def update(self, grad_norm: torch.Tensor) -> None:
        """Record the step that just ran (the one after the previous update, or start_step + 1)."""
        self.step = self.step + 1
        bad = ~torch.isfinite(grad_norm.detach())
        self.first_bad_step = torch.where(bad & (self.first_bad_step == 0), self.step, self.first_bad_step)
        self.skipped = self.skipped + bad.to(torch.int64)

    def read(self) -> tuple[int, int]:
        """(first step with a non-finite gradient norm or 0, number of skipped updates)."""
        return int(self.first_bad_step.item()), int(self.skipped.item())


class NonFiniteCheck(Callback):
    """Counts non-finite gradient norms on the device (`NonFiniteTracker`); on a logged or saved
    step stops the run at the first one (NonFiniteLoss), unless `skip_nonfinite_updates`, which
    logs `skipped_updates` instead."""

    def __init__(self, device: torch.device, start_step: int, *, skip: bool, folder: str):
        self.tracker, self.skip, self.folder, self.skipped = NonFiniteTracker(device, start_step), skip, folder, 0

    def on_step_end(self, step: int, out) -> None:
        self.tracker.update(out.grad_norm)

    def on_sync(self, step: int) -> None:
        first_bad, self.skipped = self.tracker.read()
        if first_bad and not self.skip:
            raise NonFiniteLoss(
                f"non-finite gradient norm at step {first_bad} (its update was skipped; stopped at step "
                f"{step}); the newest checkpoint (if any) in {self.folder} is from before it. Lower "
                "optimizer.lr and resume, or set training.skip_nonfinite_updates = true"
            )

    def on_log(self, step: int, out, values: dict[str, Any]) -> None:
        if self.skip:
            values["skipped_updates"] = self.skipped


class CacheMisses(Callback):
    """TPU: torch-tpu's compilation cache misses, printed (rank 0) when a step missed, and the
    totals logged (`compile_cache_misses`, `compilations`); nothing on other devices."""

    def __init__(self, device_type: str, *, is_rank0: bool):
        self.counter, self.is_rank0 = CacheMissCounter(device_type), is_rank0

    def on_step_end(self, step: int, out) -> None:
        missed = self.counter.step_done(step)
        if missed is not None and self.is_rank0:
            print(missed, flush=True)

    def on_log(self, step: int, out, values: dict[str, Any]) -> None:
        if self.counter.total is not None:
            values["compile_cache_misses"] = self.counter.total
            if (compiled := self.counter.compiled()) is not None:
                values["compilations"] = compiled


class Watchdog(Callback):
    """`[training] hang_dump_factor`: a step that runs far longer than the ones before dumps every
    thread's stack (trainer/runtime/watchdog.py)."""

    def __init__(self, watchdog: StepWatchdog):
        self.watchdog = watchdog

    def on_step_start(self, step: int) -> None:
        self.watchdog.step_started(step)

    def on_step_end(self, step: int, out) -> None:
        self.watchdog.step_finished()

    def close(self) -> None:
        self.watchdog.close()


class MoEKeys(Callback):
    """MoE models: the step's auxiliary loss (`moe_aux_loss`), expert-load imbalance (`moe_max_vio`)
    and, under a capacity, the copies dropped (`moe_dropped`, `moe_dropped_pct`)."""

    def on_log(self, step: int, out, values: dict[str, Any]) -> None:
        if out.aux_loss is not None:
            values["moe_aux_loss"] = global_mean(out.aux_loss)
        if out.moe_max_vio is not None:
            values["moe_max_vio"] = float(out.moe_max_vio)
        if out.moe_dropped is not None:  # `[moe] capacity_factor`: copies over capacity in the step
            values["moe_dropped"] = int(out.moe_dropped)
            values["moe_dropped_pct"] = float(out.moe_dropped_pct)


class MTPKeys(Callback):
    """Multi-token prediction (`[model] mtp_depth` > 0): each depth's loss (`mtp_loss_1`, ...), the
    mean over the data-parallel ranks; `loss` is then the main next-token loss (trainer/step/loss.py
    `MTPLoss`). Other loss terms returned the same way go by their `term_names` (DeepSeek-V4's
    `indexer_loss`, trainer/tasks/lm.py `IndexerLoss`)."""

    def on_log(self, step: int, out, values: dict[str, Any]) -> None:
        mtp = getattr(out, "mtp_losses", None)
        if mtp is not None:
            names = getattr(out, "term_names", None) or [f"mtp_loss_{k}" for k in range(1, len(mtp) + 1)]
            for name, value in zip(names, mtp.unbind(), strict=True):
                values[name] = global_mean(value)


class FirstLogKeys(Callback):
    """The first logged step's one-off keys: set-up time, the peak MFU is taken against (and the
    best compute dtype's), the compile time and graph size of the step, and after a resume its
    step and tier (`resume_step`, `resume_local_tier`) and, from the local tier, how many ranks
    received their state from a peer in another slice and how long that took (`resume_from_peer`,
    `resume_peer_s`)."""

    def __init__(
        self, *, t_start: float, peak: float | None, best_peak: float | None, step_fn, resumed: dict | None = None
    ):
        self.step_fn = step_fn
        self.extra: dict[str, Any] | None = {"setup_s": round(time.perf_counter() - t_start, 3)}
        if resumed is not None:  # which checkpoint tier the run resumed from (1 = the local tier)
            self.extra.update(resume_step=resumed["step"], resume_local_tier=int(resumed["tier"] == "local"))
            if "from_peer" in resumed:
                self.extra.update(resume_from_peer=resumed["from_peer"], resume_peer_s=resumed["peer_s"])
        if peak is not None:  # the peak MFU is taken against, and the best compute dtype's (CPU: may differ)
            self.extra.update(peak_tflops=peak / 1e12, peak_tflops_best=best_peak / 1e12)

    def on_log(self, step: int, out, values: dict[str, Any]) -> None:
        if self.extra is None:
            return
        if self.step_fn.compile_s is not None:
            self.extra.update(compile_s=round(self.step_fn.compile_s, 3), graph_nodes=self.step_fn.graph_nodes)
        values.update(self.extra)
        self.extra = None
