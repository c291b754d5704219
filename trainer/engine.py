"""The trainer as a library: a training engine that an RL loop drives step by step.

`Engine.from_recipe("configs/llama3_debug.toml", overrides=["training.seq_len=64"])` builds the
run with the trainer's own `build_job(cfg, purpose="engine")` (trainer/job.py): the process
group (a world of one without torchrun), the rules, the `ParallelDims` and named `DeviceMesh`,
the model on the meta device -> TP, EP, AC, compile, SimpleFSDP -> materialize -> init (or
`[checkpoint] initial_load_path`), AdamW and the lr schedule; only the data loaders and the
checkpoint manager are left out. The caller owns the loop and the data:

    out = engine.forward_backward(batch, loss_fn)   # grads accumulate across calls
    out = engine.optimizer_step()                   # clip, step, zero_grad, lr schedule
    logp = engine.compute_logprobs(tokens)          # no grad
    engine.save(folder) / engine.load(folder)       # DCP, the trainer's checkpoint layout
    for name, tensor in engine.hf_state_dict(): ... # weight sync by Hugging Face names

Under torchrun every rank builds the engine and makes the same calls in the same order (they
hold collectives); each data-parallel rank passes its own part of the batch, as in the trainer.
docs/engine.md maps these calls onto VeRL's `BaseEngine`.

Every misuse of the API (a call out of order, a bad argument, a call after `close()` or after a
failed `load`) raises `EngineError` (a `ConfigError`, so a `ValueError`) with one message that
names the call and what is allowed, before any state changes; docs/engine.md lists them.

Not here, refused by the step plan's rules (`caller_loss`, trainer/step/plan.py): graph mode
(it captures the LM loss and the optimizer update into one graph, so it cannot run a caller's
loss function), the fused loss (it never forms the log-probs an RL loss reads) and families
whose task is not an LM.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from models.errors import ConfigError, NonFiniteLoss
from parallelisms.replicate_reduce import ReplicateReducer
from trainer import checkpoint as ckpt
from trainer.config import Config, build_config, parse_overrides
from trainer.job import build_job
from trainer.optim.expert_balance import ExpertBalance
from trainer.runtime import arrival_barrier, global_mean, shutdown_distributed
from trainer.runtime.device import torch_dtype
from trainer.step import local_scalar, step_if_finite
from trainer.step.loss import nll_loss, token_logprobs  # the engine's forms of the one LM loss


class EngineError(ConfigError):
    """A misuse of the engine API: the message names the call and what is allowed. Raised before
    the call changes anything (a `ConfigError`, so entry points print it as one `error:` line)."""


LossFn = Callable[[torch.Tensor, dict], Any]
"""loss_fn(logprobs or logits, batch) -> scalar loss, or (scalar loss, {metric: value})."""


@dataclass(frozen=True)
class ShardInfo:
    """Where a local shard sits in its full Hugging Face tensor (`hf_state_dict(sharded=True)`)."""

    global_shape: tuple[int, ...]
    """Shape of the full HF tensor."""
    offset: tuple[int, ...]
    """Index of the shard's first element in the full tensor, per dim (a contiguous block)."""
    placements: str
    """The parameter's DTensor placements and mesh axes, for information (e.g. `dp_shard:S(0)`)."""


