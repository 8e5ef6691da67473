"""Model-based quality score for the collect stage: a linear classifier of reference vs crawl text.

As in DCLM's and FineWeb-Edu's classifiers, "good" text is defined by example: the model is
trained in the pipeline on reference text (positives) against raw crawl text (negatives), and a
document whose probability of being reference-like is below `threshold` is dropped.

Model: logistic regression on hashed word unigrams and bigrams (`ngram_buckets` buckets; tokens
are lower-cased words and single punctuation marks, since markup such as `|`, `#`, `[` is a
strong quality signal). Features are log(1 + count) per bucket, L2-normalized per document.
Hashes are stable BLAKE2b-based 64-bit values (decontam.py), never Python's salted hash(),
so a saved model scores the same in every process. Training is minibatch SGD in plain numpy
with L2 weight decay and class-balanced loss; everything random is drawn from `seed`.

The reference must match the crawl in topic, or the classifier learns topic instead of quality
and drops every off-topic page. The demo pairs `demo:stdlib-docstrings` (docstrings of the
Python standard library: edited English prose about Python) with the demo crawl (docs of the
Python packages gristmill pins): same subject, so what separates them is style (prose vs badges,
link lists, changelogs, tables; docstrings carry no Markdown, so heavy markup also scores low).
For a web crawl use a broad reference (encyclopedia, books,
curated web), as DCLM and FineWeb-Edu do. A model scores the documents it was trained on
too well (it memorizes them), so score the crawl out of fold: `cross_fit_scores`. That needs the
whole crawl first, so it runs after the work units, on the engine. A model saved by an earlier run
(`model`: its collect artifact's `quality_model` folder) scores in the work units instead, each
document as it is cleaned (`load_model`, once per process), as DCLM and FineWeb-Edu apply a
classifier trained once to a whole crawl.
"""
from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import sysconfig
import tempfile
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from gristmill.core.decontam import ngram_hashes, token_hashes
from gristmill.core.files import is_url, open_location, publish_file, staging_path
from gristmill.core.sources import DEMO_PREFIX, parse_source
from gristmill.core.stage import Engine, SerialEngine
from gristmill.tasks.collect.read.readers import (
    TEXT_SUFFIXES,
    Skipped,
    extract_text,
    read_file,
    resolve_source,
)
from gristmill.tasks.collect.read.texts import take

DEMO_STDLIB_NAME = "stdlib-docstrings"
DEMO_STDLIB = DEMO_PREFIX + DEMO_STDLIB_NAME
DROP_REASON = "low_quality_score"
REFERENCE_DOC_WORDS = 200  # .txt files are cut into documents of about this many words
MIN_DOCSTRING_WORDS = 40  # shorter docstrings are one-liners, not prose
BATCH_DOCS = 32
SCORE_BATCH_DOCS = 1024  # crawl documents featurized and scored at once
SCORE_TASK_DOCS = 8192  # crawl documents scored by one engine task
_TOKEN = re.compile(r"\w+|[^\w\s]")
_STDLIB_SKIP = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages",
                "ensurepip", "pydoc_data"}
MODEL_FILES = ("quality_model.npz", "quality_model.json")


class QualityConfig(BaseModel):
    """Reference text, classifier hyperparameters and the drop threshold."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=False, description="Train the model and drop low-scoring documents "
                                                     "(off by default: it needs a reference that "
                                                     "matches the crawl's subject).")
    reference: list[str] = Field(
        default_factory=lambda: [DEMO_STDLIB],
        description="Good text: files, folders or globs in any crawl input format (.jsonl "
                    f"'text', .parquet, ...; .txt files are cut into ~{REFERENCE_DOC_WORDS}-word "
                    f"documents), or '{DEMO_STDLIB}' (offline; pairs with the demo crawl).")
    threshold: float = Field(
        default=0.02, ge=0, le=1,
        description="Drop documents whose probability of being reference-like is below this. "
                    "The classes are balanced, so 0.5 keeps only crawl documents that look more "
                    "like the reference than like the crawl (DCLM-style, a few percent); on the "
                    "demo pairing (cross-fit) 0.5 kept 5%, 0.1 23%, 0.02 67%, 0.01 88% of the "
                    "crawl.")
    ngram_buckets: int = Field(default=1 << 18, ge=16, description="Hash buckets of word uni+bigrams.")
    epochs: int = Field(default=20, ge=1, description="SGD passes over the training documents.")
    lr: float = Field(default=1.0, gt=0, description="SGD learning rate (features are L2-normalized).")
    l2: float = Field(default=1e-4, ge=0, description="L2 penalty on the weights, per step.")
    max_train_docs: int = Field(default=20_000, ge=2, description="Cap per class on training documents "
                                                                  "(a seeded sample).")
    heldout_fraction: float = Field(default=0.2, ge=0, lt=1, description="Fraction of each class held "
                                                                         "out to measure the model.")
    seed: int = Field(default=0, description="Seed of sampling, the held-out split and SGD order.")
    model: str | None = Field(
        default=None, description="A model saved by an earlier run (the `quality_model` folder of its "
                                  "collect artifact; a path or URL): the work units score each document "
                                  "with it as they clean it, and nothing is trained (`reference` and the "
                                  "training settings are unused). Without it the model is trained on "
                                  "`reference` against this crawl and scores the crawl out of fold, after "
                                  "the units.")


# ---- features -----------------------------------------------------------------------------------
def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


def featurize(texts: list[str], buckets: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sparse rows as (indptr, bucket indices, values): log1p counts, L2-normalized per row."""
    indptr, indices, values = [0], [], []
    for text in texts:
        hashes = token_hashes(tokens(text))
        grams = np.concatenate([ngram_hashes(hashes, 1), ngram_hashes(hashes, 2)])
        cols, counts = np.unique(grams % np.uint64(buckets), return_counts=True)
        vals = np.log1p(counts)
        vals /= max(np.linalg.norm(vals), 1e-12)
        indices.append(cols.astype(np.int64))
        values.append(vals)
        indptr.append(indptr[-1] + len(cols))
    return (np.array(indptr), np.concatenate([np.empty(0, np.int64), *indices]),
            np.concatenate([np.empty(0), *values]))


