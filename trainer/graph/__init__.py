"""The graph trainer: the whole train step captured as one FX graph, with layer scan.

`build_graph_step(...)` returns a `GraphStep` with the eager step's call shape. See
docs/graph_trainer.md for the capture route, the scan transform, the passes and backends.
"""

from trainer.graph.step import GraphStep, build_graph_step

__all__ = ["GraphStep", "build_graph_step"]