class Engine:
    """A built model, optimizer and lr schedule behind forward_backward / optimizer_step calls.

    Build with `Engine.from_recipe` (or `Engine(cfg)` from a `trainer.config.Config`).
    Attributes for callers that need them: `cfg`, `family`, `args`, `model`, `optimizer`,
    `scheduler`, `device`, `mesh`, `parallel_dims`, `step` (optimizer steps taken), `compute_dtype`
    (the resolved `mixed_precision_param`, with the reason for an `auto` choice).
    """

    def __init__(self, cfg: Config):
        job = build_job(cfg, purpose="engine")  # the trainer's build; the rules refuse graph mode etc.
        self.cfg, self.device, self.dist_info, self.compute_dtype = (
            cfg,
            job.runtime.device,
            job.runtime.dist,
            job.runtime.compute,
        )
        self.family, self.args, self.parallel_dims, self.step_plan = (
            job.plan.family,
            job.plan.args,
            job.plan.parallel_dims,
            job.plan.step_plan,
        )
        self.mesh, self.model, self.optimizer, self.scheduler = job.data.mesh, job.model, job.optimizer, job.scheduler
        job.load_initial()  # `[checkpoint] initial_load_path`, as the trainer's first start
        arrival_barrier("engine-built", cfg.training.startup_timeout_s)
        self._train_state = ckpt.TrainState()
        self._accum_weight = 0.0
        # MoE: the expert loads since the last optimizer_step, for the selection-bias update.
        self._balance = ExpertBalance(self.model, rate=cfg.training.expert_bias_rate) or None
        # `training.replicate_reduce = "step"`: the dp_replicate mean, taken in optimizer_step.
        self._replicate = ReplicateReducer(self.model, dtype=torch_dtype(cfg.training.replicate_reduce_dtype)) or None
        self._load: torch.Tensor | None = None
        self._hf_layouts: dict[str, list[str]] = {}
        self._unusable: str | None = None  # why every call but load/close is refused (close, failed load)

    @classmethod
    def from_recipe(cls, path: str | None, overrides: Sequence[str | tuple[str, str]] = ()) -> "Engine":
        """Build from a TOML recipe and `section.key=value` overrides (CLI precedence, as the trainer)."""
        return cls(build_config(path, parse_overrides(overrides)))

    @property
    def step(self) -> int:
        """Optimizer steps taken (restored by `load`)."""
        return self._train_state.step

    @property
    def pending_gradients(self) -> bool:
        """True while gradients from `forward_backward` calls wait for `optimizer_step`."""
        return self._accum_weight > 0

    def _check_usable(self, call: str) -> None:
        if self._unusable is not None:
            raise EngineError(f"engine.{call}: {self._unusable}")

    # -- forward / backward ---------------------------------------------------------------------

    def _to_device(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def _check_tokens(self, call: str, tokens: Any, *, min_length: int) -> None:
        if not isinstance(tokens, torch.Tensor) or tokens.ndim != 2 or tokens.dtype != torch.int64:
            got = f"{tokens.dtype} {list(tokens.shape)}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise EngineError(
                f"engine.{call}: tokens: expected int64 [batch, length], got {got}; allowed: an int64 tensor [batch, length]"
            )
        if tokens.shape[0] < 1 or tokens.shape[1] < min_length:
            raise EngineError(
                f"engine.{call}: tokens: {list(tokens.shape)}; allowed: at least 1 sequence of at "
                f"least {min_length} tokens"
            )
        length = tokens.shape[1] - (min_length - 1)  # positions the model reads
        if length > self.args.max_seq_len:
            raise EngineError(
                f"engine.{call}: tokens: the model reads {length} positions, more than "
                f"training.seq_len = {self.args.max_seq_len} (its RoPE tables); allowed: at most {self.args.max_seq_len} positions, or raise training.seq_len"
            )
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= self.args.vocab_size:
            raise EngineError(
                f"engine.{call}: tokens: ids {low}..{high}; allowed: 0..{self.args.vocab_size - 1} "
                "(the model's vocab_size)"
            )

    @staticmethod
    def _check_positive(call: str, name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise EngineError(f"engine.{call}: {name} = {value!r}; allowed: a finite number > 0")

    def _logits(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(inputs)

    def forward_backward(
        self,
        batch: Mapping[str, Any],
        loss_fn: LossFn | None = None,
        *,
        output: str = "logprobs",
        temperature: float = 1.0,
        weight: float = 1.0,
    ) -> dict[str, float]:
        """Forward, `loss_fn`, backward; gradients add up until `optimizer_step`.

        batch: `tokens` int64 [B, T] (the model reads tokens[:, :-1] and is scored on
            tokens[:, 1:], so T = training.seq_len + 1 gives the trainer's windows), plus anything
            the loss reads (masks [B, T-1], advantages, old log-probs...), moved to the device.
        loss_fn(x, batch) -> scalar, or (scalar, {name: value}): x is the fp32 log-prob of each
            target token [B, T-1] at `temperature` (output="logprobs") or the logits [B, T-1, V]
            (output="logits"; vocab-sharded DTensor under TP with loss parallel). Default:
            `nll_loss`, the trainer's LM loss. MoE models add `aux_loss_coef` x their aux loss.
        weight: this call's share of the step: `optimizer_step` divides the summed gradients by
            the summed weights, so equal weights average the calls (the trainer's accumulation)
            and weight = tokens per call with a per-token-mean loss gives the token mean.
        Returns {"loss": mean over ranks, **metrics} (one host sync).
        Misuse (bad arguments or tokens, a loss that is not a scalar tensor) raises `EngineError`
        before anything is accumulated; an exception in backward drops this step's gradients
        (all of them: a partial backward cannot be told apart) before it propagates.
        """
        call = "forward_backward"
        self._check_usable(call)
        if output not in ("logprobs", "logits"):
            raise EngineError(f"engine.{call}: output = {output!r}; allowed: logprobs, logits")
        self._check_positive(call, "weight", weight)
        self._check_positive(call, "temperature", temperature)
        loss_fn = nll_loss if loss_fn is None else loss_fn
        if not isinstance(batch, Mapping) or "tokens" not in batch:
            keys = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
            raise EngineError(
                f"engine.{call}: the batch has no 'tokens' (int64 [B, T]); got {keys}; allowed: a mapping with 'tokens'"
            )
        self._check_tokens(call, batch["tokens"], min_length=2)
        batch = self._to_device(batch)
        tokens = batch["tokens"]
        with self.step_plan.loss_context():
            logits = self._logits(tokens[:, :-1])
            x = logits if output == "logits" else token_logprobs(logits, tokens[:, 1:], temperature=temperature)
            try:
                result = loss_fn(x, batch)
            finally:  # also when the loss function raises: no layer keeps this graph's aux loss
                aux = self.model.pop_aux_loss()
                load = self._balance.pop() if self._balance is not None else None
            loss, metrics = result if isinstance(result, tuple) else (result, {})
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
                got = (
                    f"a tensor of shape {list(loss.shape)}, requires_grad={loss.requires_grad}"
                    if isinstance(loss, torch.Tensor)
                    else type(loss).__name__
                )
                raise EngineError(
                    f"engine.{call}: loss_fn returned {got}; allowed: a scalar tensor computed "
                    "from its first argument (or (scalar, metrics))"
                )
            total = loss if aux is None else loss + self.cfg.training.aux_loss_coef * aux
            try:
                (total.reshape(()) * weight).backward()
            except BaseException as e:
                self.zero_grad()
                if hasattr(e, "add_note"):  # Python >= 3.11
                    e.add_note(
                        "engine: backward failed; the gradients accumulated since the last "
                        "optimizer_step were dropped (zero_grad)"
                    )
                raise
        self._accum_weight += weight
        if load is not None:
            self._load = load if self._load is None else self._load + load
        out = {"loss": global_mean(local_scalar(loss.detach()))}
        if aux is not None:
            out["moe_aux_loss"] = global_mean(local_scalar(aux.detach()))
        for k, v in metrics.items():
            out[k] = global_mean(local_scalar(v.detach())) if isinstance(v, torch.Tensor) else v
        return out

    def optimizer_step(self) -> dict[str, float]:
        """Average the accumulated gradients, clip to training.max_norm, AdamW step, zero_grad, lr schedule.

        Returns {"grad_norm" (global, before clipping), "lr" (of this step), "step", "skipped"}.
        A non-finite gradient norm skips the update (weights and moments unchanged) and then
        raises `NonFiniteLoss` unless training.skip_nonfinite_updates is set, as the trainer does.
        """
        from parallelisms import clip_grad_norm_

        self._check_usable("optimizer_step")
        if self._accum_weight == 0:
            raise EngineError(
                "engine.optimizer_step: no gradients: no forward_backward since the last "
                "optimizer_step, zero_grad or load; allowed: forward_backward first"
            )
        if self._replicate is not None:
            self._replicate.finish()
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self._accum_weight != 1.0:
            grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
            torch._foreach_div_(grads, self._accum_weight)
        max_norm = self.cfg.training.max_norm if self.cfg.training.max_norm > 0 else float("inf")
        grad_norm = clip_grad_norm_(params, max_norm)
        lr = self.scheduler.get_last_lr()[0]
        nonfinite = step_if_finite(self.optimizer, grad_norm)
        finite = not bool(nonfinite)
        stats = None
        if self._balance is not None and self._load is not None:  # MoE: the selection biases' step
            stats = self._balance.finish(self._load, apply=~nonfinite)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._accum_weight, self._load = 0.0, None
        self._train_state.step += 1
        if not finite and not self.cfg.training.skip_nonfinite_updates:
            raise NonFiniteLoss(
                f"non-finite gradient norm at engine step {self.step} (its update was skipped); "
                "lower optimizer.lr, or set training.skip_nonfinite_updates = true"
            )
        out = {"grad_norm": float(grad_norm), "lr": lr, "step": self.step, "skipped": not finite}
        if stats is not None:
            out["moe_max_vio"] = float(stats.max_vio)
            if stats.dropped is not None:
                out["moe_dropped"] = int(stats.dropped)
                out["moe_dropped_pct"] = float(stats.dropped_pct)
        return out

    def zero_grad(self) -> None:
        """Drop the gradients accumulated since the last `optimizer_step` (always allowed)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._accum_weight, self._load = 0.0, None

    @torch.no_grad()
    def compute_logprobs(self, tokens: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
        """fp32 log p(tokens[:, t+1] | tokens[:, :t+1]) at `temperature`, [B, T-1]; no grad."""
        self._check_usable("compute_logprobs")
        self._check_positive("compute_logprobs", "temperature", temperature)
        self._check_tokens("compute_logprobs", tokens, min_length=2)
        tokens = tokens.to(self.device)
        with self.step_plan.loss_context():
            logprobs = token_logprobs(self._logits(tokens[:, :-1]), tokens[:, 1:], temperature=temperature)
        self.model.pop_aux_loss()
        return local_scalar(logprobs)

    @torch.no_grad()
    def next_token_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the token after each sequence, [B, V] (for a sampling loop); no grad."""
        self._check_usable("next_token_logits")
        self._check_tokens("next_token_logits", tokens, min_length=1)
        logits = self._logits(tokens.to(self.device))
        self.model.pop_aux_loss()
        if isinstance(logits, DTensor):  # vocab-sharded under loss parallel
            logits = logits.full_tensor()
        return logits[:, -1].float()

    # -- state ------------------------------------------------------------------------------------

    def _states(self) -> dict[str, Any]:
        return ckpt.run_states(
            model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, train_state=self._train_state
        )

    def state_dict(self) -> dict[str, Any]:
        """{"model", "optimizer", "lr_scheduler", "train_state"}: this rank's (DTensor-sharded)
        states, keyed as in the trainer's checkpoints; for `torch.distributed.checkpoint`."""
        self._check_usable("state_dict")
        return {name: state.state_dict() for name, state in self._states().items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned (the keys present); the config's lr and betas win.
        Pending gradients are dropped first, as by `load`."""
        if self._unusable is not None and self._unusable.startswith("closed"):
            self._check_usable("load_state_dict")
        states = self._states()
        if not isinstance(state_dict, Mapping) or not set(state_dict) & set(states):
            got = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__
            raise EngineError(
                f"engine.load_state_dict: got {got}; allowed: a mapping with some of {sorted(states)} "
                "(what state_dict() returns)"
            )
        self.zero_grad()
        self._loading(
            lambda: [state.load_state_dict(state_dict[name]) for name, state in states.items() if name in state_dict],
            what="load_state_dict",
        )

    def _loading(self, load: Callable[[], Any], *, what: str) -> Any:
        """Run a load; if it fails the weights may be partly overwritten, so every call but another
        load (or close) is refused until one succeeds."""
        # The schedule's `resume_notes` (what a load changed) would otherwise become part of its
        # state dict, so a second load would find it missing from the checkpoint and refuse.
        self.scheduler.__dict__.pop("resume_notes", None)
        try:
            result = load()
        except BaseException as e:
            self._unusable = (
                f"the last {what} failed ({type(e).__name__}: {e}); the weights may be partly "
                "overwritten; allowed: load a checkpoint again, or close()"
            )
            raise
        self.scheduler.__dict__.pop("resume_notes", None)
        self._unusable = None
        return result

    def _manager(self, folder: str | Path, load_step: int = -1):
        return ckpt.CheckpointManager(
            folder=folder, interval=1, keep_latest_k=0, async_mode="disabled", enable=True, load_step=load_step
        )

    def save(self, folder: str | Path) -> Path:
        """Write `folder/step-N` (N = `step`) through DCP, atomically, with a manifest; every rank calls it.
        Pending gradients are not written (a checkpoint is a step boundary) and are kept."""
        self._check_usable("save")
        manager = self._manager(folder)
        manager.save(self.step, self._states())
        manager.close()
        return manager.step_path(self.step)

    def load(self, folder: str | Path, step: int = -1) -> int:
        """Load the newest `folder/step-N` (or `step`), saved by `save` or by the trainer
        (its data-loader state is not read); on any mesh. Returns N; ConfigError if none.
        Gradients accumulated before the load are dropped (they belong to other weights)."""
        if self._unusable is not None and self._unusable.startswith("closed"):
            self._check_usable("load")
        manager = self._manager(folder, load_step=step)
        try:
            if not manager.complete_steps():
                raise ConfigError(
                    f"engine.load: {folder} holds no checkpoint (step-N folders); allowed: a "
                    "folder written by Engine.save, or the trainer's checkpoint folder"
                )
            # Gradients accumulated before the load belong to other weights: dropped first (with
            # them present, DCP's optimizer state dict would not set up the moments to load into).
            self.zero_grad()
            loaded = self._loading(lambda: manager.load(self._states()), what=f"load from {folder}")
        finally:
            manager.close()
        return loaded

    # -- weights by Hugging Face name -------------------------------------------------------------

    def _hf_names(self, name: str, tensor: torch.Tensor) -> list[str]:
        """HF names of our parameter `name`: one (a rename), several (stacked experts, split on
        dim 0, in order), or none (a tied output weight). From the family's adapter, on meta."""
        if name not in self._hf_layouts:
            probe = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
            out = self.family.hf_adapter.to_hf({name: probe}, self.args)
            names = list(out)
            if len(names) == 1:
                assert tuple(out[names[0]].shape) == tuple(tensor.shape), (name, out)
            else:
                assert len(names) in (0, tensor.shape[0]), (name, names)
                assert all(tuple(v.shape) == tuple(tensor.shape[1:]) for v in out.values()), name
            self._hf_layouts[name] = names
        return self._hf_layouts[name]

    def _named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        # DSD's names are the checkpoint FQNs (no wrapper prefixes); values are the stored
        # (sharded) parameters themselves, nothing is gathered or copied here.
        yield from get_model_state_dict(self.model).items()

    def hf_state_dict(self, *, sharded: bool = False, dtype: torch.dtype | None = None) -> Iterator[tuple]:
        """Generator over the weights by Hugging Face name, for weight sync to an inference engine.

        sharded=False: (hf_name, full tensor) on every rank. Each parameter is all-gathered
            when the generator reaches it, so peak extra memory is one full parameter (plus its
            per-expert copies for stacked MoE experts); every rank must run the generator to the end
            in step (each item is a collective).
        sharded=True: (hf_name, local shard, ShardInfo) with only what this rank owns: no
            communication; a tensor replicated over some mesh axes is yielded by the rank at index
            0 of those axes, so the shards of all ranks tile every full tensor exactly once.
        dtype: cast each yielded tensor (e.g. torch.bfloat16 for an inference engine).
        Names and values are what `family.hf_adapter.to_hf` gives for the full state dict.
        """
        self._check_usable("hf_state_dict")
        if self.family.hf_adapter is None:
            from models import FAMILIES  # the families that have one, from the registry

            with_adapter = ", ".join(
                name for name, f in FAMILIES.items() if f.hf_adapter is not None and getattr(f, "task", "lm") == "lm"
            )
            raise ConfigError(
                f"model.name: {self.family.name} has no hf_adapter.py, so it has no Hugging Face "
                f"names; allowed: a family with hf_adapter ({with_adapter})"
            )
        for name, param in self._named_tensors():
            hf_names = self._hf_names(name, param)
            if not hf_names:
                continue
            if sharded:
                yield from self._owned_shards(param, hf_names, dtype)
                continue
            full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
            full = full if dtype is None else full.to(dtype)
            for hf_name, value in self.family.hf_adapter.to_hf({name: full}, self.args).items():
                yield hf_name, value
            del full

    def _owned_shards(self, param: torch.Tensor, hf_names: list[str], dtype) -> Iterator[tuple]:
        global_shape = tuple(param.shape)
        if isinstance(param, DTensor):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            mesh, placements = param.device_mesh, param.placements
            coord = mesh.get_coordinate()
            if any(isinstance(pl, Replicate) and coord[i] != 0 for i, pl in enumerate(placements)):
                return  # another rank yields this replica
            local = param.to_local().detach()
            _, offset = compute_local_shape_and_global_offset(global_shape, mesh, placements)
            names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
            where = ",".join(f"{n}:{pl}" for n, pl in zip(names, placements))
        else:
            local, offset, where = param.detach(), (0,) * param.ndim, "local"
        if local.numel() == 0:
            return  # an uneven split left this rank nothing
        local = local if dtype is None else local.to(dtype)
        offset = tuple(int(o) for o in offset)
        if len(hf_names) == 1:
            yield hf_names[0], local, ShardInfo(global_shape, offset, where)
            return
        # Stacked experts: global row e of dim 0 is HF tensor hf_names[e].
        for k in range(local.shape[0]):
            yield (hf_names[offset[0] + k], local[k], ShardInfo(global_shape[1:], offset[1:], where))

    def close(self) -> None:
        """Destroy the process group this engine started (also the world-of-one group); every
        later call raises `EngineError` (closing twice is allowed)."""
        self._unusable = "closed: this engine was closed; allowed: build a new Engine"
        shutdown_distributed()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Engine", "EngineError", "ShardInfo", "nll_loss", "token_logprobs"]
