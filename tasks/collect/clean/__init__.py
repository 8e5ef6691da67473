"""The collect stage's per-document cleaning: `cleaning` is the chain, in its order, and `config`
its thresholds (`CleaningConfig`); `filters` (URL block list, language, Gopher, C4, FineWeb)
decide with `rules` (the quality rules on one parsed page) and `langid` (fastText's lid.176);
`pii` scrubs personal data; `quality_model` is the trained reference-vs-crawl classifier that
scores the documents."""
