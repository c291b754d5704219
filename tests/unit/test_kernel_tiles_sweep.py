"""scripts/bench/sweep_kernel_tiles.py's pick logic (fed made-up costs), its recipe shapes against
the shipped recipes and model flavors, and the shipped tile table's coverage of those shapes.

Pure Python apart from the recipe check (which reads the model flavors): no jax, no compile. The
compile mode itself (libtpu's static profile) is exercised in tests/xla/test_kernels.py."""

from __future__ import annotations

from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import pytest
import sweep_kernel_tiles as sweep  # scripts/bench, on pytest's pythonpath (pyproject.toml)

from titan_kernels.tpu import tiles

ROOT = Path(__file__).resolve().parents[2]


def _row(t, cycles, compiled=True):
    return {"tiles": list(t), "compiled": compiled, "cycles": cycles}


def test_pick_is_the_lowest_compiled_cost_ties_keep_the_first_failures_are_skipped():
    rows = [_row((512, 1024, 768), 300), _row((256, 2048, 768), 100, compiled=False), _row((128, 512, 768), 200)]
    assert sweep.pick_by_cost(rows) == [128, 512, 768]
    rows.append(_row((1024, 1024, 768), 200))  # same cost as an earlier row: the earlier one stays
    assert sweep.pick_by_cost(rows) == [128, 512, 768]
    rows.append(_row((256, 256, 768), 99))
    assert sweep.pick_by_cost(rows) == [256, 256, 768]
    assert sweep.pick_by_cost([_row((128, 128, 128), 5, compiled=False)]) is None
    assert sweep.pick_by_cost([]) is None


def test_splash_pick_takes_forward_and_backward_blocks_from_their_own_costs():
    rows = [
        {"tiles": [512, 512], "fwd_compiled": True, "fwd_cycles": 10, "bwd_compiled": True, "bwd_cycles": 50},
        {"tiles": [1024, 512], "fwd_compiled": True, "fwd_cycles": 8, "bwd_compiled": False, "bwd_cycles": None},
        {"tiles": [256, 1024], "fwd_compiled": True, "fwd_cycles": 12, "bwd_compiled": True, "bwd_cycles": 40},
    ]
    assert sweep.splash_pick(rows) == [1024, 512, 256, 1024]
    assert sweep.cost_of("splash", rows, [1024, 512, 256, 1024]) == 48
    assert sweep.cost_of("splash", rows, [512, 512, 512, 512]) == 60
    assert sweep.cost_of("splash", rows, [1024, 512, 1024, 512]) is None  # that backward did not compile
    assert sweep.splash_pick([{**rows[1], "fwd_compiled": False}]) is None


def test_static_profile_text_is_read_with_equivalent_ops_counted():
    text = (
        'hlo_op_estimate {\n  hlo_op_name: "gmm.1"\n  estimated_cycles: 207422\n  num_equivalent_hlos: 1\n'
        "  dma_instruction_type: DMA_INSTRUCTION_TYPE_LOCAL\n}\n"
        'hlo_op_estimate {\n  hlo_op_name: "fusion.3"\n  estimated_cycles: 100\n  num_equivalent_hlos: 3\n}\n'
    )
    assert sweep.parse_profile_text(text) == {"gmm.1": 207422, "fusion.3": 300}


@pytest.mark.parametrize(
    "m,tm,groups,tiles_",
    [
        (8192, 512, 16, 16),  # 512 rows per group: one tile each
        (8192, 512, 64, 64),  # 128 rows per group: each group alone in its tile
        (1536, 512, 2, 4),  # 768 rows per group: the middle tile is visited by both
        (4096, 1024, 1, 4),
        (2048, 128, 3, 18),  # 682 + 682 + 684 rows: 6 + 6 + 6 tiles touched
    ],
)
def test_balanced_active_tiles_counts_tiles_touched_per_group(m, tm, groups, tiles_):
    assert sweep.balanced_active_tiles(m, tm, groups) == tiles_


