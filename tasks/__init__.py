"""The pipeline's stages, one package each, in DAG order:

    collect ─► tokenize ─► pretrain ─► sft ─► align ─► evaluate

Every package exposes the stage contract of `core.stage`: `Config` (its typed settings), `VERSION`
(bumped when outputs change for the same config), `fingerprint(config)` (digest of the external
data it reads, or None) and `run(config, inputs, out_dir, *, engine) -> StageResult`. Stages import
neither Prefect, MLflow nor Ray; `flows/` wraps them with the artifact store and tracking.
"""
