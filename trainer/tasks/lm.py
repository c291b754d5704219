"""The LM task: next-token prediction on packed token windows (trainer/data/text.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from models.common.rope import document_positions
from models.errors import ConfigError
from parallelisms.context_parallel import CPGroup, shard_sequence
from trainer.data import build_dataloader, build_tokenizer
from trainer.runtime.device import gather_objects
from trainer.runtime.flops import model_flops_per_token
from trainer.step.loss import MTPLoss, lm_loss_fn


@dataclass(frozen=True)
class LMSettings:
    """What the LM task reads of a run's config and step plan (`LMSettings.of(cfg, step_plan)`)."""

    seq_len: int
    """`[training] seq_len`: the window length."""
    tokenizer: str
    """`[model] tokenizer`."""
    dataset: str
    """`[training] dataset` (the train split's)."""
    validation_dataset: str
    """`[validation] dataset`."""
    seed: int
    text_field: str
    """`[training] dataset_text_field`."""
    num_shards: int
    """`[training] dataset_shards`."""
    document_mask: bool
    """`[training] document_mask`: the loader returns each token's document id."""
    restart_positions: bool = False
    """Micro-batches carry per-document RoPE positions (the step plan decodes `document_mask` /
    `document_positions`; without a plan: global positions)."""

    @classmethod
    def of(cls, cfg, step_plan=None) -> LMSettings:
        t = cfg.training
        return cls(
            seq_len=t.seq_len,
            tokenizer=cfg.model.tokenizer,
            dataset=t.dataset,
            validation_dataset=cfg.validation.dataset,
            seed=t.seed,
            text_field=t.dataset_text_field,
            num_shards=t.dataset_shards,
            document_mask=t.document_mask,
            restart_positions=bool(step_plan is not None and step_plan.restart_positions),
        )


