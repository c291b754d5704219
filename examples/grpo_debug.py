"""GRPO on the debug Llama 3 with a toy reward, on the CPU, through `trainer.engine.Engine`.

    OMP_NUM_THREADS=1 python examples/grpo_debug.py [--updates 16] [--kl-coef 0.02] [--section.key=value ...]
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 examples/grpo_debug.py   # FSDP over 2 ranks

Each update: take `--prompts` random prompts, sample a group of `--group` completions per prompt
with a plain sampling loop over the engine's no-grad forwards (no KV cache, no inference
engine), score each completion with the toy reward (the fraction of its tokens that are the
target token), normalize the rewards within each group (GRPO's advantage), and take
`--ppo-epochs` optimizer steps on the clipped policy-ratio loss, optionally with a KL penalty
to a frozen reference (a second engine built from the same recipe and seed: the initial policy).
A table of the mean reward per update is printed; docs/engine.md records a run.

The defaults shrink the debug model (2 layers, a 64-token vocabulary: the reward needs no
tokenizer) and train in fp32 with a constant lr; extra `--section.key=value` arguments override
the recipe as in the trainer.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer.engine import Engine  # noqa: E402
from trainer.runtime import cli, global_mean  # noqa: E402

RECIPE = "configs/llama3_debug.toml"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = cli.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default=RECIPE)
    p.add_argument("--updates", type=int, default=16, help="GRPO updates (sample, score, optimize)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per update")
    p.add_argument("--group", type=int, default=8, help="completions sampled per prompt (G)")
    p.add_argument("--prompt-len", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=8, help="completion length")
    p.add_argument("--vocab", type=int, default=64, help="model.vocab_size of the shrunk debug model")
    p.add_argument("--target", type=int, default=7, help="the token the reward counts")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--ppo-epochs", type=int, default=2, help="optimizer steps per batch of samples")
    p.add_argument("--clip-eps", type=float, default=0.2, help="policy-ratio clip range")
    p.add_argument("--kl-coef", type=float, default=0.0, help="weight of the k3 KL to the frozen reference")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and sampling")
    return p.parse_known_args(argv)


def overrides(args: argparse.Namespace, extra: list[str]) -> list[str]:
    return [
        "model.n_layers=2",
        f"model.vocab_size={args.vocab}",
        "model.attn_backend=sdpa",
        f"training.seq_len={args.prompt_len + args.new_tokens}",
        "training.mixed_precision_param=float32",
        f"training.steps={args.updates * args.ppo_epochs}",
        f"optimizer.lr={args.lr}",
        "optimizer.weight_decay=0.0",
        "lr_scheduler.warmup_steps=0",
        "lr_scheduler.decay_type=constant",
        *extra,
    ]


def sample(
    engine: Engine, prompts: torch.Tensor, *, new_tokens: int, temperature: float, generator: torch.Generator
) -> torch.Tensor:
    """Append `new_tokens` sampled tokens to each prompt: one full forward per token."""
    tokens = prompts
    for _ in range(new_tokens):
        probs = torch.softmax(engine.next_token_logits(tokens).cpu() / temperature, dim=-1)
        tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=generator)], dim=1)
    return tokens


def reward(completions: torch.Tensor, target: int) -> torch.Tensor:
    """The toy reward: fraction of completion tokens equal to `target`, in [0, 1]."""
    return (completions == target).float().mean(dim=1)


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """GRPO: each reward minus its group's mean, over the group's std (+1e-4: all-equal groups give 0)."""
    r = rewards.view(-1, group)
    return ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-4)).flatten()


def grpo_loss(clip_eps: float, kl_coef: float):
    """loss_fn(logprobs, batch) for Engine.forward_backward: clipped surrogate (+ k3 KL), token mean."""

    def loss_fn(logprobs: torch.Tensor, batch: dict):
        mask = batch["mask"]
        n = mask.sum()
        ratio = torch.exp(logprobs - batch["old_logprobs"])
        adv = batch["advantages"][:, None]
        surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
        loss = -(surrogate * mask).sum() / n
        metrics = {"clip_frac": (((ratio - 1).abs() > clip_eps).float() * mask).sum() / n}
        if kl_coef > 0:
            delta = batch["ref_logprobs"] - logprobs
            kl = ((torch.exp(delta) - delta - 1) * mask).sum() / n
            loss = loss + kl_coef * kl
            metrics["kl"] = kl
        return loss, metrics

    return loss_fn


def run(argv: list[str]) -> list[dict]:
    args, extra = parse_args(argv)
    engine = Engine.from_recipe(args.recipe, overrides(args, extra))
    reference = Engine.from_recipe(args.recipe, overrides(args, extra)) if args.kl_coef > 0 else None
    # Under torchrun each data-parallel rank samples its own prompts (TP ranks of one dp rank
    # share a seed, so they sample the same tokens); groups never span ranks.
    dp_rank = engine.parallel_dims.dp_rank(engine.mesh)
    generator = torch.Generator().manual_seed(args.seed + 1000 * dp_rank)
    loss_fn = grpo_loss(args.clip_eps, args.kl_coef)
    rows = []
    say = print if engine.dist_info.rank == 0 else (lambda *a, **k: None)
    say(f"{'update':>6} {'reward':>8} {'loss':>9} {'kl':>8} {'clip':>6} {'grad_norm':>9} {'s':>5}")
    for update in range(1, args.updates + 1):
        t0 = time.perf_counter()
        prompts = torch.randint(0, args.vocab, (args.prompts, args.prompt_len), generator=generator)
        prompts = prompts.repeat_interleave(args.group, dim=0)
        tokens = sample(engine, prompts, new_tokens=args.new_tokens, temperature=args.temperature, generator=generator)
        rewards = reward(tokens[:, args.prompt_len :], args.target)
        mask = torch.zeros(tokens.shape[0], tokens.shape[1] - 1)
        mask[:, args.prompt_len - 1 :] = 1.0  # log-prob t scores token t + 1: the completion only
        batch = {
            "tokens": tokens,
            "mask": mask,
            "advantages": group_advantages(rewards, args.group),
            "old_logprobs": engine.compute_logprobs(tokens, temperature=args.temperature),
        }
        if reference is not None:
            batch["ref_logprobs"] = reference.compute_logprobs(tokens, temperature=args.temperature)
        for _ in range(args.ppo_epochs):
            out = engine.forward_backward(batch, loss_fn, temperature=args.temperature)
            step = engine.optimizer_step()
        row = {
            "update": update,
            "reward": global_mean(rewards.mean()),
            "loss": out["loss"],
            "kl": out.get("kl", 0.0),
            "clip_frac": out["clip_frac"],
            "grad_norm": step["grad_norm"],
            "s": time.perf_counter() - t0,
        }
        rows.append(row)
        say(
            f"{update:>6} {row['reward']:>8.3f} {row['loss']:>9.4f} {row['kl']:>8.4f} {row['clip_frac']:>6.3f} "
            f"{row['grad_norm']:>9.3f} {row['s']:>5.2f}",
            flush=True,
        )
    engine.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    run(sys.argv[1:] if argv is None else argv)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
