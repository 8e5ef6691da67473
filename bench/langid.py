"""Language-ID accuracy of the cleaning chain's fastText model (lid.176.ftz) per language.

    python -m bench langid [--data DIR] [--smoke]

DIR holds `<code>.txt` files of labelled sentences, one a line (default: ../shared/data/
multilingual/lingua_sentences, 300 sentences for each of 75 languages). Prints a table, weakest
first, with each language's most frequent wrong answers, then one JSON line: overall accuracy
(micro-average over the languages the model has a label for), sentences per second, the
unsupported languages, and accuracy per language.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench import smoke
from bench.harness.runs import SHARED_DATA


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench langid",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path,
                        default=SHARED_DATA / "multilingual" / "lingua_sentences")
    args = smoke.parse(parser, argv, note="the whole labelled set still: about a second")
    from gristmill.tasks.collect.clean.langid import accuracy_by_language, load_model, overall_accuracy

    load_model()  # time the predictions, not the one-off load
    start = time.perf_counter()
    results = accuracy_by_language(args.data)
    seconds = time.perf_counter() - start
    sentences = sum(r.sentences for r in results.values())
    print(f"{len(results)} languages, {sentences} sentences, {sentences / seconds:.0f} sentences/s")
    print(f"{'lang':<6}{'n':>6}{'accuracy':>10}  most frequent wrong answers")
    for code, r in sorted(results.items(), key=lambda kv: (kv[1].accuracy, kv[0])):
        wrong = ", ".join(f"{lang} {n}" for lang, n in r.top_confusions)
        note = "" if r.supported else "  (no lid.176 label)"
        print(f"{code:<6}{r.sentences:>6}{r.accuracy:>10.3f}  {wrong}{note}")
    print(json.dumps({
        "bench": "langid", "languages": len(results), "sentences": sentences,
        "overall_accuracy": round(overall_accuracy(results), 4),
        "sentences_per_s": round(sentences / seconds),
        "unsupported": sorted(code for code, r in results.items() if not r.supported),
        "accuracy": {code: round(r.accuracy, 4) for code, r in sorted(results.items())},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
