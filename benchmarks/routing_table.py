"""The busiest expert-parallel rank's load and NoSync's drop rates for a recorded routes file,
next to uniform and random routing of its shape (moetrain/tools/bench/route_table.py).

    python benchmarks/routing_table.py RUN/routes [--ep 8] [--rank 0]
    python benchmarks/routing_table.py benchmarks/data/demo_routes.pt
    python benchmarks/routing_table.py OUT.pt --write uniform --preset small [--forwards 16]
"""

from moetrain.tools.bench.route_table import main

if __name__ == "__main__":
    main()
