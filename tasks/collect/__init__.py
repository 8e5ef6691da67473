"""Stage 1, collect and clean: read raw sources (WARC/WET, JSONL, Parquet/Arrow, text, Common
Crawl paths), extract text, filter (language ID, Gopher/C4/FineWeb rules, URL lists, a trained
quality model), scrub PII, decontaminate against benchmarks, dedup (exact, then MinHash-LSH
clusters) and mix sources to token budgets. Every drop is a counted reason in the funnel.

The modules, by concern, in the order a document meets them:

    read/     readers (by format: warc, tables), records, common_crawl, demo_crawl, texts
    clean/    cleaning (the chain; + config), filters, rules, langid, pii, quality_model
    dedup/    exact_dedup; near (+ config, index, minhash); neardup_set (near dedup's
              labelled set)
    output/   spool, spill, mixing, funnel, gates
    config    the stage's `Config`, `VERSION` and `fingerprint` (light, so planning a run stays
              fast)
    stage     `run`: the work units on the injected engine, merged, then the corpus-level
              steps; imported only when the stage computes
    corpus    the corpus-level steps: exact dedup, the quality model trained here, near dedup,
              the mix and the docs shards

The stage's entry in flows/stages.py names `config` and `stage`. Each folder's `__init__` says
what its modules do."""
