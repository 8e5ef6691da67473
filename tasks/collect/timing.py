"""Where a collect worker's time goes: the seconds it spends before its first document (its cold
start, `load_worker`) and, after that, per step of a record's path (core/clock.py's `StepClock`).

Both travel in each work unit's result file (stage.py) and reach the stage's stats summed over
the units, so `python -m bench scale` can set them beside datatrove's own per-block timings
without timing anything from outside.

The per-record steps, in the chain's order (a step a record does not reach costs it nothing):
  read_extract     reading the record from its file, trafilatura (HTML) and ftfy
  url_filter       the URL block list
  language_id      fastText on the text's prefix
  quality_filters  Gopher quality and repetition, FineWeb, C4 (their words, lines and n-grams)
  pii              scrubbing the kept text
  decontamination  the benchmark n-gram lookup
  quality_model    a quality model trained before (when one is given)
  write            the kept document's line and the record's event
"""
from __future__ import annotations

from collections import defaultdict

from gristmill.core.clock import StepClock

# A tiny page that takes trafilatura's and ftfy's whole path once, so their lazy set-up is paid here.
_PAGE = (b"<html><head><title>t</title></head><body><nav>home</nav><article><p>"
         + b"A first sentence of a short article about nothing at all. " * 12
         + b"</p></article><footer>(c)</footer></body></html>")


def load_worker() -> dict[str, float]:
    """Load what every record needs, in the order a first record would, each part timed on its
    own: spaCy's import, its word tokenizer (blank English with the sentencizer, one text
    tokenized), the fastText model, and trafilatura with ftfy (one page extracted). A process
    pays this once; the parts already loaded cost ~0 here."""
    from gristmill.tasks.collect.clean import langid, rules
    from gristmill.tasks.collect.read.readers import extract_text
    from gristmill.tasks.collect.read.records import RawDoc

    clock = StepClock()
    rules.import_spacy()
    clock.lap("spacy_import")
    rules.split_words("A first sentence, tokenized.")
    clock.lap("word_tokenizer")
    langid.load_model()
    clock.lap("fasttext")
    extract_text(RawDoc(url="http://example.com/", payload=_PAGE, is_html=True, nbytes=len(_PAGE)))
    clock.lap("trafilatura")
    return clock.rounded()


class Timing:
    """A stage run's timing: the per-record steps summed over its units (the seconds of the
    workers that ran them), the corpus-level steps as the driver saw them (wall seconds of each
    whole map on the engine), and the cold start of each process that ran a unit."""

    def __init__(self) -> None:
        self.steps: defaultdict[str, float] = defaultdict(float)
        self.corpus = StepClock()
        self.cold_starts: list[dict[str, float]] = []

    def add_unit(self, line: dict[str, dict[str, float]]) -> None:
        """One unit's timing line (stage.py's TIMING)."""
        for step, seconds in line["steps"].items():
            self.steps[step] += seconds
        if line["cold_start"]:
            self.cold_starts.append(line["cold_start"])

    def stats(self) -> dict[str, float]:
        """`step_s_<step>` (per-record steps: the sum over units; corpus steps: wall seconds),
        `cold_start_s_<part>` (the mean over the processes that loaded the worker; parts a
        process had already loaded count as ~0) and `cold_start_processes`."""
        seconds = {**self.steps, **self.corpus.seconds}
        out: dict[str, float] = {f"step_s_{step}": round(s, 6) for step, s in seconds.items()}
        parts = sorted({part for cold in self.cold_starts for part in cold})
        for part in parts:
            out[f"cold_start_s_{part}"] = round(sum(c.get(part, 0.0) for c in self.cold_starts)
                                                / len(self.cold_starts), 3)
        out["cold_start_processes"] = len(self.cold_starts)
        return out
