"""MLflow 3 logged models: the SFT and aligned chat models, and the evaluation metrics logged
against them.

A training stage's `model/` (a Hugging Face directory with its tokenizer and chat template) is
logged once, as a logged model of the run that computed the stage, in MLflow's transformers
flavour with the `llm/v1/chat` task. Served (`mlflow models serve`) or loaded
(`mlflow.pyfunc.load_model`), it takes a chat request, `{"messages": [{"role": "user",
"content": ...}], "max_tokens": N}`, renders it with the chat template stored with the tokenizer,
generates greedily and answers with an OpenAI-style `chat.completion`. The model is tagged with
its artifact (`gristmill.stage`, `gristmill.key`) and found again by them, so a reused stage logs
nothing: one search. Registry versions are created from it (registry.py).

Logged through the client with explicit ids (`create_logged_model`, the flavour's `save_model`,
`log_model_artifacts`, `finalize_logged_model`, `log_outputs`) rather than the fluent
`mlflow.transformers.log_model`, which takes the process's active run and experiment: the flow
records stages from several threads, and its runs are addressed by id.
"""
from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from mlflow.entities import (
    Dataset,
    DatasetInput,
    InputTag,
    LoggedModelInput,
    LoggedModelOutput,
    LoggedModelStatus,
    Metric,
)

from gristmill.core.stage import Manifest
from gristmill.infra.tracking.runs import Tracker, numeric

CHAT_TASK = "llm/v1/chat"  # OpenAI-style chat requests and replies
MAX_NEW_TOKENS = 128  # a reply's length when the request gives no `max_tokens`
# Pinned to what is installed, and given: MLflow's inference of requirements imports the model's
# whole dependency tree (torchvision, absent here, included) and takes seconds.
REQUIREMENTS = ("mlflow", "torch", "transformers", "tokenizers")
STAGE_TAG, KEY_TAG = "gristmill.stage", "gristmill.key"


def find_model(tracker: Tracker, stage: str, key: str) -> str | None:
    """The id of the READY logged model of artifact (stage, key), newest first; None when there
    is none (a model whose logging failed midway is not one)."""
    found = tracker.client.search_logged_models(
        [tracker.experiment_id], filter_string=f"tags.`{STAGE_TAG}` = '{stage}' AND tags.`{KEY_TAG}` = '{key}'",
        order_by=[{"field_name": "creation_time", "ascending": False}])
    return next((m.model_id for m in found if m.status == LoggedModelStatus.READY), None)


def logged_model(tracker: Tracker, stage: str, key: str) -> str:
    """find_model's id; LookupError naming the artifact when there is none."""
    model_id = find_model(tracker, stage, key)
    if model_id is None:
        raise LookupError(f"no logged model of {stage}-{key} in {tracker.uri}; the stage's run logs it")
    return model_id


def chat_model(tracker: Tracker, run_id: str, manifest: Manifest) -> str:
    """The logged model of the stage output `manifest` (its `model/`): found, or logged now as an
    output of run `run_id`. Returns its id."""
    return find_model(tracker, manifest.stage, manifest.key) or log_chat_model(tracker, run_id, manifest)


# transformers' loading is not thread-safe: two models loaded at once in one process (the reused
# stages' publishers back-filling a tracking server run on threads) come back with their tied
# output head on the meta device, and saving them fails. One load at a time.
_LOADING = threading.Lock()


def load_chat_components(model_dir: Path) -> dict[str, Any]:
    """The model and tokenizer of an exported model directory, loaded one process-wide at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _LOADING:
        return {"model": AutoModelForCausalLM.from_pretrained(model_dir),
                "tokenizer": AutoTokenizer.from_pretrained(model_dir)}


def log_chat_model(tracker: Tracker, run_id: str, manifest: Manifest) -> str:
    """Log `manifest.path / "model"` as a transformers-flavour chat model of run `run_id`."""
    import mlflow.transformers as mlflow_transformers
    from mlflow.models import Model

    model_dir = manifest.path / "model"
    logged = tracker.client.create_logged_model(tracker.experiment_id, name=f"{manifest.stage}-{manifest.key}",
                                                source_run_id=run_id,
                                                tags={STAGE_TAG: manifest.stage, KEY_TAG: manifest.key})
    try:
        components = load_chat_components(model_dir)
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / "model"
            mlflow_transformers.save_model(
                components, str(local), task=CHAT_TASK,
                mlflow_model=Model(artifact_path=logged.artifact_location, model_uuid=logged.model_id,
                                   run_id=run_id, model_id=logged.model_id),
                model_config={"max_new_tokens": MAX_NEW_TOKENS, "do_sample": False},
                pip_requirements=[f"{name}=={version(name).split('+')[0]}" for name in REQUIREMENTS])
            tracker.client.log_model_artifacts(logged.model_id, str(local))
    except BaseException:
        tracker.client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
        raise
    tracker.client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    tracker.client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=0)])
    return logged.model_id


@dataclass(frozen=True, kw_only=True)
class EvalData:
    """Data metrics were measured on, as an MLflow dataset: `name` and `digest` identify it (an
    experiment holds one dataset per name and digest); `source` says where it lives, None for
    one the run has as an input already (an upstream artifact of its lineage)."""

    name: str
    digest: str
    source: str | None = None
    source_type: str | None = None


def log_model_metrics(tracker: Tracker, run_id: str, model_id: str,
                      measured: Sequence[tuple[EvalData | None, Mapping[str, Any]]]) -> None:
    """Log into run `run_id` the numeric metrics of logged model `model_id`, each group against the
    data it was measured on (None: a summary of several); the model and the data become inputs
    of the run, as `mlflow.log_metrics(..., model_id=..., dataset=...)` makes them."""
    datasets = [DatasetInput(Dataset(name=data.name, digest=data.digest, source_type=data.source_type or "local",
                                     source=data.source), tags=[InputTag("mlflow.data.context", "evaluation")])
                for data, _ in measured if data is not None and data.source is not None]
    tracker.log_inputs(run_id, datasets, models=[LoggedModelInput(model_id)])
    stamp = int(time.time() * 1000)
    tracker.log_metrics(run_id, [
        Metric(key, value, stamp, 0, model_id=model_id, run_id=run_id,
               dataset_name=data.name if data else None, dataset_digest=data.digest if data else None)
        for data, metrics in measured for key, value in numeric(metrics).items()])
