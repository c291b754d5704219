"""`trainer.step.plan_step`: the one place that decodes `[compile] mode` and refuses combinations.

The trainer reads what the mode decides (backend, where activation checkpointing goes, block
compile, scan, loss parallel) from the StepPlan only; these tests pin that decision table and
the rule table (`RULES`) the trainer, the engine and the planner read.
"""

import pytest
import torch

from models.errors import ConfigError
from trainer.step import RULES, StepRequest, plan_step, refusals, resolve_backend
from trainer.step.quantize import QuantizeCensus


def _plan(**kw):
    base = dict(
        mode="eager",
        backend="auto",
        scan_layers=False,
        ac_mode="none",
        loss_parallel=False,
        tp_degree=1,
        device_type="cpu",
    )
    return plan_step(**{**base, **kw})


def test_eager_compiles_nothing_and_checkpoints_blocks():
    plan = _plan(ac_mode="full")
    assert (plan.backend, plan.block_compile, plan.block_ac, plan.scan, plan.scan_ac) == (
        None,
        None,
        "full",
        False,
        "none",
    )


def test_compile_mode_compiles_blocks_with_the_resolved_backend():
    plan = _plan(mode="compile", ac_mode="selective")
    assert plan.backend == plan.block_compile == "inductor" and plan.block_ac == "selective"
    assert _plan(mode="compile", device_type="tpu").backend == "tpu"


def test_graph_mode_checkpoints_in_the_same_place_unless_scanned():
    unrolled = _plan(mode="graph", ac_mode="full")
    assert unrolled.block_ac == "full" and unrolled.scan_ac == "none" and unrolled.block_compile is None
    scanned = _plan(mode="graph", scan_layers=True, ac_mode="full")
    assert scanned.block_ac == "none" and scanned.scan_ac == "full" and scanned.scan
    assert _plan(mode="graph", backend="eager").backend == "aot_eager"
    # MoE blocks scan too (their aux loss is a per-layer scan output), also with experts sharded.
    assert _plan(mode="graph", scan_layers=True).scan


def test_loss_parallel_needs_tensor_parallelism():
    assert not _plan(loss_parallel=True).loss_parallel
    assert _plan(loss_parallel=True, tp_degree=2).loss_parallel
    assert _plan(mode="graph", loss_parallel=True, tp_degree=2).loss_parallel