def _logits(rows, weights: np.ndarray, bias: float) -> np.ndarray:
    indptr, indices, values = rows
    row_of = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
    return np.bincount(row_of, values * weights[indices], minlength=len(indptr) - 1) + bias


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # overflow-free form of 1 / (1 + exp(-z))


def _take(rows, order: np.ndarray):
    """The rows `order` of a sparse matrix, in that order."""
    indptr, indices, values = rows
    starts, lengths = indptr[order], np.diff(indptr)[order]
    nnz = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    pick = nnz + np.arange(lengths.sum())
    return np.concatenate([[0], np.cumsum(lengths)]), indices[pick], values[pick]


# ---- the model ----------------------------------------------------------------------------------
class QualityModel:
    """Weights per hash bucket and a bias; `score` gives P(reference-like) per text."""

    def __init__(self, weights: np.ndarray, bias: float):
        self.weights, self.bias = weights.astype(np.float32), float(bias)

    def score(self, texts: list[str]) -> np.ndarray:
        return self.score_rows(featurize(list(texts), len(self.weights)))

    def score_rows(self, rows) -> np.ndarray:
        return _sigmoid(_logits(rows, self.weights.astype(np.float64), self.bias))

    def save(self, location: str | Path) -> None:
        """Write `quality_model.npz` (weights) and `quality_model.json` (bias, buckets) in the
        folder at `location` (a path or URL)."""
        if not is_url(location):
            Path(location).mkdir(parents=True, exist_ok=True)
        weights = staging_path(f"{location}/{MODEL_FILES[0]}", ".tmp.npz")  # savez adds .npz otherwise
        np.savez_compressed(weights, weights=self.weights)
        meta = staging_path(f"{location}/{MODEL_FILES[1]}", ".tmp")
        meta.write_text(json.dumps({"bias": self.bias, "ngram_buckets": len(self.weights),
                                    "features": "uni+bigram"}, indent=2))
        for staged, name in ((weights, MODEL_FILES[0]), (meta, MODEL_FILES[1])):
            publish_file(staged, f"{location}/{name}")

    @classmethod
    def load(cls, location: str | Path) -> QualityModel:
        """The model saved in the folder at `location`; FileNotFoundError naming a missing file."""
        try:
            with open_location(f"{location}/{MODEL_FILES[1]}") as f:
                meta = json.load(f)
            with open_location(f"{location}/{MODEL_FILES[0]}") as f, np.load(f) as data:
                return cls(data["weights"], meta["bias"])
        except FileNotFoundError as error:
            raise FileNotFoundError(f"quality model: {location}: {MODEL_FILES[0]} and "
                                    f"{MODEL_FILES[1]} expected ({error})") from None


@lru_cache(maxsize=4)
def load_model(location: str) -> QualityModel:
    """`QualityModel.load`, once per process and location (a work unit's or a scoring task's)."""
    return QualityModel.load(location)


def is_low_quality(scores: np.ndarray, cfg: QualityConfig) -> np.ndarray:
    """Which documents are dropped (for DROP_REASON): those scoring below the threshold."""
    return np.asarray(scores) < cfg.threshold


