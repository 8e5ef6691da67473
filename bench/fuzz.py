"""Fuzzing the collect stage's readers and cleaning chain with damaged input files
(bench/harness/fuzz.py says what a trial checks).

    python -m bench.fuzz [--trials 20] [--seed 0] [--workdir DIR]

It prints the first failures, then one JSON line: {"trials", "survived", "docs_lost",
"records_unread", "faults"}; it exits 1 unless every trial survived.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

from bench.harness.fuzz import run_fuzz


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where trials run (default: a temporary folder, removed)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="bench-fuzz-") as tmp:
        result = run_fuzz(args.trials, args.seed, args.workdir or Path(tmp))
    for failure in result["failures"]:
        print(failure)
    print(f"{result['survived']} of {result['trials']} trials survived; docs lost "
          f"{result['docs_lost']}, records unread {result['records_unread']}")
    print(json.dumps({k: v for k, v in result.items() if k != "failures"}))
    return 0 if result["survived"] == result["trials"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