def test_compiled_instances_keep_the_per_step_work_and_scale_the_steps_back():
    inst, f = sweep.compiled_instance("gmm", {"m": 65536, "k": 2048, "n": 768, "groups": 16}, (512, 1024, 768))
    assert (inst["m"], inst["groups"], f) == (4096, 1, 16.0)  # rows per group kept: 4096
    inst, f = sweep.compiled_instance("gmm", {"m": 65536, "k": 7168, "n": 2048, "groups": 96}, (512, 1024, 2048))
    assert inst["m"] // inst["groups"] == 65536 // 96 and f == 16.0 and inst["m"] >= 4096
    inst, f = sweep.compiled_instance("fused_ce", {"n": 8192, "vocab": 128256, "dim": 4096}, (512, 1024))
    assert (inst["n"], inst["vocab"], inst["dim"]) == (2048, 8192, 4096)
    assert f == (16 * 126) / (4 * 8)  # 128256 / 1024 -> 126 blocks (padded), 8192 / 1024 -> 8
    inst, f = sweep.compiled_instance("splash", {"seq": 4096, "group": 8, "d": 128, "dv": 128}, (512, 512))
    assert inst["group"] == 1 and inst["seq"] == 4096 and f == 8.0


def _recipe_facts(path: Path) -> dict:
    import models

    cfg = tomllib.loads(path.read_text())
    args = models.FAMILIES[cfg["model"]["name"]].flavors[cfg["model"]["flavor"]]
    par, train = cfg.get("parallelism", {}), cfg["training"]
    facts = dict(
        gen=path.stem.rsplit("_", 1)[1],
        seq=train["seq_len"],
        batch=train["local_batch_size"],
        cp=par.get("context_parallel_degree", 1),
        dim=args.dim,
        vocab=args.vocab_size,
        heads=args.n_heads,
    )
    if hasattr(args, "qk_nope_head_dim"):  # MLA: as many KV heads as query heads
        facts.update(
            kv_heads=args.n_heads, head_dim=args.qk_nope_head_dim + args.qk_rope_head_dim, v_head_dim=args.v_head_dim
        )
    else:
        facts.update(kv_heads=args.n_kv_heads, head_dim=getattr(args, "head_dim", None) or args.dim // args.n_heads)
    if getattr(args, "num_experts", 0):
        facts.update(
            experts=args.num_experts,
            top_k=args.num_experts_per_tok,
            moe_hidden=args.moe_hidden_dim,
            ep=par.get("expert_parallel_degree", 1),
        )
    return facts


def _tpu_recipes() -> list[Path]:
    paths = sorted([*ROOT.glob("configs/*_v6e.toml"), *ROOT.glob("configs/*_v7x.toml")])
    # FLUX: none of these kernels. gpt-oss (the sink splash), Qwen 3.5 (the delta rule, gated
    # attention) and DeepSeek-V4 (its compressed blocks' attention is SDPA, no kernel; its experts'
    # gmm shapes): their kernels' tiles are not swept yet (issue 54); their pod recipes came after the sweep.
    not_swept = {"flux", "gpt_oss", "qwen3_5", "deepseek_v4"}
    return [p for p in paths if tomllib.loads(p.read_text())["model"]["name"] not in not_swept]


def test_the_sweeps_recipe_shapes_are_the_shipped_recipes():
    recipes = _tpu_recipes()
    assert {p.stem for p in recipes} == set(sweep.RECIPES)
    for path in recipes:
        want = dict(sweep.RECIPES[path.stem])
        dropless = want.pop("dropless", None)
        want.setdefault("v_head_dim", want["head_dim"])
        facts = _recipe_facts(path)
        facts.setdefault("v_head_dim", facts["head_dim"])
        assert facts == want, path.stem
        if "experts" in facts:  # gmm's shapes: the dropless settings the recipe's header names
            header = "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
            assert "capacity_factor = 0" in header, path.stem
            assert f"local_batch_size = {dropless['batch']}" in header.replace("\n# ", " "), path.stem
            if dropless["ep"] != facts["ep"]:
                assert f"expert_parallel_degree = {dropless['ep']}" in header.replace("\n# ", " "), path.stem


@pytest.mark.parametrize("kernel", sweep.KERNELS)
@pytest.mark.parametrize("gen", ["v6e", "v7x"])
def test_the_shipped_table_has_an_entry_for_every_recipe_shape(kernel, gen):
    """Each class the recipes of a generation use has its own entry (a compiled-cost pick), and
    the kernels' look-up at the recipe's shape returns tiles the sweep compiled."""
    table = tiles.load_table()
    source = table["source"][gen]
    # Each class is named in the source: compiled ("--mode compile (...)") or, where the
    # 2026-12-05 sweep did not reach it, "rule's pick written as is, not compiled in time (...)".
    assert "commit" in source, source
    for cls in sweep.recipe_shapes(kernel, gen):
        entries = table[kernel][gen]
        assert cls["class"] in entries, (kernel, gen, cls["class"], cls["instances"][0]["recipes"])
        assert f"{kernel} {cls['class']}" in source, (kernel, gen, cls["class"])
        inst = cls["instances"][0]
        got = sweep.current_pick(kernel, gen, inst, table)
        assert list(got) == entries[cls["class"]] or kernel == "gmm" and list(got)[1:] == entries[cls["class"]][1:]


@pytest.mark.parametrize("seq", [128, 256, 384, 640, 1024, 4096, 8192, 131072])
def test_splash_blocks_default_is_the_old_rule(seq):
    old = next(b for b in (512, 256, 128) if seq % b == 0)
    assert tiles.splash_blocks(None, seq, 128) == (old,) * 4
    assert tiles.splash_blocks("v4", seq, 128) == (old,) * 4


def test_splash_blocks_take_the_table_entry_cut_to_the_sequence():
    table = {
        "splash": {
            "v6e": {"default": [512] * 4, "s8192d128": [1024, 2048, 512, 1024]},
            "unknown": {"default": [512] * 4},
        },
        "gmm": {},
        "fused_ce": {},
    }
    assert tiles.splash_blocks("v6e", 8192, 128, table=table) == (1024, 2048, 512, 1024)
    assert tiles.splash_blocks("v6e", 8192, 192, table=table) == (512,) * 4  # another class: the default
    assert tiles.splash_blocks("v6e", 4096 + 128, 128, table=table) == (128,) * 4
    with pytest.raises(ValueError, match="multiple of 128"):
        tiles.splash_blocks("v6e", 1000, 128, table=table)


def test_written_table_keeps_other_entries_and_records_the_source(tmp_path):
    out = tmp_path / "tiles.toml"
    sweep.write_table(
        out,
        {"splash": {"v5p": {"s4096d128": [1024, 512, 512, 512]}}, "gmm": {"v5p": {"2048x768": [256, 1024, 768]}}},
        {"v5p": "sweep_kernel_tiles.py --mode compile (gmm, splash): test, 2026-12-05, commit abc"},
    )
    table = tiles.load_table(str(out))
    shipped = tiles.load_table()
    assert table["splash"]["v5p"]["s4096d128"] == [1024, 512, 512, 512]
    assert table["splash"]["v5p"]["default"] == [512] * 4 and "unknown" in table["splash"]
    assert table["gmm"]["v5p"]["2048x768"] == [256, 1024, 768]
    assert table["fused_ce"] == shipped["fused_ce"]
    assert table["source"]["v5p"].endswith("commit abc") and table["source"]["v6e"] == shipped["source"]["v6e"]
    assert tiles.splash_blocks("v5p", 4096, 128, table=table) == (1024, 512, 512, 512)