@pytest.mark.parametrize(
    "kw, pattern",
    [
        (dict(scan_layers=True), "compile.scan_layers: needs compile.mode"),
        (dict(mode="compile", scan_layers=True), "compile.scan_layers"),
        (dict(mode="jit"), "compile.mode"),
        (dict(mode="graph", backend="tpu"), "compile.backend: tpu needs a TPU"),
        (dict(mode="compile", backend="xla"), "compile.backend"),
        (dict(loss_parallel=True, task="flow"), "parallelism.enable_loss_parallel: shards an LM's vocabulary"),
        (dict(mode="graph", caller_loss=True), 'compile.mode: "graph" captures the LM loss'),
        (dict(fused_loss="on", model_has_hidden=True, caller_loss=True), "training.fused_loss: on never forms"),
        (dict(task="flow", caller_loss=True), "model.name: the engine trains language models"),
        (dict(task="diffusion"), "model.name: the family declares task 'diffusion'"),
    ],
)
def test_refused_combinations(kw, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _plan(**kw)


def test_scan_accepts_tensor_parallelism():
    # The scan body runs the decoder TP styles on local tensors (parallelisms/scan.py).
    plan = _plan(mode="graph", scan_layers=True, tp_degree=2, loss_parallel=True)
    assert plan.scan and plan.loss_parallel


def test_backend_resolution_is_one_rule():
    assert resolve_backend("auto", mode="compile", device_type="cuda") == "inductor"
    assert resolve_backend("eager", mode="compile", device_type="cpu") == "eager"
    assert resolve_backend("eager", mode="graph", device_type="cpu") == "aot_eager"


def test_fused_loss_choice():
    assert not _plan(fused_loss="auto", model_has_hidden=True).fused_loss  # CPU: plain by default
    assert _plan(fused_loss="auto", model_has_hidden=True, device_type="tpu").fused_loss
    assert _plan(fused_loss="on", model_has_hidden=True).fused_loss
    assert not _plan(fused_loss="auto", model_has_hidden=True, device_type="tpu", tp_degree=2).fused_loss
    assert not _plan(fused_loss="auto", model_has_hidden=False, device_type="tpu").fused_loss
    with pytest.raises(ConfigError, match="training.fused_loss: on needs the whole vocabulary"):
        _plan(fused_loss="on", model_has_hidden=True, tp_degree=2)
    with pytest.raises(ConfigError, match="training.fused_loss: on needs a model with hidden"):
        _plan(fused_loss="on")
    # The engine reads logits: auto never fuses for it, even on a TPU.
    assert not _plan(fused_loss="auto", model_has_hidden=True, device_type="tpu", caller_loss=True).fused_loss


def test_every_rule_refuses_something_and_names_a_config_key():
    """Each rule of the table is reachable: a request it refuses, and a message that names a
    `section.key` of the config (what the user changes)."""
    from dataclasses import fields

    from trainer.config import Config

    sections = {
        f.name: {g.name for g in fields(f.type if isinstance(f.type, type) else type(getattr(Config(), f.name)))}
        for f in fields(Config)
    }
    examples = [
        StepRequest(mode="jit"),
        StepRequest(backend="xla"),
        StepRequest(fused_loss="maybe"),
        StepRequest(task="x"),
        StepRequest(mode="graph", backend="tpu"),
        StepRequest(scan_layers=True),
        StepRequest(fused_loss="on", tp_degree=2, model_has_hidden=True),
        StepRequest(fused_loss="on"),
        StepRequest(loss_parallel=True, task="flow"),
        StepRequest(mode="graph", caller_loss=True),
        StepRequest(fused_loss="on", model_has_hidden=True, caller_loss=True),
        StepRequest(task="flow", caller_loss=True),
        StepRequest(document_positions="first"),
        StepRequest(document_positions="restart"),
        StepRequest(document_mask=True, task="flow"),
        StepRequest(document_mask=True),
        StepRequest(document_mask=True, model_document_mask=True, caller_loss=True),
        StepRequest(cp_degree=2, task="flow"),
        StepRequest(cp_degree=2),
        StepRequest(cp_degree=2, model_document_mask=True, caller_loss=True),
        StepRequest(qk_clip=True, mode="graph"),
        StepRequest(ac_offload="all"),
        StepRequest(ac_offload="block_inputs", mode="graph", scan_layers=True, ac_mode="selective"),
        StepRequest(qk_clip=True, cp_degree=2),
        StepRequest(cp_degree=2, model_document_mask=True, device_type="tpu", seq_len=1000),
        StepRequest(cp_degree=2, model_document_mask=True, seq_len=8, linear_conv_halo=3),
        StepRequest(moe_routing="top1"),
        StepRequest(moe_routing="random"),
        StepRequest(moe_routing="random", model_has_experts=False),
        StepRequest(moe_routing="random", routing_benchmark_only=True, grad_accum=2),
        StepRequest(attn_backend="cpu_kernel", device_type="tpu"),
        StepRequest(attn_backend="splash"),
        StepRequest(attn_backend="cpu_kernel", model_attn_backends=("auto", "sdpa")),
        StepRequest(tp_degree=2, tp_refusal="no plan"),
        StepRequest(qk_clip=True, optimizer="adamw"),
        StepRequest(flow_shift=3.0, flow_resolution_shift=True),
        StepRequest(initial_load_format="hf", model_has_hf_adapter=False),
        StepRequest(num_slices=2, dp_replicate=1),
        StepRequest(recipe_num_slices=3, target_num_slices=2),
        StepRequest(num_slices=2, dp_replicate=1, allow_dcn_sharding=True, local_checkpoint=True),
        StepRequest(moe_capacity_factor=-1.0),
        StepRequest(moe_capacity_factor=1.25, model_has_experts=False),
        StepRequest(moe_capacity_factor=1.25, cp_degree=2),
        StepRequest(moe_dispatch_chunks=2),
        StepRequest(quantize="fp4"),
        StepRequest(quantize="int8", device_type="tpu", device_generation="v7x"),
        StepRequest(quantize="float8_blockwise", device_type="cuda"),
        StepRequest(quantize="float8_rowwise", device_type="cuda", device_generation="sm80"),
        StepRequest(quantize="float8_rowwise", fsdp_float8_all_gather=True),
        StepRequest(replicate_reduce_dtype="bfloat16"),
        StepRequest(quantize="int8", quantize_census=QuantizeCensus(1024, ("output",), 3, 0, 1, 2)),
        StepRequest(quantize="int8", quantize_census=QuantizeCensus(0, ("output",), 3, 0, 3, 0)),
        StepRequest(mtp_depth=1, tp_degree=2),
        StepRequest(indexer_loss=True, tp_degree=2),
        StepRequest(pp_schedule="Bogus"),
        StepRequest(pp_degree=2, mode="graph"),
        StepRequest(pp_degree=2, mode="graph", n_layers=7),
        StepRequest(pp_degree=2, device_type="tpu"),
        StepRequest(pp_degree=2, mode="compile", pp_schedule="ZBVZeroBubble"),
        StepRequest(pp_degree=2, mode="graph", pp_schedule="GPipe", tp_degree=2),
        StepRequest(pp_degree=2, tp_degree=2, loss_parallel=True),
        StepRequest(pp_degree=2, cp_degree=2, mode="graph"),
        StepRequest(pp_degree=2),
        StepRequest(pp_degree=2, model_has_experts=False, replicate_reduce="step"),
        StepRequest(pp_degree=2, moe_routing="random"),
        StepRequest(pp_degree=2, tie_embeddings=True),
        StepRequest(pp_degree=2, model_has_experts=False, num_slices=2),
        StepRequest(pp_degree=2, model_has_experts=False, device_order="v6e-8"),
        StepRequest(pp_degree=2, model_has_experts=False, pp_schedule="GPipe", pp_virtual_stages=2),
        StepRequest(pp_degree=4, model_has_experts=False, n_layers=2),
        StepRequest(pp_degree=2, model_has_experts=False, local_batch=3),
        StepRequest(pp_degree=2, model_has_experts=False, pp_microbatches=1),
        StepRequest(pp_degree=2, model_has_experts=False, pp_schedule="Interleaved1F1B", pp_microbatches=5),
        StepRequest(pp_scan_iterations=True),
        StepRequest(pp_degree=2, mode="graph", pp_scan_iterations=True, scan_layers=True),
    ]
    hit = {id(rule) for request in examples for rule in RULES if rule.refuses(request)}
    assert hit == {id(rule) for rule in RULES}, [r.key for r in RULES if id(r) not in hit]
    # `[model]` also takes any field of the family's args (e.g. deepseek_v3's mtp_depth).
    from models import FAMILIES

    model_args = {g.name for family in FAMILIES.values() for g in fields(family.args_cls)}
    for rule in RULES:
        section, key = rule.key.split(".")
        assert key in sections[section] or (section == "model" and key in model_args), rule.key
        assert rule.when and "allowed" in rule.why, rule  # `key: what is wrong; allowed: ...`
    assert refusals(StepRequest()) == []


def _cfg(recipe="configs/llama3_debug.toml", **overrides):
    from trainer.config import build_config

    return build_config(recipe, [(k.replace("__", "."), v) for k, v in overrides.items()])


@pytest.mark.parametrize(
    "overrides, device_type, pattern",
    [
        # QK clip is part of the Muon step (was trainer/optim/build.py).
        (
            dict(optimizer__qk_clip_tau="100"),
            "cpu",
            r"^optimizer\.qk_clip_tau: > 0 is MuonClip, part of the Muon step; optimizer\.name is \'adamw\'; "
            r'allowed: 0, or optimizer\.name = "muon"$',
        ),
        (
            dict(optimizer__name="muon", optimizer__qk_clip_tau="100", compile__mode="graph"),
            "cpu",
            r"^optimizer\.qk_clip_tau: > 0 runs in the eager step only .*; allowed with compile\.mode = \"graph\": 0$",
        ),
        # Attention kernels that serve one device (was titan_kernels/__init__.py).
        (
            dict(model__attn_backend="splash"),
            "cpu",
            r"^model\.attn_backend: splash runs on TPU only, not on cpu; "
            r"allowed here: auto, sdpa, cpu_kernel$",
        ),
        (dict(model__attn_backend="splash"), "cuda", r"^model\.attn_backend: splash .* allowed here: auto, sdpa$"),
        (
            dict(model__attn_backend="cpu_kernel"),
            "tpu",
            r"^model\.attn_backend: cpu_kernel runs on the CPU only, not "
            r"on tpu; allowed here: auto, sdpa, splash$",
        ),
        # HF weights for a family without hf_adapter.py (was trainer/checkpoint/initial.py, after the build).
        (
            dict(
                model__name="tests.support.toy_family:TOY",
                model__flavor="debugmodel",
                checkpoint__initial_load_path="/nonexistent",
                checkpoint__initial_load_format="hf",
            ),
            "cpu",
            r"^checkpoint\.initial_load_format: 'hf' is not supported for this model \(no hf_adapter\.py\); allowed: dcp$",
        ),
        # Two keys of [flow] (was trainer/config/load.py).
        (
            dict(flow__shift="3", flow__resolution_shift="true"),
            "cpu",
            r"^flow\.shift: 3\.0 with flow\.resolution_shift = true sets the shift twice; allowed: 1\.0 with ",
        ),
    ],
)
def test_moved_refusals_are_rules_with_one_message(overrides, device_type, pattern):
    """Refusals that lived in other modules are rules: `plan_job` refuses them with one message
    naming the key (the `error:` line), and `refusals` lists exactly that one."""
    import re

    from trainer.config import resolve_model_args
    from trainer.job import plan_job, step_request

    recipe = "configs/flux_debug.toml" if "flow__shift" in overrides else "configs/llama3_debug.toml"
    cfg = _cfg(recipe, **overrides)  # the config loads: only the rules refuse it
    with pytest.raises(ConfigError, match=pattern) as e:
        plan_job(cfg, world_size=1, device_type=device_type)
    assert "\n" not in str(e.value)
    family, _ = resolve_model_args(cfg.model, seq_len=cfg.training.seq_len)
    found = refusals(step_request(cfg, family, device_type=device_type))
    assert len(found) == 1 and re.match(pattern, found[0]), found


def test_tp_on_an_hf_model_without_a_plan_is_a_rule(tmp_path):
    """TP with an hf-backend architecture whose TP plan does not translate (was
    trainer/config/load.py): the config loads, `plan_job` refuses, with the reason of
    models/hf/plan.py `tp_refusal`; at TP 1 the same model plans."""
    pytest.importorskip("transformers")
    from tests.support.hf_configs import write_config
    from trainer.job import plan_job

    phi3 = write_config(str(tmp_path), "phi3")
    hf = dict(model__name="hf", model__flavor="config", model__hf_config=phi3)
    cfg = _cfg(**hf, parallelism__tensor_parallel_degree="2")
    with pytest.raises(
        ConfigError,
        match=r"^parallelism\.tensor_parallel_degree: Phi3ForCausalLM's "
        r"base_model_tp_plan uses style 'colwise_gather_output'.*; "
        r"allowed for this model: 1$",
    ):
        plan_job(cfg, world_size=2, device_type="cpu")
    plan_job(_cfg(**hf), world_size=1, device_type="cpu")


def test_rule_messages_name_the_registry_s_document_mask_families():
    """The families a message names as having `ModelFamily.document_mask` are the registry's
    (computed: adding a family updates them)."""
    import re

    from models import FAMILIES

    registry = {name for name, family in FAMILIES.items() if family.document_mask}
    named = [rule for rule in RULES if "ModelFamily.document_mask" in rule.why]
    assert len(named) == 2, [r.key for r in named]
    for rule in named:
        listed = re.search(r"ModelFamily\.document_mask: ([^;)]*)", rule.why).group(1)
        assert set(listed.split(", ")) == registry, (rule.key, listed)


def test_old_sites_assert_what_the_rules_refuse(tmp_path):
    """Where a moved refusal is re-checked after the rules ran, it is an internal assert."""
    import titan_kernels
    from trainer.checkpoint.initial import load_initial
    from trainer.optim import build_optimizer_for

    (tmp_path / "model.safetensors").write_bytes(b"")

    with pytest.raises(AssertionError, match="RULES"):
        titan_kernels.check_attention_for("splash", "cpu")
    with pytest.raises(AssertionError, match="RULES"):
        load_initial(torch.nn.Linear(2, 2), path=tmp_path, fmt="hf", hf_adapter=None)
    with pytest.raises(AssertionError, match="RULES"):
        build_optimizer_for(
            torch.nn.Linear(2, 2),
            name="adamw",
            lr=1e-3,
            betas=(0.9, 0.95),
            eps=1e-8,
            weight_decay=0.0,
            qk_clip_tau=100.0,
        )


def _names_key(module, source: str, key: str) -> bool:
    """`source` names `key`: literally, or through a module constant holding it (`CP_KEY`, `_KEYS[...]`)."""
    import re

    if key in source:
        return True
    for name, value in vars(module).items():
        holds = value == key if isinstance(value, str) else isinstance(value, dict) and key in value.values()
        if holds and re.search(rf"\b{re.escape(name)}\b", source):
            return True
    return False


def test_build_checks_name_functions_that_refuse_their_key():
    """Each entry of BUILD_CHECKS names a function that exists and raises a ConfigError naming
    the entry's key (read from its source)."""
    import importlib
    import inspect
    import re

    from trainer.step.checks import BUILD_CHECKS

    assert len({(c.key, c.where) for c in BUILD_CHECKS}) == len(BUILD_CHECKS)
    for check in BUILD_CHECKS:
        module_name, _, path = check.where.partition(":")
        module = importlib.import_module(module_name)
        obj = module
        for part in path.split("."):
            obj = getattr(obj, part)
        source = inspect.getsource(obj)
        raised = [getattr(module, name, None) for name in re.findall(r"raise (\w+)\(", source)]
        assert any(isinstance(e, type) and issubclass(e, ConfigError) for e in raised), check.where
        assert _names_key(module, source, check.key), (check.key, check.where)
        assert check.what, check


def test_a_local_checkpoint_tier_needs_a_whole_replica_per_slice():
    """checkpoint.local_folder on slices that shard the model (allow_dcn_sharding) is refused by a
    rule before anything is built (it was refused by build_checkpoint_manager, after the mesh),
    with the same message; HSDP slices and a run without the tier pass."""
    sharded = dict(num_slices=2, dp_replicate=1, allow_dcn_sharding=True)
    (message,) = refusals(StepRequest(local_checkpoint=True, **sharded))
    assert message == (
        "checkpoint.local_folder: the 2 slices shard the model (parallelism.allow_dcn_sharding with "
        "data_parallel_replicate_degree 1), so no slice holds a whole replica to restore a lost one from; "
        "allowed: a data_parallel_replicate_degree that is a multiple of num_slices, or an empty local_folder"
    )
    assert refusals(StepRequest(**sharded)) == []
    assert refusals(StepRequest(local_checkpoint=True, num_slices=2, dp_replicate=4)) == []
    from trainer.job import plan_job

    cfg = _cfg(
        parallelism__num_slices="2",
        parallelism__allow_dcn_sharding="true",
        checkpoint__enable="true",
        checkpoint__local_folder="/tmp/local-tier",
    )
    with pytest.raises(ConfigError, match=r"^checkpoint\.local_folder: the 2 slices shard the model"):
        plan_job(cfg, world_size=4, device_type="cpu")


def test_context_parallel_chunks_hold_whole_splash_tiles_on_tpu():
    """seq_len / (2 cp) tokens per chunk: on TPU a multiple of splash's 128-token tile, refused
    before anything is built (the kernel asserts it mid-trace); elsewhere any chunk runs (SDPA)."""
    cp = dict(model_document_mask=True, device_type="tpu")
    (message,) = refusals(StepRequest(cp_degree=4, seq_len=1000, **cp))
    assert message.startswith("training.seq_len: 1000 with parallelism.context_parallel_degree = 4 "), message
    assert "= 125 tokens" in message and "multiple of 2 * cp * 128 = 1024" in message, message
    assert "\n" not in message
    assert refusals(StepRequest(cp_degree=2, seq_len=8192 + 128, **cp))  # chunks of 2080: not whole tiles
    for seq, degree in ((8192, 2), (131072, 8), (3072, 4), (256, 1), (1000, 1)):
        assert refusals(StepRequest(cp_degree=degree, seq_len=seq, **cp)) == [], (seq, degree)
    assert refusals(StepRequest(cp_degree=4, seq_len=1000, model_document_mask=True, device_type="cpu")) == []
    with pytest.raises(ConfigError, match=r"^training\.seq_len: "):
        plan_step(StepRequest(cp_degree=4, seq_len=1000, **cp))


def test_the_cp_tile_is_splash_s():
    """The rule's tile is the one titan_kernels/tpu/splash.py asserts: its `TILE` is tiles.py's
    `SPLASH_TILE` (splash.py read as text, tiles.py imported: neither needs jax here)."""
    import re
    from pathlib import Path

    from titan_kernels.tpu.tiles import SPLASH_TILE
    from trainer.step.plan import CP_TILE

    text = (Path(__file__).resolve().parents[2] / "titan_kernels" / "tpu" / "splash.py").read_text()
    assert re.search(r"^TILE = tiles\.SPLASH_TILE$", text, re.M), "splash.py's TILE is no longer tiles.SPLASH_TILE"
    assert SPLASH_TILE == CP_TILE


def test_ac_offload_needs_graph_scan_and_full_checkpointing():
    """`[activation_checkpoint] offload = "block_inputs"` rewrites the layer scan's saved block
    inputs (trainer/graph/passes.py `offload_block_inputs_pass`): one rule refuses it elsewhere
    with one line naming the key, and the plan carries it to the scanned step only."""
    from trainer.job import plan_job

    graph = dict(compile__mode="graph", compile__scan_layers="true", activation_checkpoint__offload="block_inputs")
    for ac in ("none", "selective", "full_save_attention"):
        with pytest.raises(
            ConfigError, match=r"^activation_checkpoint\.offload: block_inputs needs .*allowed otherwise: none$"
        ):
            plan_job(_cfg(**graph, activation_checkpoint__mode=ac), world_size=1, device_type="cpu")
    with pytest.raises(ConfigError, match=r"^activation_checkpoint\.offload: block_inputs needs"):
        plan_job(
            _cfg(**{**graph, "compile__scan_layers": "false"}, activation_checkpoint__mode="full"),
            world_size=1,
            device_type="cpu",
        )
    plan = plan_job(_cfg(**graph, activation_checkpoint__mode="full"), world_size=1, device_type="cpu")
    assert plan.step_plan.scan_offload == "block_inputs"
    assert _plan(mode="graph", scan_layers=True, ac_mode="full").scan_offload == "none"
