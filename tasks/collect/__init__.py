"""Stage 1, collect and clean: read raw sources (WARC/WET, JSONL, Parquet/Arrow, text, Common
Crawl paths), extract text, filter (language ID, Gopher/C4/FineWeb rules, URL lists, a trained
quality model), scrub PII, dedup (exact, then MinHash-LSH clusters), decontaminate against
benchmarks, and mix sources to token budgets. Every drop is a counted reason in the funnel.

Modules, in the order a document meets them: `readers` (+ `records`, `warc`, `tables`,
`common_crawl`, `demo_crawl`), `cleaning` (+ `filters`, `rules`, `langid`, `pii`), then benchmark
decontamination (core/decontam.py, shared with the evaluate stage), `exact_dedup`,
`quality_model`, `dedup` (+ `minhash`), `mixing`, `funnel`; `stage` runs them over work units on
the injected engine, with the kept documents in `spool` files and the corpus-level steps' arrays
in `spill` files. `gates` checks what the stage removed, after it and before tokenize.

`config` holds the stage's `Config`, `VERSION` and `fingerprint` (light, so planning a run
stays fast); `stage` its `run`, imported only when the stage computes. The stage's entry in
flows/stages.py names both."""
