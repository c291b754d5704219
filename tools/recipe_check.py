"""Would a recipe start on its target? The trainer's own start-up, on a fake world, without a TPU.

`check_recipe(path)` runs, for the recipe's `[job] target` (e.g. `v7x-512`: 512 devices of type
tpu) inside PyTorch's fake process group at that world size:
  1. `build_job(cfg, purpose="check")` (trainer/job.py): the config, model args, parallel
     degrees and the step plan checked against every rule (trainer/step/plan.py RULES), the
     task (its tokenizer), the named DeviceMesh, the batch split, the model on the meta device
     at full depth parallelized by the real plan (TP, EP, AC, SimpleFSDP), the optimizer;
  2. the step the trainer would build (`Job.build_step`), called once on a meta micro-batch of
     the recipe's shapes: in graph mode that is the whole capture (Dynamo, AOTAutograd, the
     graph passes, layer scan), with `aot_eager` in place of the target's compiler;
  3. the planner's per-device memory for the same plan and step plan (planner.plan_estimate),
     against the target's HBM.
A recipe without a target runs at the world its degrees multiply to, as a CPU run. On a TPU
target the mesh is also laid out as torch-tpu lays it on the slice (`tpu_mesh_check`), and
`scripts/check_recipe.py --compile` compiles the per-device program (tools/tpu_compile.py).

The rules are the trainer's: a refusal here is the `ConfigError` the trainer would raise, with
the key to change. `scripts/check_recipe.py` prints one row per recipe; tests/e2e/test_recipes.py
runs it over every recipe in configs/.
"""

from __future__ import annotations

import math
import operator
import os
import time
from dataclasses import dataclass, field

import torch

import planner
from models.errors import ConfigError
from trainer.config import Config, build_config

GiB = planner.GiB


@dataclass
class RecipeCheck:
    """What `check_recipe` found for one recipe."""

    recipe: str
    target: str = "-"
    devices: int = 0
    mesh: str = "-"
    step: str = "-"
    """The step plan: mode, backend, scan, AC, loss."""
    pipeline: str = "-"
    """With pipeline_parallel_degree > 1: the degree, schedule, micro-batches, bubble and the
    heaviest stage's memory (planner/pipeline.py; the whole breakdown goes to the notes)."""
    planned_gib: float | None = None
    """The planner's per-device total (rank 0) for this plan."""
    hbm_gib: float | None = None
    """The usable HBM per device (after the planner's headroom); None for a CPU recipe."""
    capture: str = "-"
    """What the capture produced (graph nodes, collectives, scans) or the eager step's loss."""
    flips_gib: float | None = None
    """Bytes of the scans' flipped copies in the captured graph (torch's scan backward; `_flip_bytes`)."""
    planned_flips_gib: float | None = None
    tpu_mesh: str = "-"
    """On a TPU target: the mesh as torch-tpu lays it out on the target's slice, and which code said so
    (`tpu_mesh_check`)."""
    device_order: str = "-"
    """The ranks the device order renumbers (the run's `parallelism.device_order` on its target: the
    launcher rank of each place) and the shard invariant's check on every mesh axis (build_mesh)."""
    seconds: float = 0.0
    error: str | None = None
    """The refusal (the trainer's `ConfigError`) or the failure; None: it would start."""
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool | None:
        if self.planned_gib is None or self.hbm_gib is None:
            return None
        return self.planned_gib <= self.hbm_gib

    @property
    def ok(self) -> bool:
        return self.error is None and self.fits is not False


def world_of(cfg: Config) -> tuple[int, str, planner.Target | None]:
    """(devices, device type, target) a recipe declares: its `[job] target`, else the CPU world
    its explicit degrees multiply to."""
    if cfg.job.target:
        target = planner.parse_target(cfg.job.target, key="job.target")
        if target.num_slices > 1 and cfg.parallelism.num_slices == 0:
            # `v6e-256x2`: the job's world is every slice; the trainer's slice count too (another
            # count is the rule's to refuse: trainer/step/plan.py, parallelism.num_slices)
            cfg.parallelism.num_slices = target.num_slices
        return target.devices, target.device_type, target
    p = cfg.parallelism
    degrees = (
        p.data_parallel_replicate_degree,
        p.data_parallel_shard_degree,
        p.context_parallel_degree,
        p.tensor_parallel_degree,
    )
    return math.prod(d for d in degrees if d > 0), "cpu", None


