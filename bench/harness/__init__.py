"""What benchmarks and tests share, and the product never imports: the tiny preset shortened and
the CLI run against a home of its own (`runs`), a data folder's pages extracted (`pages`), damaged
input files (`damaged`) and the collect stage run over them (`fuzz`), damage to a finished store
(`store_damage`) and the trials over it (`store_fuzz`), and the load trial's checks (`load_trial`).
Tests import these modules; a benchmark itself runs only as `python -m bench NAME`."""
