"""Step time of DeepSeek-V3's debug flavor at several multi-token-prediction depths, alternated in
one process (docs/models.md, "Multi-token prediction", "Measured").

Each round runs one training step (forward, `MTPLoss` or the plain LM loss, backward, AdamW) of
every depth in turn on the same batch shape, so a shared machine's load falls on every depth alike;
prints each depth's median step time over the rounds and its ratio to depth 0.

    OMP_NUM_THREADS=1 python scripts/bench/mtp_depth_cost.py --depths 0 1 2 --rounds 10
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from models import FAMILIES
from trainer.runtime import cli
from trainer.step.loss import MTPLoss, lm_loss_fn


def main() -> None:
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    a = parser.parse_args()
    family = FAMILIES["deepseek_v3"]
    dtype = getattr(torch, a.dtype)
    runs = {}
    for depth in a.depths:
        torch.manual_seed(0)
        args = family.get_args("debugmodel", mtp_depth=depth, max_seq_len=a.seq_len)
        model = family.model_cls(args)
        model.init_weights()
        model.to(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        loss_fn = MTPLoss(fused=False, depth=depth, weight=0.3) if depth else lm_loss_fn(fused=False)
        runs[depth] = (model, opt, loss_fn)
        n = sum(p.numel() for p in model.parameters())
        print(f"depth {depth}: {n / 1e6:.2f}M parameters", flush=True)
    g = torch.Generator().manual_seed(0)
    times: dict[int, list[float]] = {d: [] for d in a.depths}
    for r in range(a.rounds + 1):  # round 0 warms up
        tokens = torch.randint(0, 4096, (a.batch, a.seq_len + 1), generator=g)
        for depth, (model, opt, loss_fn) in runs.items():
            start = time.perf_counter()
            loss = loss_fn(model, tokens[:, :-1], tokens[:, 1:])
            aux = model.pop_aux_loss()
            (loss + 1e-4 * aux if aux is not None else loss).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if r:
                times[depth].append(time.perf_counter() - start)
    base = statistics.median(times[a.depths[0]])
    for depth in a.depths:
        med = statistics.median(times[depth])
        print(
            f"depth {depth}: median step {med:.3f} s over {a.rounds} rounds, x{med / base:.3f} of depth {a.depths[0]}"
        )


if __name__ == "__main__":
    sys.exit(cli.run(main))
