"""lm-eval `custom_dataset` for the gristmill_* tasks: one local JSONL file as a "test" split.

lm-eval calls `load(**metadata, **dataset_kwargs)`: `eval_dir` comes from `--metadata` (or
`TaskManager(metadata=...)`), `data_file` from the task YAML (relative to eval_dir, or absolute).
Self-contained on purpose (json + datasets only): it runs inside lm-eval, not gristmill.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _records(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load(data_file: str, eval_dir: str | None = None, labels_file: str | None = None,
         only_ok: bool = False, **_: Any) -> Any:
    """DatasetDict {"test": records}; PIQA's labels joined from `labels_file` as `label`;
    with `only_ok`, MMLU-Redux records whose error_type is not "ok" are left out."""
    import datasets

    def resolve(name: str) -> Path:
        path = Path(name)
        if not path.is_absolute():
            if eval_dir is None:
                raise ValueError(f"{name} is relative: pass --metadata '{{\"eval_dir\": \"/path/to/eval\"}}'")
            path = Path(eval_dir) / path
        return path

    rows = _records(resolve(data_file))
    if labels_file is not None:
        labels = resolve(labels_file).read_text().split()
        rows = [{**row, "label": int(label)} for row, label in zip(rows, labels)]
    if only_ok:
        rows = [row for row in rows if str(row.get("error_type", "ok")).lower() == "ok"]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
