#!/usr/bin/env python
"""The cost of AOTAutograd's donated buffers off: peak CPU memory of a compiled step, on vs off.

Compile mode with a zero-bubble pipeline schedule (trainer/step/pipeline.py `split_backward_config`)
compiles its blocks with `torch._functorch.config.donated_buffer = False`, because those schedules
run a block's backward twice (input gradient, then weight gradient) and a backward compiled with
donated buffers (saved activations the backward may overwrite) runs once. This measures what that
costs where nothing else differs: one process, the debug Llama 3 with its blocks compiled the way
compile mode compiles them (`build_model` with the compile-mode step plan: Inductor per block,
fullgraph), fp32, one forward + loss + backward, with donated buffers on and off, each in a fresh
subprocess (Dynamo's caches do not key on the setting).

Per variant: the donated buffers the compiled block backward got (AOTAutograd's
`collect_bw_donated_buffer_idxs`, per compiled graph), and over one step after `--warmup` steps
(the first compiles) the peak of the bytes allocated since the step began (the profiler's
allocation events, `total_allocated`: torch's CPU allocations, the parameters and their gradients
excluded as they exist before the step; the gradients are zeroed to None first, so the step
allocates them), and the median step time of `--repeats` more steps.

With `--blocks-only` also the zero-bubble schedules' split backward of the block stack
(torch.distributed.pipelining's `stage_backward_input`, then `stage_backward_weight`), timed
interleaved with the plain step: with donated buffers off (what compile mode then runs) and with
eager blocks (a third variant, `eager`), whose split costs what the plain backward does. A compiled
block's backward is one node that computes the input and the weight gradients together, so the
weight pass runs it again: the split step's time over the plain one says what that costs.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench/donated_buffer_memory.py --out out.csv
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from trainer.runtime import cli

REPO = Path(__file__).resolve().parents[2]


def _child(
    donated: bool, layers: int, seq: int, batch: int, warmup: int, repeats: int, blocks_only: bool, compiled: bool
) -> dict:
    import torch
    from torch._C._profiler import _EventType
    from torch._functorch import config as functorch_config
    from torch._functorch._aot_autograd import graph_compile
    from torch.profiler import ProfilerActivity, profile

    from models import FAMILIES
    from parallelisms import ParallelDims
    from trainer.job import build_model
    from trainer.step import StepRequest, plan_step
    from trainer.step.loss import lm_loss

    functorch_config.donated_buffer = donated
    donated_counts: list[int] = []
    collect = graph_compile.collect_bw_donated_buffer_idxs

    def counting(*args, **kwargs):
        idxs = collect(*args, **kwargs)
        donated_counts.append(len(idxs))
        return idxs

    graph_compile.collect_bw_donated_buffer_idxs = counting

    family = FAMILIES["llama3"]
    args = dataclasses.replace(family.flavors["debugmodel"], n_layers=layers, max_seq_len=seq)
    plan = plan_step(StepRequest(mode="compile" if compiled else "eager", n_layers=layers))
    assert plan.block_compile == ("inductor" if compiled else None), plan.block_compile
    torch.manual_seed(0)
    model = build_model(
        family,
        args,
        step_plan=plan,
        parallel_dims=ParallelDims(world_size=1),
        mesh=None,
        device=torch.device("cpu"),
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
    )
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    from models.common.rope import rope_rows

    cos, sin = rope_rows(model.rope_cos, model.rope_sin, seq)
    hidden = torch.randn(batch, seq, args.dim, generator=g)

    def step():
        model.zero_grad(set_to_none=True)
        if blocks_only:  # the compiled blocks alone: their backward is the step's whole backward
            x = hidden.clone().requires_grad_(True)
            model.layers(x, cos, sin).square().mean().backward()
        else:
            lm_loss(model(inputs), labels).backward()

    for _ in range(warmup):
        step()
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    peak = 0

    def walk(nodes):
        nonlocal peak
        for n in nodes:
            if n.tag == _EventType.Allocation:
                peak = max(peak, n.extra_fields.total_allocated)
            walk(n.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())

    def split_step():
        """A zero-bubble schedule's backward of the block stack: the input gradient (retain_graph),
        then the weight gradient, torch.distributed.pipelining's own two functions."""
        from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

        model.zero_grad(set_to_none=True)
        x = hidden.clone().requires_grad_(True)
        loss = model.layers(x, cos, sin).square().mean()
        _, groups = stage_backward_input([loss], None, [x], model.layers.parameters())
        stage_backward_weight(model.layers.parameters(), groups)

    # Interleaved (one of each, repeated) so that a shared machine's load hits both alike.
    split = blocks_only and (not donated or not compiled)
    if split:
        split_step()  # (the backward compiled for a retained graph: its own compile)
    plain_times, split_times = [], []
    for _ in range(repeats):
        plain_times.append(_timed(step))
        if split:
            split_times.append(_timed(split_step))
    return {
        "variant": "on" if donated and compiled else "off" if compiled else "eager",
        "donated_buffer": donated,
        "donated_per_graph": donated_counts,
        "peak_step_bytes": peak,
        "step_s": statistics.median(plain_times),
        "split_step_s": statistics.median(split_times) if split else None,
    }


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="")
    p.add_argument(
        "--blocks-only",
        action="store_true",
        help="the block stack alone on random hidden states (loss: the mean square), no embedding, head or loss",
    )
    p.add_argument("--child", choices=("on", "off", "eager"), default=None)
    a = p.parse_args()
    if a.child is not None:
        out = _child(
            a.child == "on", a.layers, a.seq, a.batch, a.warmup, a.repeats, a.blocks_only, compiled=a.child != "eager"
        )
        print("RESULT " + json.dumps(out))
        return
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1",
    }
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    rows = []
    for variant in ("on", "off", "eager") if a.blocks_only else ("on", "off"):
        cmd = [sys.executable, __file__, "--child", variant]
        cmd += ["--layers", str(a.layers), "--seq", str(a.seq), "--batch", str(a.batch)]
        cmd += ["--warmup", str(a.warmup), "--repeats", str(a.repeats)] + (["--blocks-only"] if a.blocks_only else [])
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, check=False)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.exit(f"error: the {variant} run failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(lines[-1][len("RESULT ") :]))
    from trainer.runtime.device import cpu_model

    cpu = cpu_model()
    on, off = rows[0], rows[1]
    what = "the block stack alone" if a.blocks_only else "the whole model and loss"
    print(f"debug Llama 3, {a.layers} layers, seq {a.seq}, batch {a.batch}, fp32, {what}; CPU: {cpu}")
    print("| blocks | donated per compiled graph | peak bytes in the step | step s (median) | split backward step s |")
    print("|---|---|---|---|---|")
    names = {"on": "compiled, donated buffers on", "off": "compiled, donated buffers off", "eager": "eager"}
    for r in rows:
        split = f"{r['split_step_s']:.3f}" if r.get("split_step_s") is not None else "-"
        print(
            f"| {names[r['variant']]} | {r['donated_per_graph']} | {r['peak_step_bytes'] / 2**20:.2f} MiB | "
            f"{r['step_s']:.3f} | {split} |"
        )
    diff = off["peak_step_bytes"] - on["peak_step_bytes"]
    print(f"peak, off - on: {diff / 2**20:+.2f} MiB ({diff / on['peak_step_bytes']:+.1%})")
    if a.out:  # appended (a header first in a new file), so that several shapes share one CSV
        what = "blocks" if a.blocks_only else "model"
        command = (
            f"OMP_NUM_THREADS=1 .venv/bin/python scripts/bench/donated_buffer_memory.py --layers {a.layers} "
            f"--seq {a.seq} --batch {a.batch} --warmup {a.warmup} --repeats {a.repeats}"
            + (" --blocks-only" if a.blocks_only else "")
        )
        new = not os.path.exists(a.out)
        with open(a.out, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(
                    ["cpu", "what", "layers", "seq", "batch", "variant", "donated_per_graph", "peak_step_bytes"]
                    + ["step_s", "split_step_s", "command"]
                )
            for r in rows:
                split = f"{r['split_step_s']:.4f}" if r.get("split_step_s") is not None else ""
                w.writerow(
                    [cpu, what, a.layers, a.seq, a.batch, r["variant"], " ".join(map(str, r["donated_per_graph"]))]
                    + [r["peak_step_bytes"], f"{r['step_s']:.4f}", split, command]
                )


if __name__ == "__main__":
    sys.exit(cli.run(main))
