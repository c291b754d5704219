"""Token copies a capacity factor drops under the benchmark routings, at a pod recipe's shape.

The trainer's own draw (`[moe] routing = random`: models/common/moe.py `random_experts` keyed by
`routing_key(seed, step, layer)`, or `balanced`) over `--batch` sequences of `--seq` tokens for
`--layers` layers, each copy kept or dropped by `capacity_slots` (the rule the layer runs), per
capacity factor: the share of copies dropped. What a lower factor costs in work against the
dropless dispatch MaxText's published MoE runs use (docs/moe.md, "Dispatch chunks").

    python scripts/bench/capacity_drops.py                       # Qwen3-235B and DeepSeek-V3 shapes
    python scripts/bench/capacity_drops.py --csv out.csv
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tools.benchmark import write_csv
from trainer.runtime import cli

SHAPES = {"qwen3-235b-a22b": (128, 8), "deepseek-v3": (256, 8)}
"""Experts and top-k of each model."""
FACTORS = (1.0, 1.05, 1.1, 1.125, 1.15, 1.2, 1.25)


def dropped_share(
    *, experts: int, top_k: int, factor: float, batch: int, seq: int, layers: int, routing: str, seed: int = 42
) -> float:
    """The share of the routed copies `capacity_slots` drops at `factor` (fraction, not %)."""
    from models.common.moe import balanced_experts, capacity_slots, expert_capacity, random_experts, routing_key

    capacity = expert_capacity(seq_len=seq, top_k=top_k, num_experts=experts, factor=factor)
    dump = experts * batch * capacity
    dropped = total = 0
    for layer in range(layers):
        tokens = torch.arange(batch * seq)
        if routing == "random":
            key = torch.tensor(routing_key(seed=seed, step=1, layer=layer))
            chosen = random_experts(key, tokens, experts, top_k)
        else:
            chosen = balanced_experts(tokens, experts, top_k)
        slots = capacity_slots(chosen.view(batch, seq, top_k), experts, capacity)
        dropped += int((slots == dump).sum())
        total += slots.numel()
    return dropped / total


def expected_share(*, experts: int, top_k: int, factor: float, seq: int) -> float:
    """The share a uniform draw drops in expectation: an expert's copies of one sequence are
    Binomial(seq, top_k / experts) (each token picks top_k distinct experts, independently of the
    other tokens), the copies past the capacity c dropped: E[(X - c)+] / E[X]."""
    import math

    from models.common.moe import expert_capacity

    c = expert_capacity(seq_len=seq, top_k=top_k, num_experts=experts, factor=factor)
    q = top_k / experts
    logp = lambda x: (  # noqa: E731
        math.lgamma(seq + 1)
        - math.lgamma(x + 1)
        - math.lgamma(seq - x + 1)
        + x * math.log(q)
        + (seq - x) * math.log1p(-q)
    )
    return sum((x - c) * math.exp(logp(x)) for x in range(c + 1, seq + 1)) / (seq * q)


def main(argv: list[str] | None = None) -> int:
    p = cli.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8, help="sequences (the recipes' micro-batch)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--layers", type=int, default=6, help="layers drawn (each its own key)")
    p.add_argument("--routing", choices=("random", "balanced"), default="random")
    p.add_argument("--csv", help="write the table here")
    ns = p.parse_args(argv)
    rows = []
    for model, (experts, top_k) in SHAPES.items():
        for factor in FACTORS:
            share = dropped_share(
                experts=experts,
                top_k=top_k,
                factor=factor,
                batch=ns.batch,
                seq=ns.seq,
                layers=ns.layers,
                routing=ns.routing,
            )
            expect = expected_share(experts=experts, top_k=top_k, factor=factor, seq=ns.seq)
            rows.append(
                {
                    "model": model,
                    "routing": ns.routing,
                    "factor": factor,
                    "dropped_pct": round(100 * share, 4),
                    "binomial_pct": round(100 * expect, 4) if ns.routing == "random" else "",
                }
            )
    print(
        f"| model | routing | capacity factor | dropped % ({ns.batch} x {ns.seq} tokens, {ns.layers} layers) "
        "| uniform draw, expected % |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['routing']} | {r['factor']} | {r['dropped_pct']:.4f} | {r['binomial_pct']} |")
    if ns.csv:
        write_csv(Path(ns.csv), rows)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