def _sgd(rows, labels: np.ndarray, cfg: QualityConfig) -> QualityModel:
    """Class-balanced logistic regression by minibatch SGD with L2 weight decay."""
    rng = np.random.default_rng(cfg.seed)
    n_pos = labels.sum()
    sample_weight = np.where(labels == 1, 0.5 / max(n_pos, 1), 0.5 / max(len(labels) - n_pos, 1))
    sample_weight *= len(labels)  # mean weight 1, so `lr` does not depend on the class balance
    weights, bias = np.zeros(cfg.ngram_buckets), 0.0
    for _ in range(cfg.epochs):
        order = rng.permutation(len(labels))
        for start in range(0, len(order), BATCH_DOCS):
            batch = order[start:start + BATCH_DOCS]
            indptr, indices, values = sub = _take(rows, batch)
            error = (_sigmoid(_logits(sub, weights, bias)) - labels[batch]) * sample_weight[batch]
            per_nnz = np.repeat(error, np.diff(indptr)) * values
            grad = np.bincount(indices, per_nnz, minlength=cfg.ngram_buckets) / len(batch)
            weights -= cfg.lr * (grad + cfg.l2 * weights)
            bias -= cfg.lr * error.mean()
    return QualityModel(weights, bias)


def _metrics(scores: np.ndarray, labels: np.ndarray, threshold: float) -> dict[str, float]:
    """Accuracy, precision and recall of 'reference' at the threshold; ROC AUC."""
    predicted = scores >= threshold
    true_pos = float((predicted & (labels == 1)).sum())
    pos_scores, neg_scores = np.sort(scores[labels == 1]), np.sort(scores[labels == 0])
    metrics = {"accuracy": float((predicted == (labels == 1)).mean()),
               "precision": true_pos / max(int(predicted.sum()), 1),
               "recall": true_pos / max(len(pos_scores), 1)}
    if len(pos_scores) and len(neg_scores):  # P(pos > neg) + P(pos == neg) / 2
        below = np.searchsorted(neg_scores, pos_scores, "left")
        ties = np.searchsorted(neg_scores, pos_scores, "right") - below
        metrics["auc"] = float((below + 0.5 * ties).sum() / (len(pos_scores) * len(neg_scores)))
    return metrics


def _split(n: int, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    order = rng.permutation(n)
    cut = round(n * fraction)
    return np.sort(order[cut:]), np.sort(order[:cut])


def train_quality_model(positives: Sequence[str], negatives: Sequence[str],
                        cfg: QualityConfig) -> tuple[QualityModel, dict[str, float]]:
    """Train on a seeded sample of each class; metrics: train_*/heldout_* accuracy, precision,
    recall, auc (held-out ones absent when heldout_fraction is 0) and document counts."""
    for name, texts in (("positives", positives), ("negatives", negatives)):
        if len(texts) < 2:
            raise ValueError(f"quality model: need at least 2 {name}, got {len(texts)}")
    rng = np.random.default_rng(cfg.seed)
    train, heldout = [], []
    for label, texts in ((1, positives), (0, negatives)):
        texts = sample(texts, cfg.max_train_docs, rng)
        train_ids, heldout_ids = _split(len(texts), cfg.heldout_fraction, rng)
        train += [(texts[i], label) for i in train_ids]
        heldout += [(texts[i], label) for i in heldout_ids]
    train_labels = np.array([label for _, label in train])
    train_rows = featurize([t for t, _ in train], cfg.ngram_buckets)
    model = _sgd(train_rows, train_labels, cfg)
    metrics = {"train_docs": len(train), "heldout_docs": len(heldout)}
    metrics |= {f"train_{k}": v for k, v in
                _metrics(model.score_rows(train_rows), train_labels, cfg.threshold).items()}
    if heldout:
        labels = np.array([label for _, label in heldout])
        metrics |= {f"heldout_{k}": v for k, v in
                    _metrics(model.score([t for t, _ in heldout]), labels, cfg.threshold).items()}
    return model, metrics


def _score_task(item: tuple[str, Sequence[str]]) -> np.ndarray:
    """Scores of a chunk of texts (a lazy view of spooled texts is read here) by the model saved
    at a location."""
    location, texts = item
    model = load_model(location)
    return np.concatenate([np.zeros(0)] + [model.score(list(texts[lo:lo + SCORE_BATCH_DOCS]))
                                           for lo in range(0, len(texts), SCORE_BATCH_DOCS)])


def cross_fit_scores(positives: list[str], crawl: Sequence[str], cfg: QualityConfig,
                     folds: int = 2, engine: Engine | None = None, work_dir: str | None = None) -> np.ndarray:
    """Scores of every crawl document from a model that did not train on it (k-fold). The fold
    models train here (on capped samples); the scoring runs on `engine` (default: in this
    process), SCORE_TASK_DOCS a task, each loading its fold's model from `work_dir` (a path or
    URL the workers reach; default: a temporary folder). A text's score does not depend on its
    batch."""
    engine = engine or SerialEngine()
    fold_of = np.random.default_rng(cfg.seed).permutation(len(crawl)) % folds
    scores = np.empty(len(crawl))
    with contextlib.ExitStack() as stack:
        if work_dir is None:
            work_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="quality-"))
        elif not is_url(work_dir):
            Path(work_dir).mkdir(parents=True, exist_ok=True)
        items, where = [], []
        for fold in range(folds):
            model, _ = train_quality_model(positives, take(crawl, np.flatnonzero(fold_of != fold)), cfg)
            location = f"{work_dir}/fold-{fold}"
            model.save(location)
            mine = np.flatnonzero(fold_of == fold)
            for lo in range(0, len(mine), SCORE_TASK_DOCS):
                items.append((location, take(crawl, mine[lo:lo + SCORE_TASK_DOCS])))
                where.append(mine[lo:lo + SCORE_TASK_DOCS])
        for rows, chunk in zip(where, engine.map(_score_task, items)):
            scores[rows] = chunk
    return scores


