"""The collect stage's dedup: `exact_dedup` (first occurrence of each text hash) and `near`
(MinHash-LSH clusters: `minhash`'s signatures and band keys, `config`'s settings, and `index`, the
persisted index a refresh dedups against); `neardup_set` is the labelled near-duplicate set that
measures near dedup's precision and recall."""
