#!/usr/bin/env python
"""Step time of the FLUX debugmodel train step: eager vs graph (unrolled) vs graph + layer scan.

    OMP_NUM_THREADS=1 python scripts/bench/bench_flux_graph.py [--backend aot_eager|inductor] [--repeats 10]

One process, fp32, the trainer's pieces: meta build -> SimpleFSDP (one process) -> init,
AdamW, `trainer.tasks.flow.flow_loss`; batch 8 of the debug data's shapes (16 x 8 x 8 latents =
16 image tokens, 16 text tokens of width 64). Prints the CPU model, compile time, graph node
count and the median (and min/max) of `--repeats` timed steps after 2 warm-up steps.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time

import torch

from trainer.runtime import cli
from trainer.runtime.device import cpu_model


def build(seed: int = 0):
    from models.flux import FLAVORS, FluxTransformer
    from parallelisms.simple_fsdp import data_parallel
    from trainer.optim import build_optimizer

    with torch.device("meta"):
        model = FluxTransformer(FLAVORS["debugmodel"])
    data_parallel(model, mesh=None, param_dtype=torch.float32, reduce_dtype=torch.float32)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights()
    return model, build_optimizer(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


def batch(batch_size: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(batch_size, 16, 8, 8, generator=g)
    return (
        x0,
        torch.randn(batch_size, 16, 64, generator=g),
        torch.randn(batch_size, 64, generator=g),
        torch.randn(batch_size, 16, 8, 8, generator=g),
        torch.rand(batch_size, generator=g),
        torch.ones(batch_size),
    )


def main() -> int:
    p = cli.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="aot_eager", choices=["aot_eager", "inductor"])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--modes", default="eager,graph,graph_scan")
    ns = p.parse_args()
    from models.flux.plan import PLAN
    from trainer.graph import build_graph_step
    from trainer.tasks.flow import flow_loss

    loss_fn = functools.partial(flow_loss, guidance=None)
    mb = batch()
    print(
        f"CPU: {cpu_model()}; torch {torch.__version__}; threads {torch.get_num_threads()}; "
        f"backend {ns.backend}; FLUX debugmodel, batch 8, 16 image + 16 text tokens, fp32"
    )
    for mode in ns.modes.split(","):
        model, opt = build()
        compile_s, nodes = None, None
        if mode == "eager":

            def step():
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model, *mb)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                return loss
        else:
            graph = build_graph_step(
                model=model,
                optimizer=opt,
                max_norm=1.0,
                backend=ns.backend,
                scan_layers=mode == "graph_scan",
                plan=PLAN,
                loss_fn=loss_fn,
            )

            def step():
                return graph([mb], 1e-4).loss

        times = []
        for i in range(2 + ns.repeats):
            start = time.perf_counter()
            float(step())
            elapsed = time.perf_counter() - start
            if i == 0 and mode != "eager":
                compile_s, nodes = graph.compile_s, graph.graph_nodes
            if i >= 2:
                times.append(elapsed)
        extra = f", compile {compile_s:.1f} s, {nodes} graph nodes" if compile_s is not None else ""
        print(
            f"{mode:<11} median {1e3 * statistics.median(times):8.1f} ms/step (min {1e3 * min(times):.1f}, "
            f"max {1e3 * max(times):.1f}, {ns.repeats} steps){extra}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