# ---- reference text -----------------------------------------------------------------------------
def sample(texts: Sequence[str], max_docs: int, rng: np.random.Generator) -> list[str]:
    """At most max_docs of texts, a seeded sample in the original order."""
    if len(texts) <= max_docs:
        return list(texts)
    return list(take(texts, np.sort(rng.choice(len(texts), max_docs, replace=False))))


def _cut(text: str) -> list[str]:
    """Consecutive lines grouped into documents of >= REFERENCE_DOC_WORDS words (the last may
    be shorter): a reference .txt is a whole book or speech, a crawl document is page-sized."""
    docs, lines, words = [], [], 0
    for line in text.splitlines():
        lines.append(line)
        words += len(line.split())
        if words >= REFERENCE_DOC_WORDS:
            docs.append("\n".join(lines).strip())
            lines, words = [], 0
    return docs + (["\n".join(lines).strip()] if words else [])


def _file_docs(path: Path | str) -> list[str]:
    """Documents of one reference file, read and extracted exactly as crawl input is (so the
    classifier cannot learn a difference in preprocessing); ValueError naming a bad file."""
    docs, errors = [], []
    for event in read_file(path):
        if isinstance(event, Skipped):  # skipped_* records (images, requests) are no documents
            if event.reason.startswith("error_"):
                errors.append(f"{event.reason} at {event.where}")
        elif text := extract_text(event):
            docs += _cut(text) if str(path).lower().endswith(TEXT_SUFFIXES) else [text]
    if errors or not docs:
        raise ValueError(f"reference file {path}: {'; '.join(errors[:3]) or 'no documents'}")
    return docs


def stdlib_files() -> list[Path]:
    """The standard library's .py files, sorted, without tests, tools and site-packages."""
    files = []
    for folder, subfolders, names in os.walk(sysconfig.get_paths()["stdlib"]):
        subfolders[:] = [name for name in subfolders if name not in _STDLIB_SKIP]  # prune
        files += [Path(folder, name) for name in names if name.endswith(".py")]
    return sorted(files)


@lru_cache(maxsize=4)  # parsing all of it takes seconds: once per process
def stdlib_docstrings(max_docs: int | None = None, seed: int = 0) -> tuple[str, ...]:
    """Docstrings (>= MIN_DOCSTRING_WORDS words, doctest lines removed) of this interpreter's
    standard library, parsed without importing it: all of them (~1600 on CPython 3.11) in file
    order, or those of files in a seeded order until there are max_docs."""
    files = stdlib_files()
    if max_docs is not None:
        files = [files[i] for i in np.random.default_rng(seed).permutation(len(files))]
    docs: list[str] = []
    for path in files:
        if max_docs is not None and len(docs) >= max_docs:
            break
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a few files are deliberately broken (bad-syntax test fixtures)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = "\n".join(line for line in (ast.get_docstring(node) or "").splitlines()
                                 if not line.lstrip().startswith((">>>", "...")))
                if len(text.split()) >= MIN_DOCSTRING_WORDS:
                    docs.append(text)
    return tuple(docs[:max_docs])


def load_reference_texts(sources: list[str], max_docs: int, seed: int) -> list[str]:
    """Documents of every reference source, in order; a seeded sample of max_docs if more."""
    docs: list[str] = []
    for source in sources:
        if parse_source(source).kind == "demo":
            parse_source(source).demo([DEMO_STDLIB_NAME], "reference")
            docs += stdlib_docstrings(max_docs, seed)
            continue
        for path in resolve_source(source):  # ValueError naming a missing source
            docs += _file_docs(path)
    return sample(docs, max_docs, np.random.default_rng(seed))
