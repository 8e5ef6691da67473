"""Reading the collect stage's sources: `readers` turns any input file into records (`records`),
by format (`warc`, `tables` for Parquet/Arrow, JSON lines and text in `readers` itself);
`common_crawl` chooses and downloads a crawl's files and `demo_crawl` builds the offline demo
corpus. For tests and benchmarks of the readers: `pages` (a data folder's pages, extracted),
`damaged` (damaged input files of every kind) and `fuzz` (the collect stage run over them)."""
