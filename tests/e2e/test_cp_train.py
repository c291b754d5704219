"""Context parallelism through the trainer: `build_job` + the job's step, and `trainer.train.train`.

Every run is the debug recipe with 2 layers, seq 64, fp32 parameters and a global batch of 4
windows (`training.global_batch_size = 4`, so the local batch is 4 / dp), 3 optimizer steps,
on gloo processes (`run_processes`). A cp run reads the same rows as the one-process run (the
cp ranks of a data-parallel group share its dp rank); `LMTask.prepare` gives each rank its
load-balanced shard and positions, the job serves `causal_attention` with the cp attention,
and the loss is the rank's token sum x cp / the group's token count. The reference is the same
helper at cp = 1 on one process.

Bounds (fp32, u = 2^-24 = 6e-8). The cp run differs from one process only in summation order:
the attention over gathered k/v (bounded in tests/unit/test_context_parallel.py by 8 (s + d) u
relative, ~1e-5 at s = 64, d = 16 and measured at a few u), the loss split into cp partial
sums, and each weight gradient summed over the ranks' tokens (SimpleFSDP's reduce-scatter)
instead of one matmul over all of them. So:
- losses: each step within 1e-5 relative (the bound of tests/e2e/test_parallel_e2e.py; the loss is
  a mean of 256 O(9) terms each off by a few u, and two AdamW steps at lr <= 3e-4 carry the
  step-1 gradient error into the later losses at O(lr x error));
- step-1 gradients: every tensor within 1e-5 of its max |value| (the attention bound carried
  through two layers of O(1)-conditioned maps, as in tests/unit/test_context_parallel.py);
- gradient norm: 1e-5 relative (a sum of squares of those gradients).
The final weights' largest difference is printed for the parity table but not asserted: AdamW's
first steps move an element by about lr x sign(grad) whatever its size (eps = 1e-8), so an
element whose gradient is a near-zero cancellation result can flip sign under a summation-order
change and differ by up to 2 x (1e-4 + 2e-4 + 3e-4); the losses of steps 2 and 3 are the
weights' check (they are computed from the updated weights).
The measured numbers are in docs/context_parallel.md ("Parity through the trainer").
"""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from models.errors import ConfigError
from tests.support.parallel_harness import full, run_processes
from trainer.step import plan_step

LLAMA = "configs/llama3_debug.toml"
MOE = "configs/qwen3_moe_debug.toml"
COMMON = (
    "--training.steps=3",
    "--training.seq_len=64",
    "--model.n_layers=2",
    "--metrics.log_freq=1",
    "--validation.enable=false",
    "--training.mixed_precision_param=float32",
    "--metrics.enable_tensorboard=false",
    "--training.global_batch_size=4",
    "--training.local_batch_size=4",
)
STEPS = 3


def _degrees(cp=1, dp_shard=1, tp=1, ep=1, dp_replicate=1) -> tuple[str, ...]:
    return (
        f"--parallelism.context_parallel_degree={cp}",
        f"--parallelism.data_parallel_shard_degree={dp_shard}",
        f"--parallelism.data_parallel_replicate_degree={dp_replicate}",
        f"--parallelism.tensor_parallel_degree={tp}",
        f"--parallelism.expert_parallel_degree={ep}",
    )


def _config(recipe: str, folder: str, extra: tuple[str, ...]):
    from trainer.config import build_config, split_cli

    _, _, overrides = split_cli(
        ["--config", recipe, *COMMON, f"--job.dump_folder={folder}", "--checkpoint.enable=false", *extra]
    )
    return build_config(recipe, overrides)


def _steps_on_rank(recipe: str, folder: str, extra: tuple[str, ...]) -> dict:
    """`build_job`, the job's step and the loop's micro-batch path (`task.prepare`) for STEPS
    steps: the global mean loss and grad norm of each step, the step-1 gradients (eager and
    compile modes leave them on the parameters) and the final weights, all full tensors."""
    from trainer.job import build_job
    from trainer.runtime import global_mean

    job = build_job(_config(recipe, f"{folder}/rank{dist.get_rank()}", extra), purpose="train")
    task = job.data.task
    step = job.build_step(loss_fn=task.loss_fn(job.plan.step_plan))
    losses, norms, grads = [], [], None
    for i in range(STEPS):
        microbatches = [
            tuple(x.to(job.runtime.device) for x in task.prepare(job.data.loader.next_batch()))
            for _ in range(job.data.grad_accum_steps)
        ]
        out = step(microbatches, job.scheduler.get_last_lr()[0])
        job.scheduler.step()
        losses.append(global_mean(out.loss))
        norms.append(float(out.grad_norm))
        if i == 0 and job.plan.step_plan.mode != "graph":
            grads = {n: full(p.grad).clone() for n, p in job.model.named_parameters() if p.grad is not None}
    weights = {n: full(p.detach()).clone() for n, p in job.model.named_parameters()}
    shapes = [tuple(t.shape) for t in microbatches[0]]
    # with document masking: the document boundaries inside this rank's shards of the last batch
    boundaries = int((microbatches[0][2][:, 1:] != microbatches[0][2][:, :-1]).sum()) if len(shapes) == 4 else 0
    return dict(losses=losses, norms=norms, grads=grads, weights=weights, shapes=shapes, boundaries=boundaries)