class LMTask:
    """Next-token prediction on packed token windows (trainer/data/text.py)."""

    name = "lm"
    unit = "tokens"
    cp: CPGroup | None = None
    """The cp group when the windows are split over context-parallel ranks (given at construction):
    `prepare` returns this rank's load-balanced shard of every window and `loss_fn` divides the
    loss by the global token count (parallelisms/context_parallel.py)."""

    @staticmethod
    def seq_len_to_divide(training) -> int:
        """The sequence length the parallel degrees must divide: the LM's windows."""
        return training.seq_len

    def __init__(self, settings: LMSettings, *, args, cp: CPGroup | None = None):
        self.settings = settings
        self.args = args
        self.cp = cp if cp is not None and cp.size > 1 else None
        self.units_per_sample = settings.seq_len
        self.tokenizer = build_tokenizer(settings.tokenizer)
        if self.tokenizer.n_vocab > args.vocab_size:
            raise ConfigError(
                f"model.tokenizer: {settings.tokenizer} has {self.tokenizer.n_vocab} tokens but the model's "
                f"vocab_size is {args.vocab_size}; allowed: model.vocab_size >= {self.tokenizer.n_vocab}"
            )

    def build_loader(self, *, split: str, local_batch_size: int, dp_rank: int, dp_degree: int):
        s = self.settings
        return build_dataloader(
            dataset=s.dataset if split == "train" else s.validation_dataset,
            tokenizer=self.tokenizer,
            seq_len=s.seq_len,
            local_batch_size=local_batch_size,
            dp_rank=dp_rank,
            dp_degree=dp_degree,
            seed=s.seed,
            split=split,
            text_field=s.text_field,
            num_shards=s.num_shards,
            gather=gather_objects() if split == "train" else None,
            document_ids=s.document_mask,
        )

    def prepare(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """(inputs, labels), or with `[training] document_mask` (inputs, labels, segment_ids) and,
        with `document_positions = "restart"`, the per-document RoPE positions after them.

        With context parallelism every tensor is this cp rank's shard (`shard_sequence`: chunks
        r and 2 cp - 1 - r of the window) and the RoPE positions always come last: the
        shard's global positions, or the restart-per-document positions of the whole window,
        sharded the same way (a document cut by a shard boundary keeps counting)."""
        batch = tuple(batch)
        restart = self.settings.restart_positions
        if restart:
            batch = (*batch, document_positions(batch[2]))
        if self.cp is None:
            return batch
        rank, size = self.cp.rank, self.cp.size
        if not restart:  # global positions: position i of the window is i
            window = batch[0]
            batch = (*batch, torch.arange(window.shape[1], dtype=torch.int32, device=window.device).expand_as(window))
        return tuple(shard_sequence(x, 1, rank, size) for x in batch)

    def loss_fn(self, step_plan) -> Callable:
        """The LM loss of the step plan (plain or fused), scaled over the cp group with context
        parallelism (trainer/step/loss.py); for a model with multi-token prediction (`mtp_depth` > 0,
        which the step plan's rules keep from context parallelism) `MTPLoss`; for DeepSeek-V4 whose
        indexers train (`indexer_loss_weight` > 0) the LM loss in an `IndexerLoss`."""
        depth = getattr(self.args, "mtp_depth", 0)
        if depth > 0:
            assert self.cp is None, "the step plan's rules refuse model.mtp_depth > 0 with context parallelism"
            return MTPLoss(fused=step_plan.fused_loss, depth=depth, weight=self.args.mtp_loss_weight)
        loss = lm_loss_fn(fused=step_plan.fused_loss, document_mask=step_plan.document_mask, cp=self.cp)
        if getattr(self.args, "trains_indexer", False):  # DeepSeek-V4 with indexer_loss_weight > 0
            return IndexerLoss(loss, weight=self.args.indexer_loss_weight, blocks=self.args.layer_kinds().count("c"))
        return loss

    def example_batch(self, local_batch_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """A micro-batch of the shapes and dtypes `prepare` returns (the recipe check captures with it)."""
        ids = torch.zeros(local_batch_size, self.settings.seq_len, dtype=torch.long, device=device)
        if not self.settings.document_mask:
            return self.prepare((ids, ids.clone()))
        return self.prepare((ids, ids.clone(), torch.zeros_like(ids, dtype=torch.int32)))

    def sample_grid(self, model) -> None:
        return None

    def flops_per_unit(self) -> dict[str, float]:
        """Training FLOPs per token of the model (trainer/runtime/flops.py `model_flops_per_token`:
        MTP depths and families whose blocks differ included)."""
        return model_flops_per_token(self.args, self.settings.seq_len)


class IndexerLoss:
    """DeepSeek-V4 with `[model] indexer_loss_weight` > 0 (models/deepseek_v4/model.py `indexer_kl`):
    `inner`, the LM loss, plus the lightning indexers' KL loss of the same forward
    (`model.pop_indexer_loss()`, the mean over the `blocks` CSA blocks). The returned value is the LM
    loss (what `loss` and `val_loss` log) and its gradient the total's, LM + weight x blocks x KL
    (each block's indexer gets weight x its own KL's gradient; their inputs are detached, so nothing
    else gets any): `lm + (T - T.detach())`, as `MTPLoss` adds its term. `with_depths` returns
    (that, [KL] detached) inside the graph step and `pop_mtp_losses` the eager step's; the steps log
    it as `term_names` (`indexer_loss` in metrics.jsonl). Without autograd (validation) the KL is
    popped and dropped."""

    term_names = ("indexer_loss",)

    def __init__(self, inner: Callable, *, weight: float, blocks: int):
        self.inner, self.weight, self.blocks = inner, float(weight), blocks
        self._last: torch.Tensor | None = None

    def __call__(self, model, *microbatch: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            loss = self.inner(model, *microbatch)
            model.pop_indexer_loss()
            return loss
        loss, self._last = self.with_depths(model, *microbatch)
        return loss

    def with_depths(self, model, *microbatch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss `__call__` returns, [KL] detached float32) without keeping state."""
        lm = self.inner(model, *microbatch)
        kl = model.pop_indexer_loss()
        term = kl * (self.weight * self.blocks)
        return lm + (term - term.detach()), kl.detach().reshape(1)

    def pop_mtp_losses(self) -> torch.Tensor | None:
        """[KL] of the last call with autograd (detached float32), then None until the next."""
        last, self._last = self._last, None
        return last