def plan_inputs(cfg: Config) -> planner.PlanInputs:
    """The planner's inputs for a recipe (model, batch, step settings), as scripts/estimate.py reads it."""
    from parallelisms.quantize import QuantizePlan
    from trainer.config import resolve_model_args
    from trainer.job import step_request

    family, args = resolve_model_args(cfg.model, seq_len=cfg.training.seq_len)
    t = cfg.training
    flow = None
    seq_len = t.seq_len
    if getattr(family, "task", "lm") == "flow":
        from planner.flux import flux_tokens

        flow = flux_tokens(cfg.flow)
        seq_len = sum(flow)
    return planner.PlanInputs(
        family=family,
        args=args,
        model_name=f"{cfg.model.name} {cfg.model.flavor}",
        seq_len=seq_len,
        local_batch_size=t.local_batch_size,
        grad_accum=t.gradient_accumulation_steps,
        flow_tokens=flow,
        # what the rules read from the model (the pipeline's: experts, tied embeddings), as plan_job
        step=step_request(
            cfg,
            family,
            model_has_experts=args.shape().num_experts > 0,
            mtp_depth=getattr(args, "mtp_depth", 0),
            tie_embeddings=bool(getattr(args, "tie_embeddings", False)),
        ),
        quantize=QuantizePlan.of(cfg.quantize),
    )


def planned(
    cfg: Config, target: planner.Target, *, headroom: float = 0.1, check_rules: bool = True, probe: bool = False
) -> planner.Estimate:
    """The planner's estimate of the recipe's own plan on `target` (`check_rules=False`: priced even
    where the rules refuse it, with the refusals in its notes; `probe`: one block sharded and counted
    n_layers times, as `scripts/estimate.py --config` plans: the same total, faster)."""
    p = cfg.parallelism
    return planner.plan_estimate(
        plan_inputs(cfg),
        target,
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        tp=p.tensor_parallel_degree,
        ep=p.expert_parallel_degree,
        cp=p.context_parallel_degree,
        ac_mode=cfg.activation_checkpoint.mode,
        loss_parallel=p.enable_loss_parallel,
        headroom=headroom,
        check_rules=check_rules,
        probe=probe,
    )


REFUSED_NOTE = "refused by the trainer's rules today: "
"""How `plan_estimate(check_rules=False)` notes a refusal (planner/search.py)."""


def pipeline_summary(est: planner.Estimate) -> str:
    """The recipe check's pipeline column: degree, schedule, micro-batches, bubble, the heaviest stage."""
    c = est.pipeline
    s = c.spec
    v = f" x{s.v} stages/rank" if s.v > 1 else ""
    return (
        f"pp {s.pp} {s.schedule}{v}, {s.m} micro-batches, bubble {c.bubble:.1%}, heaviest pp rank {c.rank} "
        f"({c.holds}) {c.rank_totals[c.rank] / GiB:.1f} GiB, p2p {c.p2p_bytes / GiB:.2f} GiB/step over {c.link_text}"
    )


def _step_summary(plan) -> str:
    parts = [plan.mode]
    if plan.backend:
        parts.append(plan.backend)
    if plan.scan:
        parts.append(f"scan (AC {plan.scan_ac})")
    elif plan.pipeline is not None and plan.pipeline.scan_iterations:
        parts.append(f"iteration scan (AC {plan.scan_ac})")
    elif plan.block_ac != "none":
        parts.append(f"AC {plan.block_ac}")
    parts.append("fused loss" if plan.fused_loss else "loss parallel" if plan.loss_parallel else "plain loss")
    return ", ".join(parts)


def _order_summary(cfg: Config, job, *, devices: int, device_type: str, report: RecipeCheck) -> str:
    """`N/W renumbered, invariant on K axes`: the run's device order on its target (torch-tpu's
    layout, the compact EP groups: parallelisms/device_order.py) and how many mesh axes build_mesh
    checked; the order in full goes to the notes."""
    from trainer.job import rank_order_of

    order = rank_order_of(cfg, world_size=devices, device_type=device_type)
    report.notes.append(order.summary())
    return f"{order.renumbered}/{order.world_size} renumbered, invariant on {job.data.mesh._titan_checked_axes} axes"


