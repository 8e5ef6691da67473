"""gristmill: from raw web crawl to an aligned, evaluated language model in one resumable, tracked pipeline.

Everything gristmill installs lives under this package. Its subpackages are the repository's
top-level folders (`core/`, `model/`, `tasks/`, `infra/`, `flows/`), linked here so that the
editable install, the built wheel, pyright and ruff all see the one name `gristmill.*`
(docs/development.md#one-namespace).
"""
