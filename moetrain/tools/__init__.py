"""The tools around the training runtime: benchmarks, the planner, converters, plots, the
dry run, generation. The runtime never imports them (tests/test_import_graph.py)."""
