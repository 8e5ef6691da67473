"""Benchmarks: `python -m bench NAME [options]`.

Each benchmark prints a table; its last line is one JSON object with the headline figures.
Timings are medians over repeats, measured side by side in one run.
"""
from __future__ import annotations

import importlib
import sys

BENCHMARKS = {"pipeline": "bench.pipeline", "tokenize": "bench.tokenize", "pretrain": "bench.pretrain",
              "dedup": "bench.dedup", "langid": "bench.langid", "clean": "bench.clean",
              "claims": "bench.claims", "chaos": "bench.chaos",
              "evaluate": "bench.evaluate", "fidelity": "bench.fidelity", "memory": "bench.memory",
              "verify": "bench.verify", "recipe": "bench.recipe",
              "explain": "bench.explain", "progress": "bench.progress",
              "scale": "bench.scale", "startup": "bench.startup", "store-fuzz": "bench.store_fuzz", "gpu": "bench.gpu",
              "cluster": "bench.cluster", "worker-start": "bench.worker_start"}


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in BENCHMARKS:
        print(f"usage: python -m bench {{{','.join(BENCHMARKS)}}} [options]", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[sys.argv[1]])
    return module.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