def _mesh_summary(dims) -> str:
    axes = [
        f"{name} {size}"
        for name, size in (
            ("pp", dims.pp),
            ("dp_rep", dims.dp_replicate),
            ("fsdp", dims.dp_shard),
            ("cp", dims.cp),
            ("tp", dims.tp),
            ("ep", dims.ep),
        )
        if size > 1
    ]
    return " x ".join(axes) or "1"


def _flip_bytes(graph_module) -> int:
    """Bytes of the scans' flipped copies in the captured graph: `flip(x, [0])` feeding a scan (torch's
    scan backward reads its stacked inputs that way) or taken of a scan's output (the gradients
    stacked back into layer order). Other flips are the model's own math (e.g. `cumsum`'s backward,
    a reversed cumsum: the chunked delta rule's gates) and not counted."""
    scan = torch.ops.higher_order.scan

    def of_scan(node) -> bool:
        source = node.args[0]
        if isinstance(source, torch.fx.Node) and source.target is operator.getitem:
            source = source.args[0]
        return (isinstance(source, torch.fx.Node) and source.target is scan) or any(
            u.target is scan for u in node.users
        )

    total = 0
    for node in graph_module.graph.find_nodes(op="call_function", target=torch.ops.aten.flip.default):
        val = node.meta.get("val")
        if val is not None and list(node.args[1]) == [0] and of_scan(node):
            total += val.numel() * val.element_size()
    return total


def _with_tokenizer(cfg: Config, report: RecipeCheck) -> Config:
    """Pod recipes name a tokenizer file their user supplies (Llama 3's and Qwen's are not shipped):
    when it is absent here the start-up goes on with the bundled one, and the row says so."""
    path = cfg.model.tokenizer
    if path != "bundled" and not os.path.exists(path):
        report.notes.append(f"model.tokenizer {path} is not here (user-supplied): checked with the bundled one")
        cfg.model.tokenizer = "bundled"
    return cfg


STAND_IN_BUCKET = "titan-recipe-check"
"""The bucket the check puts in place of a pod recipe's placeholder (a valid name; never written)."""


def _with_checkpoint_folder(cfg: Config, report: RecipeCheck) -> Config:
    """Pod recipes name their checkpoint folder `gs://YOUR_BUCKET/...`, a placeholder the launcher
    and the trainer refuse until it is set (trainer/config/placeholders.py). The check writes no
    checkpoint: it checks the folder's form with a stand-in bucket, and the row says so."""
    from trainer.config.placeholders import PLACEHOLDER_PREFIX, is_placeholder

    folder = cfg.checkpoint.folder
    if cfg.checkpoint.enable and is_placeholder(folder):
        stand_in = f"gs://{STAND_IN_BUCKET}/{folder[len(PLACEHOLDER_PREFIX) :]}".rstrip("/")
        report.notes.append(
            f"checkpoint.folder {folder} is the recipe's placeholder (a run needs --checkpoint.folder=gs://BUCKET/...): "
            f"checked as {stand_in}; the check writes no checkpoint"
        )
        cfg.checkpoint.folder = stand_in
    return cfg


def with_stand_ins(cfg: Config, report: RecipeCheck) -> Config:
    """What a pod recipe leaves to its user, replaced for a check: the tokenizer file, the bucket."""
    return _with_checkpoint_folder(_with_tokenizer(cfg, report), report)


def start_up(cfg: Config, *, devices: int, device_type: str, report: RecipeCheck) -> None:
    """The trainer's start-up of `cfg` on `devices` fake ranks of `device_type` (module docstring)."""
    import torch._dynamo

    from models.common.stack import abstract_model
    from trainer.job import build_job

    torch._dynamo.reset()
    with planner.fake_process_group(devices), abstract_model():
        job = build_job(cfg, purpose="check", device_type=device_type)
        report.mesh = _mesh_summary(job.plan.parallel_dims)
        report.device_order = _order_summary(cfg, job, devices=devices, device_type=device_type, report=report)
        report.step = _step_summary(job.plan.step_plan)
        step = job.build_step(loss_fn=job.data.task.loss_fn(job.plan.step_plan))
        batch = job.data.task.example_batch(job.data.local_batch_size, device=job.runtime.device)
        out = step([batch] * job.data.grad_accum_steps, job.cfg.optimizer.lr)
        graph_module = getattr(step, "graph_module", None)
        if graph_module is not None:
            stats = step.stats
            report.capture = f"{stats.nodes} nodes, {sum(stats.collectives.values())} collectives, {stats.scans} scans"
            report.flips_gib = _flip_bytes(graph_module) / GiB
        else:
            report.capture = f"eager step, loss {tuple(out.loss.shape)} on {out.loss.device.type}"
    torch._dynamo.reset()