def _compare(ref: dict, got: dict, what: str) -> dict:
    """The differences the module docstring bounds; printed for the parity table."""
    loss = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    norm = max(abs(a - b) / abs(b) for a, b in zip(got["norms"], ref["norms"]))
    weight = max((got["weights"][n] - w).abs().max().item() for n, w in ref["weights"].items())
    grad = None
    if got["grads"] is not None:
        assert set(got["grads"]) == set(ref["grads"])
        grad = max(
            ((got["grads"][n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item() for n, g in ref["grads"].items()
        )
    print(
        f"{what}: loss {loss:.2e} rel, grad {grad if grad is None else f'{grad:.2e}'} rel-to-max, "
        f"grad_norm {norm:.2e} rel, weights {weight:.2e} abs"
    )
    assert loss <= 1e-5, (what, got["losses"], ref["losses"])
    assert norm <= 1e-5, (what, got["norms"], ref["norms"])
    assert grad is None or grad <= 1e-5, (what, grad)
    return dict(loss=loss, grad=grad, norm=norm, weight=weight)


def _run(tmp_path, recipe: str, world_size: int, extra: tuple[str, ...]) -> dict:
    results = run_processes(world_size, _steps_on_rank, recipe, str(tmp_path), extra)
    assert all(r["losses"] == results[0]["losses"] for r in results)  # global means: equal everywhere
    return results[0]


@pytest.fixture(scope="module")
def llama_reference(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("llama_ref"), LLAMA, 1, _degrees())


# --- eager, on each mesh ----------------------------------------------------------------------------

LOSS_PARALLEL = ("--parallelism.enable_loss_parallel=true",)
# The default run keeps cp 2 and (slow) cp 2 x tp 2; the other points are `exhaustive` (the
# scheduled run): their mechanisms are proven at the model level in tests/unit/test_context_parallel.py
# (cp 4 attention, dp x cp SimpleFSDP, per-block compile) and by the points kept here.
EXHAUSTIVE = [pytest.mark.slow, pytest.mark.exhaustive]
MESHES = [
    pytest.param(2, dict(cp=2), (), id="cp2"),
    pytest.param(4, dict(cp=2, tp=2), (), id="cp2xtp2", marks=pytest.mark.slow),
    pytest.param(4, dict(cp=4), (), id="cp4", marks=EXHAUSTIVE),
    pytest.param(4, dict(cp=2, dp_shard=2), (), id="cp2xdp2", marks=EXHAUSTIVE),
    pytest.param(4, dict(cp=2, tp=2), LOSS_PARALLEL, id="cp2xtp2-loss-parallel", marks=EXHAUSTIVE),
    pytest.param(4, dict(cp=2, dp_replicate=2), (), id="cp2xhsdp2", marks=EXHAUSTIVE),
    # per-block compile: each block compiled (aot_eager), the cp attention's collectives inside
    pytest.param(
        2, dict(cp=2), ("--compile.mode=compile", "--compile.backend=aot_eager"), id="cp2-compile", marks=EXHAUSTIVE
    ),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size, degrees, extra", MESHES)
def test_eager_cp_matches_single_process(tmp_path, llama_reference, world_size, degrees, extra):
    got = _run(tmp_path, LLAMA, world_size, _degrees(**degrees) + extra)
    seq_local = 64 // degrees["cp"]
    # inputs, labels and the positions: this rank's shard of each window
    assert got["shapes"] == [(4 // degrees.get("dp_shard", 1) // degrees.get("dp_replicate", 1), seq_local)] * 3
    _compare(llama_reference, got, f"llama3 {degrees} {' '.join(extra) or 'eager'}")


# --- graph mode + layer scan ------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
def test_graph_scan_cp2_matches_single_process(tmp_path, llama_reference):
    """Graph mode (aot_eager) with layer scan: the k/v all-gathers and the count all-reduce are
    captured with SimpleFSDP's collectives into the one step graph; the same bounds as eager (the
    captured step computes the same fp32 math, tests/e2e/test_parallel_e2e.py)."""
    got = _run(
        tmp_path,
        LLAMA,
        2,
        _degrees(cp=2) + ("--compile.mode=graph", "--compile.backend=aot_eager", "--compile.scan_layers=true"),
    )
    _compare(llama_reference, got, "llama3 graph+scan cp2")


# --- Qwen 3 MoE ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("moe_ref"), MOE, 1, _degrees())


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "degrees", [pytest.param(dict(cp=2), marks=pytest.mark.exhaustive), dict(cp=2, ep=2)], ids=["cp2", "cp2xep2"]
)
def test_moe_cp_matches_single_process(tmp_path, moe_reference, degrees):
    """Qwen 3 MoE (aux loss on): the routing is per token, so a cp rank routes its own tokens;
    the load-balancing loss counts experts over the world (global-batch LBL), and its router
    probabilities' mean over the rank's tokens, averaged by SimpleFSDP over cp, is the global
    mean (equal shard sizes). With ep = 2 the experts are split over the two cp ranks. Same
    bounds: only summation order differs."""
    got = _run(tmp_path, MOE, 2, _degrees(**degrees))
    _compare(moe_reference, got, f"qwen3 moe {degrees}")


# --- document masking ------------------------------------------------------------------------------


def short_documents(folder: Path) -> Path:
    """`folder`/docs.jsonl: 400 documents of 2 to 10 words (seeded), so every 64-token window holds
    several boundaries (the bundled corpus's documents are longer than a window). Returns its path."""
    g = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "tree", "river", "stone", "cloud", "seven", "blue"]
    data = folder / "docs.jsonl"
    with open(data, "w") as f:
        for _ in range(400):
            n = int(torch.randint(2, 10, (), generator=g))
            f.write(
                json.dumps({"text": " ".join(words[int(i)] for i in torch.randint(0, 10, (n,), generator=g))}) + "\n"
            )
    return data


@pytest.mark.multiprocess
@pytest.mark.parametrize("positions", [pytest.param("global", marks=pytest.mark.exhaustive), "restart"])
def test_document_mask_cp2_matches_single_process(tmp_path, positions):
    """Packed documents: segment ids sharded with the windows and all-gathered with k/v, so a
    query sees only earlier keys of its own document across the shard boundary; with restart
    positions, the per-document positions of the whole window are sharded the same way. The
    reference is the one-process document-masked run; same bounds."""
    data = short_documents(tmp_path)
    extra = (
        "--training.document_mask=true",
        f"--training.document_positions={positions}",
        f"--training.dataset={data}",
    )
    ref = _run(tmp_path / "ref", LLAMA, 1, _degrees() + extra)
    got = _run(tmp_path / "cp", LLAMA, 2, _degrees(cp=2) + extra)
    assert got["shapes"] == [(4, 32)] * 4  # inputs, labels, segment ids, positions
    assert got["boundaries"] >= 4, got["boundaries"]  # the mask is not vacuous
    _compare(ref, got, f"llama3 document mask ({positions} positions) cp2")


# --- the loop: resume across a change of cp -------------------------------------------------------


def _train_on_rank(folder: str, extra: tuple[str, ...]) -> dict:
    """`trainer.train.train` (the real loop: logging, checkpointing, resume); metrics.jsonl by step."""
    from trainer.config import build_config, split_cli
    from trainer.train import train

    _, _, overrides = split_cli(["--config", LLAMA, *COMMON, f"--job.dump_folder={folder}", *extra])
    assert train(build_config(LLAMA, overrides)) == 0
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


@pytest.mark.multiprocess
def test_resume_across_a_change_of_cp(tmp_path, llama_reference):
    """Save at cp = 2 after step 2 (DCP: parameters and AdamW moments sharded over dp_shard x cp
    = 2 ranks), resume at cp = 1 on one process (DCP reshards; the loader state is the same,
    the dp degree being 1 in both), run step 3: every step's loss equals the continuous cp = 1
    run's (`llama_reference`: the same job and step without the loop's logging) within 1e-5
    relative (cp steps differ from one-process steps by summation order only, the bounds of the
    module docstring). Both halves run the real loop, `trainer.train.train`."""
    ckpt = ("--checkpoint.enable=true", "--checkpoint.interval=2")
    folder = str(tmp_path / "switch")
    first = run_processes(2, _train_on_rank, folder, _degrees(cp=2) + ckpt + ("--training.steps=2",))[0]
    resumed = run_processes(1, _train_on_rank, folder, _degrees() + ckpt)[0]
    assert set(first) == {1, 2} and set(resumed) >= {3}
    continuous = llama_reference["losses"]
    for step, record in [(1, first[1]), (2, first[2]), (3, resumed[3])]:
        diff = abs(record["loss"] - continuous[step - 1]) / continuous[step - 1]
        print(f"resume cp2 -> cp1: step {step} loss rel diff {diff:.2e}")
        assert diff <= 1e-5, (step, record["loss"], continuous[step - 1])
    # MFU: FLOPs per token are the full window's (attention over all 64 positions) at cp = 2 as
    # at cp = 1; the per-device token count divides by cp x tp (`non_data_parallel_size`).
    per_token = [r["tflops"] / r["tokens_per_sec"] for r in (first[1], first[2], resumed[3])]
    assert per_token == pytest.approx([per_token[2]] * 3, rel=1e-9)


# --- what CP does not cover: refused by the step plan's rules ------------------------------------


@pytest.mark.parametrize(
    "request_fields, pattern",
    [
        (dict(task="flow"), r"parallelism\.context_parallel_degree: 2 shards the token windows of task lm.*allowed: 1"),
        (
            dict(model_document_mask=False),
            r"parallelism\.context_parallel_degree: 2 needs a model that takes RoPE "
            r"positions.*hf backend.*allowed for this model: 1",
        ),
        (dict(caller_loss=True), r"parallelism\.context_parallel_degree: 2: the engine.*allowed: 1"),
    ],
)
def test_rules_refuse_what_cp_does_not_cover(request_fields, pattern):
    fields = dict(cp_degree=2, model_document_mask=True) | request_fields
    with pytest.raises(ConfigError, match=pattern):
        plan_step(**fields)
    plan_step(cp_degree=2, model_document_mask=True)  # an LM that takes positions: allowed


# --- the loss with ignored labels --------------------------------------------------------------


class _EmbeddingLM(torch.nn.Module):
    """logits = a [vocab, vocab] table's rows at the tokens (RoPE positions accepted, unused)."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Parameter(table.clone())

    def forward(self, tokens, segment_ids=None, positions=None):
        return self.table[tokens]


def _ignored_labels_on_rank(table, inputs, labels):
    from parallelisms.context_parallel import cp_group
    from trainer.config import Config
    from trainer.step import plan_step
    from trainer.tasks import LMSettings, LMTask

    task = LMTask.__new__(LMTask)  # the task's loss and prepare only: no tokenizer, no loader
    task.settings = LMSettings.of(Config())
    task.cp = cp_group(dist.group.WORLD)  # what the constructor keeps of its `cp` argument
    task.args = None  # no model args: no multi-token prediction (loss_fn reads args.mtp_depth)
    model = _EmbeddingLM(table)
    micro = task.prepare((inputs, labels))
    loss = task.loss_fn(plan_step())(model, *micro)
    loss.backward()
    # what SimpleFSDP's Partial("avg") over dp_shard x cp does, and the logged global mean
    grad = model.table.grad
    dist.all_reduce(grad)
    grad /= dist.get_world_size()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean / dist.get_world_size(), grad, int((micro[1] != -100).sum())


@pytest.mark.multiprocess
def test_loss_with_ignored_labels_is_the_global_mean():
    """Labels ignored (-100) unevenly over the cp shards (rank 0 keeps 6 of its 16, rank 1 all
    16): the cp loss (token sum x cp / the group's count) averaged like SimpleFSDP averages
    gradients gives the one-process mean over the 22 kept labels and its gradient, where a mean
    of per-rank means would weigh rank 0's tokens 16/6 times too much. fp32 sums of 22 O(3)
    terms in another order: 1e-6 relative is ~20 u."""
    g = torch.Generator().manual_seed(0)
    vocab, seq = 11, 16
    table = torch.randn(vocab, vocab, generator=g)
    inputs = torch.randint(0, vocab, (2, seq), generator=g)
    labels = torch.randint(0, vocab, (2, seq), generator=g)
    # rank 0 holds chunks 0 and 3 (positions 0-3, 12-15) of each row: ignore most of them
    labels[:, 0:4] = -100
    labels[0, 12:14] = -100
    model = _EmbeddingLM(table)
    ref = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
    ref.backward()
    results = run_processes(2, _ignored_labels_on_rank, table, inputs, labels)
    assert [kept for _, _, kept in results] == [6, 16]
    for mean, grad, _ in results:
        assert abs(mean.item() - ref.item()) <= 1e-6 * abs(ref.item()), (mean, ref)
        assert (grad - model.table.grad).abs().max() <= 1e-6 * model.table.grad.abs().max()
