"""`gristmill verify`'s hashing speed against `sha256sum` on the same files.

    python -m bench verify [--mb 512] [--files 8] [--repeats 3] [--smoke]

Commits one artifact of `--files` files of real text (../shared/data/corpus repeated up to `--mb`
MB in all) into a fresh store, then times, in turn within each repeat, on the same files:

  verify     `ArtifactStore.verify()`: every committed file re-hashed against its manifest
  sha256sum  coreutils' `sha256sum` over the same files, one process

The page cache is warm for both (each reads the files once before the first repeat), so this
compares hashing, not the disk. MB/s are medians over `--repeats`. The last line is one JSON
object with the figures and `ratio_vs_sha256sum` (goal >= 0.8).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import smoke
from bench.harness.runs import SHARED_DATA
from bench.tokenize import build_docs


def _store(root: Path, mb: int, files: int) -> tuple[list[Path], int]:
    from gristmill.infra.artifacts import ArtifactStore

    text = "".join(build_docs(SHARED_DATA / "corpus", 4_000_000)).encode()
    each = mb * 1_000_000 // files
    block = (text * (each // len(text) + 1))[:each]

    def compute(partial: Path) -> dict:
        for i in range(files):
            (partial / f"part-{i:03d}.bin").write_bytes(block)
        return {"config": {}, "upstream": {}, "stats": {}, "meta": {}}

    manifest, _ = ArtifactStore(root).materialize("bench", "0" * 12, compute)
    paths = sorted(manifest.path.glob("part-*.bin"))
    return paths, sum(p.stat().st_size for p in paths)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench verify", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = smoke.parse(parser, argv, mb=1, files=2, repeats=1)
    from gristmill.infra.artifacts import ArtifactStore

    with tempfile.TemporaryDirectory(prefix="bench-verify-") as tmp:
        root = Path(tmp)
        paths, total = _store(root, args.mb, args.files)
        store = ArtifactStore(root)
        subprocess.run(["cat", *map(str, paths)], stdout=subprocess.DEVNULL, check=True)  # warm the cache
        methods = {"verify": lambda: store.verify() == [] or sys.exit("the store does not verify"),
                   "sha256sum": lambda: subprocess.run(["sha256sum", *map(str, paths)], check=True,
                                                       stdout=subprocess.DEVNULL)}
        seconds: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(args.repeats):
            for name, method in methods.items():
                start = time.perf_counter()
                method()
                seconds[name].append(time.perf_counter() - start)
    mb_s = {name: total / 1e6 / statistics.median(times) for name, times in seconds.items()}
    print(f"{total / 1e6:.0f} MB in {args.files} files, medians of {args.repeats}")
    for name, rate in mb_s.items():
        print(f"  {name:<10} {rate:8.0f} MB/s")
    print(json.dumps({"mb": round(total / 1e6), "verify_mb_s": round(mb_s["verify"]),
                      "sha256sum_mb_s": round(mb_s["sha256sum"]),
                      "ratio_vs_sha256sum": round(mb_s["verify"] / mb_s["sha256sum"], 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