# --- the TPU mesh: torch-tpu's layout on the target's slice --------------------------------------


def _ttpu_python() -> str | None:
    """The XLA tier's torch-tpu venv (scripts/xla_env.sh ttpu) when it is already made; never made here."""
    import glob

    root = os.environ.get("TITAN_XLA_VENV_ROOT") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    venv = os.path.join(root, ".venv-ttpu")
    python = os.path.join(venv, "bin", "python")
    return python if os.path.exists(python) and glob.glob(os.path.join(venv, ".titan-*")) else None


def _mesh_case(cfg: Config):
    """(topology, mesh shape) of a recipe with a TPU target whose slice has a known grid, else None.
    Several slices (`v6e-256x2`): one slice's grid and mesh, `pp x dp_replicate / num_slices` rows of
    the outermost axis in it (the DCN splits the pp stages, then `dp_replicate`;
    parallelisms/parallel_dims.py `dcn_mesh_shape`), since every slice lays out the same ICI mesh."""
    from parallelisms.parallel_dims import ParallelDims
    from parallelisms.tpu_topology import topology_of

    if not cfg.job.target:
        return None
    target = planner.parse_target(cfg.job.target, key="job.target")
    slices = target.num_slices
    if target.device_type == "tpu" and slices > 1:
        target = planner.parse_target(target.name.rsplit("x", 1)[0], key="job.target")
    topology = topology_of(target) if target.device_type == "tpu" else None
    p = cfg.parallelism
    outer = p.pipeline_parallel_degree * p.data_parallel_replicate_degree  # pp folded in (`layout_shape`)
    if topology is None or outer % slices:
        return None
    dims = ParallelDims(
        dp_replicate=outer // slices,
        dp_shard=p.data_parallel_shard_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        ep=p.expert_parallel_degree,
        world_size=target.devices,
    )
    return topology, dims.layout_shape


def torch_tpu_layouts(paths, overrides=()) -> dict | None:
    """torch-tpu's own `create_device_mesh` on stand-in devices of each TPU recipe's slice, whole axes
    and split, in ONE subprocess of the ttpu venv for all recipes (tools/torch_tpu_mesh.py): {(topology,
    shape): {"whole": result, "split": result, "version": v}}; None when that venv is not made or the
    probe fails (the check then uses the port, parallelisms/tpu_topology.py, and says so)."""
    import json
    import subprocess

    python = _ttpu_python()
    if python is None:
        return None
    cases = {}
    for path in paths:
        try:
            case = _mesh_case(build_config(path, list(overrides)))
        except Exception:  # noqa: BLE001  (the recipe's own check reports it)
            continue
        if case is not None:
            cases[case] = None
    if not cases:
        return {}
    request = [
        dict(
            generation=t.generation,
            chips=list(t.chips),
            devices_per_chip=t.devices_per_chip,
            shape=list(shape),
            allow_split=split,
        )
        for t, shape in cases
        for split in (False, True)
    ]
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_tpu_mesh.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(TORCH_DEVICE_BACKEND_AUTOLOAD="0", JAX_PLATFORMS="cpu")
    try:
        out = subprocess.run(
            [python, script], input=json.dumps({"cases": request}), capture_output=True, text=True, env=env, timeout=300
        )
        reply = json.loads(out.stdout.strip().splitlines()[-1])
    except Exception:  # noqa: BLE001  (no torch-tpu answer: the port answers)
        return None
    results = iter(reply["results"])
    return {case: {"whole": next(results), "split": next(results), "version": reply["torch_tpu"]} for case in cases}


