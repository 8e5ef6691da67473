"""A collect worker's cold start: the seconds a fresh process spends before its first document is
cleaned, part by part, against the same start with spaCy imported as thinc imports it (torch too).

    python -m bench worker-start [--rounds 7] [--smoke]

Each round starts two fresh Python processes in turn (which first alternates), each timing, from its
first line of code:

  imports         `import gristmill.tasks.collect.stage` (what a Ray worker unpickling a unit does)
  spacy_import    `import spacy` (tasks/collect/clean/rules.py `import_spacy`)
  word_tokenizer  spacy.blank("en") with the sentencizer, one text tokenized
  fasttext        lid.176.ftz loaded
  trafilatura     one page through trafilatura and ftfy (their lazy set-up)
  first_document  the first HTML record of ../shared/data's dolma_wget WARC through `document_events`

`ours` is the stage's own start (`load_worker`, spaCy imported with torch hidden from thinc);
`with_torch` imports spaCy plainly first, as before, so thinc imports torch. `python` is the
interpreter's start: from this parent launching the process to its first line (wall clocks).
Figures are medians over the rounds. The last line is one JSON object with `cold_start_s` (ours,
every part, python included), `cold_start_with_torch_s`, `speedup` (with_torch ÷ ours), and
`parts_s` / `parts_with_torch_s` (each part's median), and the CPU it ran on (`cpu`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from bench import smoke
from bench.harness.runs import REPO, SHARED_DATA, cpu_description

MODES = ("ours", "with_torch")
PARTS = ("imports", "spacy_import", "word_tokenizer", "fasttext", "trafilatura", "first_document")
FIRST_RECORD_FROM = SHARED_DATA / "warc" / "dolma_wget" / "sample-0000.warc.gz"


# A fresh process's start (the module docstring); run with `python -c` so that nothing but what it
# times is imported before it. argv: mode, the WARC file.
CHILD = """
import time
launched = time.time()
import json, sys
started = time.perf_counter()
import gristmill.tasks.collect.stage as collect
parts = {"imports": time.perf_counter() - started}
if sys.argv[1] == "with_torch":
    import spacy  # plainly: thinc imports torch
    parts["spacy_import"] = time.perf_counter() - started - parts["imports"]
from gristmill.tasks.collect.read.readers import RawDoc, read_file
for part, seconds in collect.load_worker().items():
    parts[part] = parts.get(part, 0.0) + seconds
record = next(r for r in read_file(sys.argv[2]) if isinstance(r, RawDoc) and r.is_html)
clock = time.perf_counter()
collect.document_events([record], collect.Config())
parts["first_document"] = time.perf_counter() - clock
print(json.dumps({"launched": launched, "parts": parts}))
"""


def one_start(mode: str) -> dict[str, float]:
    started = time.time()
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, str(FIRST_RECORD_FROM)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"worker-start child ({mode}) failed:\n{proc.stderr[-3000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"python": got["launched"] - started, **got["parts"]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench worker-start", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = smoke.parse(parser, argv, rounds=1)
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            runs[mode].append(one_start(mode))
    medians = {mode: {part: statistics.median(run[part] for run in runs[mode]) for part in ("python", *PARTS)}
               for mode in MODES}
    totals = {mode: statistics.median(sum(run.values()) for run in runs[mode]) for mode in MODES}
    cpu = cpu_description()
    print(f"a collect worker's cold start, median of {args.rounds} fresh processes each ({cpu['model']}, "
          f"{cpu['capability']})")
    print(f"{'part':<16}{'ours s':>10}{'with torch s':>14}")
    for part in ("python", *PARTS):
        print(f"{part:<16}{medians['ours'][part]:>10.3f}{medians['with_torch'][part]:>14.3f}")
    print(f"{'total':<16}{totals['ours']:>10.3f}{totals['with_torch']:>14.3f}")
    print(json.dumps({
        "bench": "worker-start", "rounds": args.rounds, "cpu": cpu,
        "cold_start_s": round(totals["ours"], 3), "cold_start_with_torch_s": round(totals["with_torch"], 3),
        "speedup": round(totals["with_torch"] / totals["ours"], 3),
        "parts_s": {p: round(s, 3) for p, s in medians["ours"].items()},
        "parts_with_torch_s": {p: round(s, 3) for p, s in medians["with_torch"].items()},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
