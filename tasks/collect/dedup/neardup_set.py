"""A labelled near-duplicate set from real documents, for measuring dedup precision and recall.

    texts, truth = build_labelled_set(shared_data, n_originals=300, seed=0)
    precision, recall = precision_recall(result.cluster, truth)

Source documents: the English-script text of `shared_data` (corpus/*.txt and the nltk_* folders,
jsonl/dolma_cc), split into documents of 150-400 words made of whole paragraphs. A seeded sample
of them are originals; each gets 1-3 copies with the edits a crawl really shows:

  boilerplate   a site header and/or footer (cookie notices, navigation, copyright lines; 10-40
                words, shared by all copies, so copies of different originals share them too)
  shuffle       the paragraphs in another order
  drop          one paragraph (not the first) removed, when there are 4 or more
  typos         0.5-2% of the words get one character edit (swap, delete, insert, substitute)

What an edit costs in Jaccard similarity of 5-word shingles, for a 300-word document: each typo
replaces up to 5 shingles, so a rate r gives about (1 - 5r) / (1 + 5r): 0.95 at 0.5%, 0.82 at 2%;
30 words of header/footer add about 30 shingles (0.91); dropping one of six paragraphs removes a
sixth (0.83); shuffling six paragraphs changes the 4 shingles across each boundary (~0.88).
Copies combine 1-4 edits. Measured over 800 copies (seed 0): copy vs original median 0.86, 88%
>= 0.7, 97% >= 0.6, minimum 0.50; two copies of one original are further apart (median 0.74,
60% >= 0.7). `pair_jaccards` gives the exact similarity of every labelled pair. The other
documents are distinct: among all source documents one pair of chunks of two pages of one site
shares a navigation block (Jaccard 0.49); no other pair reaches 0.3.
Labels are all pairs within a family (original and its copies), in the shuffled output order.
"""
from __future__ import annotations

import gzip
import json
import random
import re
from collections.abc import Iterable, Sequence
from itertools import combinations
from pathlib import Path

import numpy as np

MIN_DOC_WORDS, MAX_DOC_WORDS = 150, 400
MAX_PARA_WORDS = 150  # longer blocks are split at line ends, or every 100 words
MIN_WORDS_PER_KCHAR = 100  # below this the script has no spaces between words (e.g. Japanese)

HEADERS = (
    "Skip to main content\nHome | About | Contact | Blog\nSearch this site",
    ("We use cookies to improve your experience on our website. By continuing to browse you "
     "agree to our use of cookies. Accept"),
    "Menu\nHome\nNews\nArchive\nSubscribe\nLog in or register to post comments",
    "Posted by admin on March 3, 2021 in Uncategorized | 4 comments",
    "Advertisement\nShare this article: Facebook Twitter LinkedIn Email Print",
    "You are here: Home > Library > Texts > Reading room",
)
FOOTERS = (
    "Copyright (c) 2023 All rights reserved. Privacy Policy | Terms of Use | Sitemap",
    ("Subscribe to our newsletter to get the latest updates delivered to your inbox every week. "
     "We never share your email address."),
    "Related posts:\nRead more\nPrevious article\nNext article\nLeave a reply",
    ("Tags: history, speech, literature. Share this: Twitter Facebook Reddit. Like this: Like "
     "Loading..."),
    "This entry was posted in Reading and tagged classics. Bookmark the permalink.",
    "Powered by WordPress | Theme by Example Themes | Back to top",
)
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:  # nltk_genesis mixes encodings
        text = raw.decode("latin-1")
    return text.lstrip("\ufeff")


def _source_texts(shared_data: Path) -> Iterable[str]:
    for path in sorted((shared_data / "corpus").rglob("*.txt")):
        yield _read_text(path)
    for path in sorted((shared_data / "jsonl" / "dolma_cc").iterdir()):
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            yield from (json.loads(line)["text"] for line in f if line.strip())


def _paragraphs(text: str) -> list[str]:
    """Blocks between blank lines, long ones split at line ends (or every 100 words), short
    ones (under 30 words, e.g. a one-line speech) merged into the next."""
    units = []
    for block in re.split(r"\n\s*\n", text):
        if len(block.split()) <= MAX_PARA_WORDS:
            units.append(block.strip())
            continue
        piece: list[str] = []
        for line in block.splitlines():
            words = line.split()
            parts = [line] if len(words) <= MAX_PARA_WORDS else [
                " ".join(words[i:i + 100]) for i in range(0, len(words), 100)]
            for part in parts:
                piece.append(part)
                if sum(len(p.split()) for p in piece) >= 60:
                    units.append("\n".join(piece).strip())
                    piece = []
        units.append("\n".join(piece).strip())
    paras, pending = [], []
    for unit in filter(None, units):
        pending.append(unit)
        if sum(len(u.split()) for u in pending) >= 30:
            paras.append("\n".join(pending))
            pending = []
    return paras


def _spaced(text: str) -> bool:
    """Whether the text's script puts spaces between words (not e.g. Japanese)."""
    return len(text.split()) * 1000 >= MIN_WORDS_PER_KCHAR * max(len(text), 1)


def source_paragraphs(shared_data: Path) -> list[str]:
    """Every paragraph of the source texts whose script has spaces between words, in a fixed
    order (the units `source_documents` is made of)."""
    return [para for text in _source_texts(Path(shared_data)) if _spaced(text)
            for para in _paragraphs(text)]


