"""Probe (xla venv): graph-mode pipeline parallelism's whole captured train step as one SPMD program
on XLA:CPU (trainer/graph/pipeline.py, uniform stages).

The pipelined graph step of the Llama 3 debug model (4 layers, pp 2, 2 chunks, fp32, AdamW with
clipping, aot_eager) is captured on PyTorch's fake process group as rank 0 and as rank 1 (each
rank's inputs recorded: its 2 blocks, the embedding and head every rank holds, its stage index,
the batch). Rank 0's program is lowered by torchax with tools/tpu_compile.py's collective rules
inside one `jax.shard_map` over 2 XLA:CPU devices (the pp axis), compiled, and run with device r
fed rank r's inputs: one program, the stage index the only difference the code sees. Its loss and
gradient norm are compared with one process's eager step on the same batch (the whole model, the
same seed).

With the argument `moe`: Qwen 3 MoE's debug flavor instead (4 layers, 8 experts top-2, seq 32,
aux_loss_coef 0.1): `PipelinedLoss(moe=True)`, so the program also returns each stage's aux loss
(its value summed over pp) and its layers' expert loads summed over the chunks, compared with one
process's eager step whose micro-batches are the chunks (graph-mode PP's chunk semantics): "aux",
"ref_aux", "loads" (device 0's layers then device 1's) and "ref_loads".

With the argument `scan` (either model): `PipelinedLoss(scan=True)`, the pipeline's iterations as one
scan (`[compile] scan_pipeline_iterations`), whose body takes the stage's parameters as local tensors
(`functional_call`): the program holds one permute each way, inside the scan bodies, whatever m.

Prints one JSON line: {"collective_permute": n, "all_to_all": n, "loss": [per device],
"grad_norm": [per device], "ref_loss": x, "ref_grad_norm": x, "stage_inputs": [0, 1],
"shared_tensors": n, "shared_diff_between_devices": x, "shared_min_change": x, "lower_s", "compile_s",
"run_s"}: the embedding's and the head's weights and moments after the update, equal on both devices
and changed by it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

N_LAYERS, PP, CHUNKS, BATCH, SEQ, SEED, LR = 4, 2, 2, 4, 64, 0, 1e-3
MOE = "moe" in sys.argv[1:]
SCAN = "scan" in sys.argv[1:]
AUX_COEF = 0.1 if MOE else 0.0
if MOE:
    SEQ = 32


def _args():
    import dataclasses

    if MOE:
        from models.qwen3 import FLAVORS

        return dataclasses.replace(FLAVORS["debugmodel_moe"], n_layers=N_LAYERS, max_seq_len=SEQ)
    from models.llama3 import FLAVORS

    return dataclasses.replace(FLAVORS["debugmodel"], n_layers=N_LAYERS, max_seq_len=SEQ)


def _batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _family():
    from models import FAMILIES

    return FAMILIES["qwen3" if MOE else "llama3"]


def capture(rank: int) -> dict:
    """Rank `rank`'s recorded inputs (and, for rank 0, the program and its process groups)."""
    import torch._dynamo
    import torch.distributed as dist
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from parallelisms import ParallelDims, build_mesh
    from parallelisms.parallel_dims import pp_mesh
    from planner.shard import fake_process_group
    from tools.xla_lowering import RECORD, CaptureDone, record_first_call
    from trainer.graph import build_graph_step
    from trainer.graph.pipeline import PipelinedLoss
    from trainer.job import build_model
    from trainer.optim import build_optimizer_for
    from trainer.step import StepRequest, plan_step

    torch._dynamo.reset()
    RECORD.clear()
    record_first_call(clone=True, stop=True)
    args = _args()
    with fake_process_group(PP, rank):
        dims = ParallelDims(pp=PP, world_size=PP)
        mesh = build_mesh(dims, "cpu")
        request = StepRequest(
            mode="graph",
            backend="aot_eager",
            pp_degree=PP,
            pp_schedule="GPipe",
            pp_microbatches=CHUNKS,
            pp_first_less=0,
            pp_last_less=0,
            model_has_experts=MOE,
            n_layers=N_LAYERS,
            local_batch=BATCH,
            model_document_mask=MOE,
        )
        plan = plan_step(request)
        torch.manual_seed(SEED)
        model = build_model(
            _family(),
            args,
            step_plan=plan,
            parallel_dims=dims,
            mesh=mesh,
            device=torch.device("cpu"),
            param_dtype=torch.float32,
            reduce_dtype=torch.float32,
        )
        opt = build_optimizer_for(model, name="adamw", lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        pp = pp_mesh(mesh)
        loss_fn = PipelinedLoss(
            pp_rank=pp.get_local_rank(),
            pp=PP,
            group_name=pp.get_group().group_name,
            microbatches=CHUNKS,
            dim=args.dim,
            dtype=torch.float32,
            moe=MOE,
            scan=SCAN,
        )
        step = build_graph_step(
            model=model,
            optimizer=opt,
            max_norm=1.0,
            backend="aot_eager",
            loss_fn=loss_fn,
            pp_mesh=pp,
            aux_loss_coef=AUX_COEF,
        )
        with sdpa_kernel([SDPBackend.MATH]):
            try:
                step([_batch(args.vocab_size)], LR)
            except CaptureDone:
                pass
        rec = dict(RECORD)
        gm = rec["gm"]
        names = {
            a
            for m in gm.modules()
            if hasattr(m, "graph")
            for n in m.graph.nodes
            for a in n.args
            if isinstance(a, str) and a.isdigit()
        }
        rec["groups"] = {
            name: dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(name)) for name in names
        }
    torch._dynamo.reset()
    return rec


