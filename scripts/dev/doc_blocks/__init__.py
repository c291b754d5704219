"""The renderers of scripts/dev/gen_doc_blocks.py, by page family: `layout` (the code's layout, recipe
sections, rules, layer imports, the test schedule), `planner` (recipes planned as shipped, planner
searches) and `results` (tables read from docs/results/ CSVs)."""
