"""Stage 1, collect and clean: read raw sources (WARC/WET, JSONL, Parquet/Arrow, text, Common
Crawl paths), extract text, filter (language ID, Gopher/C4/FineWeb rules, URL lists, a trained
quality model), scrub PII, dedup (exact, then MinHash-LSH clusters), decontaminate against
benchmarks, and mix sources to token budgets. Every drop is a counted reason in the funnel.

Modules, in the order a document meets them: `readers` (+ `warc`, `tables`, `common_crawl`,
`demo_crawl`), `cleaning` (+ `filters`, `langid`, `pii`), `quality_model`, `dedup`, `decontam`,
`mixing`, `funnel`; `stage` runs them over work units on the injected engine.

`Config`, `VERSION` and `fingerprint` come from `config` (light, so planning a run stays fast);
`run` is imported from `stage` on first use."""
from typing import Any

from tasks.collect.config import VERSION, Config, fingerprint

__all__ = ["Config", "VERSION", "fingerprint", "run"]


def __getattr__(name: str) -> Any:
    if name == "run":  # the stage imports its heavy dependencies: only when it is used
        from tasks.collect.stage import run
        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
