"""Step time of DeepSeek-V4's debug flavor with and without the lightning indexer's KL loss,
alternated in one process (docs/models.md, "DeepSeek-V4", "Indexer loss").

Each round runs one training step (forward, the LM loss or `IndexerLoss`, backward, AdamW) of both
models in turn on the same batch, so a shared machine's load falls on both alike; prints each
one's median step time over the rounds and the ratio.

    OMP_NUM_THREADS=1 python scripts/bench/indexer_loss_cost.py --rounds 10
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import torch

from models.deepseek_v4 import FLAVORS, DeepSeekV4
from trainer.runtime import cli
from trainer.step.loss import lm_loss_fn
from trainer.tasks.lm import IndexerLoss


def main() -> None:
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    a = parser.parse_args()
    runs = {}
    for weight in (0.0, 1.0):
        torch.manual_seed(0)
        args = dataclasses.replace(FLAVORS["debugmodel"], max_seq_len=a.seq_len, indexer_loss_weight=weight)
        model = DeepSeekV4(args)
        model.init_weights()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        loss_fn = lm_loss_fn(fused=False)
        if weight:
            loss_fn = IndexerLoss(loss_fn, weight=weight, blocks=args.layer_kinds().count("c"))
        runs[weight] = (model, opt, loss_fn)
    g = torch.Generator().manual_seed(0)
    times: dict[float, list[float]] = {w: [] for w in runs}
    for r in range(a.rounds + 1):  # round 0 warms up
        tokens = torch.randint(0, 4096, (a.batch, a.seq_len + 1), generator=g)
        for weight, (model, opt, loss_fn) in runs.items():
            start = time.perf_counter()
            loss = loss_fn(model, tokens[:, :-1], tokens[:, 1:])
            (loss + 1e-3 * model.pop_aux_loss()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if r:
                times[weight].append(time.perf_counter() - start)
    base = statistics.median(times[0.0])
    for weight in runs:
        med = statistics.median(times[weight])
        print(f"indexer_loss_weight {weight}: median step {med:.3f} s over {a.rounds} rounds, x{med / base:.3f}")


if __name__ == "__main__":
    sys.exit(cli.run(main))