def source_documents(shared_data: Path) -> list[str]:
    """Every source text cut into documents of MIN_DOC_WORDS-MAX_DOC_WORDS words (whole
    paragraphs), in a fixed order; the same for every seed."""
    lengths = random.Random(0)
    docs = []
    for text in _source_texts(shared_data):
        if not _spaced(text):
            continue
        doc: list[str] = []
        target = lengths.randint(MIN_DOC_WORDS, MAX_DOC_WORDS)
        for para in _paragraphs(text):
            doc.append(para)
            if sum(len(p.split()) for p in doc) >= target:
                docs.append("\n\n".join(doc))
                doc, target = [], lengths.randint(MIN_DOC_WORDS, MAX_DOC_WORDS)
        if sum(len(p.split()) for p in doc) >= MIN_DOC_WORDS:
            docs.append("\n\n".join(doc))
    return docs


def _typo(word: str, rng: random.Random) -> str:
    i = rng.randrange(len(word))
    kind = rng.choice(("swap", "delete", "insert", "substitute") if len(word) > 1 else ("insert",))
    if kind == "swap" and i < len(word) - 1:
        return word[:i] + word[i + 1] + word[i] + word[i + 2:]
    if kind == "delete":
        return word[:i] + word[i + 1:]
    if kind == "insert":
        return word[:i] + rng.choice(_LETTERS) + word[i:]
    return word[:i] + rng.choice(_LETTERS) + word[i + 1:]


def _add_typos(para: str, rate: float, rng: random.Random) -> str:
    return "\n".join(" ".join(_typo(w, rng) if w and rng.random() < rate else w
                              for w in line.split(" ")) for line in para.split("\n"))


def make_copy(original: str, rng: random.Random) -> str:
    """One edited copy: each of header/footer, shuffle, drop, typos with its own chance, at
    least one of them."""
    paras = original.split("\n\n")
    edits = [e for e, p in (("boilerplate", 0.5), ("shuffle", 0.3), ("drop", 0.3),
                            ("typos", 0.6)) if rng.random() < p] or ["typos"]
    if "drop" in edits and len(paras) >= 4:
        del paras[rng.randrange(1, len(paras))]
    if "shuffle" in edits:
        rng.shuffle(paras)
    if "typos" in edits:
        rate = rng.uniform(0.005, 0.02)
        paras = [_add_typos(p, rate, rng) for p in paras]
    if "boilerplate" in edits:
        side = rng.choice(("header", "footer", "both"))
        if side != "footer":
            paras.insert(0, rng.choice(HEADERS))
        if side != "header":
            paras.append(rng.choice(FOOTERS))
    return "\n\n".join(paras)


def build_labelled_set(shared_data: Path, n_originals: int, seed: int,
                       n_distinct: int | None = None) -> tuple[list[str], set[tuple[int, int]]]:
    """(texts in shuffled order, labelled near-duplicate pairs (i, j) with i < j).

    `n_originals` source documents get 1-3 edited copies each; `n_distinct` further source
    documents (default: all the rest) appear once. ValueError if the sources are too few."""
    pool = source_documents(Path(shared_data))
    rng = random.Random(seed)
    rng.shuffle(pool)
    n_distinct = len(pool) - n_originals if n_distinct is None else n_distinct
    if n_originals < 0 or n_distinct < 0 or n_originals + n_distinct > len(pool):
        raise ValueError(f"n_originals + n_distinct = {n_originals} + {n_distinct}: "
                         f"{shared_data} yields only {len(pool)} source documents")
    families, texts = [], []
    for original in pool[:n_originals]:
        n_copies = rng.choices((1, 2, 3), weights=(5, 3, 2))[0]
        family = [original] + [make_copy(original, rng) for _ in range(n_copies)]
        families.append(list(range(len(texts), len(texts) + len(family))))
        texts += family
    texts += pool[n_originals:n_originals + n_distinct]
    order = list(range(len(texts)))
    rng.shuffle(order)
    position = {old: new for new, old in enumerate(order)}
    truth = {(min(position[a], position[b]), max(position[a], position[b]))
             for family in families for a, b in combinations(family, 2)}
    return [texts[i] for i in order], truth


def cluster_pairs(clusters: Sequence[int] | np.ndarray) -> set[tuple[int, int]]:
    """Every pair (i, j), i < j, of documents with the same cluster label (-1: no cluster)."""
    members: dict[int, list[int]] = {}
    for doc, label in enumerate(np.asarray(clusters).tolist()):
        if label >= 0:
            members.setdefault(label, []).append(doc)
    return {pair for docs in members.values() for pair in combinations(docs, 2)}


def precision_recall(clusters: Sequence[int] | np.ndarray,
                     truth: set[tuple[int, int]]) -> tuple[float, float]:
    """Pairwise precision and recall: a predicted pair is two documents in one cluster (cluster
    labels per document, -1 for none, as DedupResult.cluster). Empty sets score 1.0."""
    predicted = cluster_pairs(clusters)
    hits = len(predicted & truth)
    return (hits / len(predicted) if predicted else 1.0, hits / len(truth) if truth else 1.0)


def pair_jaccards(texts: Sequence[str], pairs: Iterable[tuple[int, int]], cfg) -> np.ndarray:
    """Exact Jaccard similarity of the shingle sets of each pair (`cfg`: a DedupConfig)."""
    from gristmill.tasks.collect.dedup.minhash import exact_jaccard

    return np.array([exact_jaccard(texts[i], texts[j], cfg) for i, j in sorted(pairs)])
