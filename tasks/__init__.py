"""The pipeline's stages, one package each, in DAG order:

    collect ─► tokenize ─► pretrain ─► sft ─► align ─► evaluate

Every package follows the stage contract of `gristmill.core.stage`: `config.py` holds `Config` (its typed
config), `VERSION` (bumped when outputs change for the same config) and `fingerprint(config)`
(digest of the external data it reads, or None); `stage.py` holds
`run(config, out_dir, *, engine, **upstream) -> StageResult`. Each stage is one entry of the
stage table, flows/stages.py. Stages import neither Prefect, MLflow nor Ray; `flows/` wraps them
with the artifact store and tracking.
"""
