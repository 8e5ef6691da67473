"""lm-evaluation-harness task YAMLs that ask exactly what `gristmill evaluate` asks (see
docs/evaluation.md#the-same-tasks-in-lm-evaluation-harness). Point lm-eval at this folder with
`--include_path`; the data files are found under the folder given as
`--metadata '{"eval_dir": "/path/to/eval"}'`."""