def tpu_mesh_check(cfg: Config, report: RecipeCheck, torch_tpu: dict | None = None) -> None:
    """Fill `report.tpu_mesh` for a recipe with a TPU target: the layout the trainer gets (whole
    physical axes, else split ones: parallelisms/parallel_dims.py `_tpu_rank_grid`), from torch-tpu's
    own function when `torch_tpu` (`torch_tpu_layouts`) has this recipe's case, else from the port;
    ConfigError when neither layout exists (the recipe then fails)."""
    import numpy as np

    from parallelisms.tpu_topology import map_mesh

    case = _mesh_case(cfg)
    if case is None:
        if cfg.job.target and planner.parse_target(cfg.job.target, key="job.target").device_type == "tpu":
            report.tpu_mesh = "slice not known (no grid for this size): not checked"
        return
    topology, shape = case
    theirs = (torch_tpu or {}).get(case)
    try:
        layout = map_mesh(topology, shape)
        port_ids = [int(v) for v in np.asarray(layout.device_ids).reshape(-1)]
    except ConfigError as e:
        layout, port_ids, port_error = None, None, e
    if theirs is None:
        if layout is None:
            raise port_error
        report.tpu_mesh = f"{layout.summary()} [port]"
        report.notes.extend(f"mesh: {n}" for n in layout.notes())
        return
    whole, split = theirs["whole"], theirs["split"]
    built = whole if "ids" in whole else split if whole["error"].startswith("NotImplementedError") else whole
    who = f"torch-tpu {theirs['version']}"
    if "error" in built:
        axes = dict(zip(("dp_replicate", "dp_shard", "cp", "tp"), shape))
        raise ConfigError(
            f"parallelism: {who} cannot lay out the mesh {axes} on {topology}: {built['error']}; allowed: degrees "
            "whose mesh axes are products of the slice's physical axes"
        )
    if layout is None or built["ids"] != port_ids or (built is split) != layout.split:
        report.tpu_mesh = f"built by {who} ({'split axes' if built is split else 'whole axes'}) [port disagrees]"
        report.notes.append(f"mesh: {who} lays out {shape} on {topology} differently from parallelisms/tpu_topology.py")
        return
    report.tpu_mesh = f"{layout.summary()} [{who}]"
    report.notes.extend(f"mesh: {n}" for n in layout.notes())


def check_recipe(path: str, *, capture: bool = True, overrides=(), torch_tpu: dict | None = None) -> RecipeCheck:
    """Check one recipe (module docstring); never raises for the recipe's own faults."""
    t0 = time.perf_counter()
    report = RecipeCheck(recipe=path)
    try:
        cfg = _with_checkpoint_folder(build_config(path, list(overrides)), report)
        devices, device_type, target = world_of(cfg)
        report.devices = devices
        report.target = target.name if target else f"cpu-{devices}"
        if target is not None:
            # a pipeline recipe is priced even where the rules refuse it today (TPU: graph-mode PP
            # not yet), and the first refusal is then the row's error, the rest its notes
            pipelined = cfg.parallelism.pipeline_parallel_degree > 1
            est = planned(cfg, target, check_rules=not pipelined)
            if est.pipeline is not None:
                report.pipeline = pipeline_summary(est)
                report.notes.append(est.pipeline.describe())
                refused = [n[len(REFUSED_NOTE) :] for n in est.notes if n.startswith(REFUSED_NOTE)]
                refused.sort(key=lambda line: not line.startswith("parallelism.pipeline"))  # the pipeline's own first
                report.notes.extend(f"also refused: {line}" for line in refused[1:])
                if refused:
                    report.planned_gib, report.hbm_gib = est.total / GiB, est.usable / GiB
                    raise ConfigError(refused[0])
            report.planned_gib = est.total / GiB
            report.hbm_gib = est.usable / GiB
            report.planned_flips_gib = est.scan_flips / GiB if est.scan_flips else None
            tpu_mesh_check(cfg, report, torch_tpu)
            if target.num_slices > 1 and report.tpu_mesh != "-":
                report.tpu_mesh += f", per slice, x{target.num_slices} over DCN"
        if capture:  # after the planner: the start-up resolves `auto` settings in `cfg`
            start_up(_with_tokenizer(cfg, report), devices=devices, device_type=device_type, report=report)
        else:
            from trainer.job import plan_job

            plan = plan_job(cfg, world_size=devices, device_type=device_type)
            report.mesh = _mesh_summary(plan.parallel_dims)
            report.step = _step_summary(plan.step_plan)
    except ConfigError as e:
        report.error = str(e)
    except Exception as e:  # noqa: BLE001  (a check reports every failure as a row)
        report.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    report.seconds = time.perf_counter() - t0
    return report
