"""Reading the collect stage's sources: `readers` turns any input file into records (`records`),
by format (`warc`, `tables` for Parquet/Arrow, JSON lines and text in `readers` itself);
`common_crawl` chooses and downloads a crawl's files and `demo_crawl` builds the offline demo
corpus. `texts` reads documents' texts back, lazily, from the stage's spool files. Tests and
benchmarks fuzz the readers with bench/harness/damaged.py's files."""