def reference() -> tuple[float, float, float | None, list[float] | None]:
    """One process, the whole model, eager: the loss and the gradient norm of the same batch; with
    `MOE` its chunks as the micro-batches (`(lm + coef x aux) / chunks` each), and the mean aux loss
    and the expert loads summed over them (layer-major), else None."""
    from parallelisms import ParallelDims
    from trainer.job import build_model
    from trainer.step import StepRequest, plan_step
    from trainer.step.loss import lm_loss

    torch.manual_seed(SEED)
    model = build_model(
        _family(),
        _args(),
        step_plan=plan_step(StepRequest()),
        parallel_dims=ParallelDims(world_size=1),
        mesh=None,
        device=torch.device("cpu"),
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
    )
    inputs, labels = _batch(_args().vocab_size)
    if not MOE:
        loss = lm_loss(model(inputs), labels)
        loss.backward()
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
        return float(loss.detach()), float(norm), None, None
    rows = BATCH // CHUNKS
    lms, auxes, loads = [], [], []
    for c in range(CHUNKS):
        lm = lm_loss(model(inputs[c * rows : (c + 1) * rows]), labels[c * rows : (c + 1) * rows])
        aux = model.pop_aux_loss()
        loads.append(model.layers.pop_expert_load().detach())
        ((lm + AUX_COEF * aux) / CHUNKS).backward()
        lms.append(float(lm.detach()))
        auxes.append(float(aux.detach()))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    return sum(lms) / CHUNKS, float(norm), sum(auxes) / CHUNKS, torch.stack(loads).sum(0).reshape(-1).tolist()


def main() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    recs = [capture(0), capture(1)]
    with sdpa_kernel([SDPBackend.MATH]):
        ref_loss, ref_norm, ref_aux, ref_loads = reference()

    from tools.xla_lowering import add_lowerings, as_jax_function, load_torchax

    torchax = load_torchax()
    import jax
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec

    from titan_kernels.tpu import capture as kernel_ops
    from tools.tpu_compile import _define_program_ops, _lowerings

    _define_program_ops()  # the ops tools/tpu_compile.py's rules name (none is in this program)
    kernel_ops._define()
    env = torchax.default_env()
    add_lowerings(env)
    groups = recs[0]["groups"]
    # every group of this world is the pp axis or a single rank
    radices = [PP]
    _lowerings(env, axis_names=["pp"], groups=groups, radices=radices, generation="v6e")
    fn, idx = as_jax_function(recs[0])
    for i in idx:
        a, b = recs[0]["pre"][i], recs[1]["pre"][i]
        assert a.shape == b.shape and a.dtype == b.dtype, (i, a.shape, b.shape)
    stacked = [np.stack([r["pre"][i].numpy() for r in recs]) for i in idx]
    mesh = Mesh(np.asarray(jax.devices()[:PP]), ("pp",))
    spec = PartitionSpec("pp")

    vocab = _args().vocab_size
    # the embedding and the head (and their moments): every rank's copy, updated by the summed gradient
    shared = [k for k, i in enumerate(idx) if recs[0]["pre"][i].dim() == 2 and recs[0]["pre"][i].shape[0] == vocab]

    def per_device(*tensors):
        outs, updated = fn(*[t[0] for t in tensors])
        return [o[None] for o in outs if o is not None] + [updated[k][None] for k in shared]

    mapped = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    t = time.perf_counter()
    lowered = mapped.lower(*stacked)
    lower_s = time.perf_counter() - t
    text = lowered.as_text()
    t = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t
    t = time.perf_counter()
    outs = compiled(*stacked)
    jax.block_until_ready(outs)
    run_s = time.perf_counter() - t
    loss, norm = (np.asarray(outs[k]).reshape(PP).tolist() for k in (0, 1))
    moe = {}
    if MOE:  # the program's aux (per device) and loads (each device its stage's layers)
        moe = dict(
            aux=np.asarray(outs[2]).reshape(PP).tolist(),
            ref_aux=ref_aux,
            loads=np.asarray(outs[3]).reshape(-1).tolist(),
            ref_loads=ref_loads,
        )
    after = [np.asarray(o) for o in outs[-len(shared) :]]
    before = [stacked[k] for k in shared]
    print(
        json.dumps(
            dict(
                collective_permute=text.count("stablehlo.collective_permute"),
                all_to_all=text.count("stablehlo.all_to_all"),
                all_reduce=text.count("stablehlo.all_reduce"),
                loss=loss,
                grad_norm=norm,
                ref_loss=ref_loss,
                ref_grad_norm=ref_norm,
                stage_inputs=[
                    int(r["pre"][i].item())
                    for r in recs
                    for i in idx
                    if r["pre"][i].dtype == torch.int64 and r["pre"][i].dim() == 0
                ],
                shared_tensors=len(shared),
                shared_diff_between_devices=max(float(np.abs(a[0] - a[1]).max()) for a in after),
                shared_min_change=min(float(np.abs(a - b).max()) for a, b in zip(after, before)),
                lower_s=lower_s,
                compile_s=compile_s,
                run_s=run_s,
                **moe,
            )
        )
    )


if __name__ == "__main__":
    main()
