"""The scale benchmark's corpus (bench/scale.py): N distinct web-like documents of whole English
paragraphs, with planted near-duplicate families and junk the filters must drop, written as WARC
and JSONL files with some bad records beside them. Apart from the runs that read it, so that the
corpus can be built (and its properties checked) without running either system.
"""
from __future__ import annotations

import gzip
import html
import io
import itertools
import json
import random
import uuid
from dataclasses import dataclass
from pathlib import Path

from bench.harness.runs import SHARED_DATA

DOCS_PER_FILE = 500
ORIGINAL_FRACTION = 0.08  # documents that are originals of a planted family
JUNK_FRACTION = 0.06
HTML_FRACTION = 0.5
MIN_WORDS, MAX_WORDS = 200, 450
MAX_PARA_SHARE = 0.35  # of a document's words, for any one paragraph
JUNK_KINDS = ("foreign", "short", "spam", "lorem")
LOREM = ("Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor "
         "incididunt ut labore et dolore magna aliqua. Ut enim ad minim veniam, quis nostrud "
         "exercitation ullamco laboris nisi ut aliquip ex ea commodo consequat.")


@dataclass(kw_only=True)
class Corpus:
    root: Path
    urls: list[str]  # document index -> URL (how both systems' outputs map back)
    truth: set[tuple[int, int]]  # planted near-duplicate pairs (i < j)
    junk: dict[int, str]  # document index -> junk kind
    bad_records: int
    nbytes: int  # of the files

    @property
    def sources(self) -> list[str]:
        return [str(self.root / "warc"), str(self.root / "jsonl")]

    def index(self) -> dict[str, int]:
        return {url: i for i, url in enumerate(self.urls)}


def english_paragraphs(shared: Path) -> list[str]:
    """neardup_set's paragraphs that fastText reads as English (p >= 0.8), distinct, in order."""
    from gristmill.tasks.collect.clean.langid import load_model
    from gristmill.tasks.collect.dedup.neardup_set import source_paragraphs

    model = load_model()
    out = []
    for para in dict.fromkeys(source_paragraphs(shared)):
        labels, probs = model.predict(" ".join(para.split()), k=1)
        if labels[0] == "__label__en" and probs[0] >= 0.8:
            out.append(para)
    return out


class Composer:
    """Distinct documents of whole paragraphs; no paragraph pair is used twice."""

    def __init__(self, pool: list[str], rng: random.Random):
        self.pool, self.rng = pool, rng
        self.words = [len(p.split()) for p in pool]
        self.used_pairs: set[tuple[int, int]] = set()

    def document(self) -> str:
        while True:
            target, picks, total = self.rng.randint(MIN_WORDS, MAX_WORDS), [], 0
            while total < target:
                i = self.rng.randrange(len(self.pool))
                if i not in picks:
                    picks.append(i)
                    total += self.words[i]
            pairs = {(min(a, b), max(a, b)) for a, b in itertools.combinations(picks, 2)}
            if max(self.words[i] for i in picks) <= MAX_PARA_SHARE * total \
                    and not pairs & self.used_pairs:
                self.used_pairs |= pairs
                return "\n\n".join(self.pool[i] for i in picks)


def junk_document(kind: str, composer: Composer, sentences: dict[str, list[str]],
                  rng: random.Random) -> str:
    if kind == "foreign":
        lines = rng.sample(sentences[rng.choice(sorted(sentences))], rng.randint(10, 16))
        cut = len(lines) // 2
        return " ".join(lines[:cut]) + "\n\n" + " ".join(lines[cut:])
    para = composer.pool[rng.randrange(len(composer.pool))]
    if kind == "short":
        words = para.split()
        start = rng.randrange(max(1, len(words) - 35))
        return " ".join(words[start:start + rng.randint(15, 35)])
    if kind == "spam":
        line = " ".join(para.split()[:rng.randint(6, 12)])
        return "\n".join([line] * rng.randint(12, 25)) + "\n\n" + para
    paras = composer.document().split("\n\n")  # lorem
    paras.insert(rng.randrange(len(paras) + 1), LOREM)
    return "\n\n".join(paras)


def build_texts(n_docs: int, seed: int, shared: Path) -> tuple[list[str], set[tuple[int, int]],
                                                                dict[int, str]]:
    """(texts in corpus order, planted pairs, junk kinds by index)."""
    from gristmill.tasks.collect.dedup.neardup_set import make_copy
    from gristmill.tasks.collect.stage import text_hash

    rng = random.Random(seed)
    composer = Composer(english_paragraphs(shared), rng)
    sentences = {p.stem: p.read_text(encoding="utf-8").splitlines()
                 for p in sorted((shared / "multilingual" / "lingua_sentences").glob("*.txt"))
                 if p.stem != "en"}
    seen: set[bytes] = set()

    def distinct(make) -> str:
        """make() until its text is new (exact dedup must remove no unplanted document)."""
        while text_hash(text := make()) in seen:
            pass
        seen.add(text_hash(text))
        return text

    items: list[tuple[str, int | None, str | None]] = []  # (text, family, junk kind)
    n_junk = round(n_docs * JUNK_FRACTION)
    for k in range(n_junk):
        kind = JUNK_KINDS[k % len(JUNK_KINDS)]
        items.append((distinct(lambda kind=kind: junk_document(kind, composer, sentences, rng)),
                      None, kind))
    family = 0
    while len(items) < n_docs:
        if family < round(n_docs * ORIGINAL_FRACTION):
            original = distinct(composer.document)
            copies = rng.choices((1, 2, 3), weights=(5, 3, 2))[0]
            members = [original] + [distinct(lambda original=original: make_copy(original, rng))
                                    for _ in range(copies)]
            items += [(text, family, None) for text in members[:n_docs - len(items)]]
            family += 1
        else:
            items.append((distinct(composer.document), None, None))
    rng.shuffle(items)
    families: dict[int, list[int]] = {}
    for i, (_, fam, _) in enumerate(items):
        if fam is not None:
            families.setdefault(fam, []).append(i)
    truth = {pair for members in families.values() for pair in itertools.combinations(members, 2)}
    return [t for t, _, _ in items], truth, {i: k for i, (_, _, k) in enumerate(items) if k}


def html_page(text: str, url: str) -> bytes:
    paras = text.split("\n\n")
    title = html.escape(" ".join(paras[0].split()[:8]))
    body = "\n".join("<p>" + "<br>\n".join(html.escape(line) for line in p.split("\n")) + "</p>"
                     for p in paras)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f'</head>\n<body><header><nav><a href="/">Home</a> | <a href="/about">About</a> | '
            f'<a href="/contact">Contact</a></nav></header>\n<main><article><h1>{title}</h1>\n'
            f'{body}\n</article></main>\n<footer><p>{html.escape(url.split("/")[2])}</p></footer>'
            f"</body></html>\n").encode()


def _warc_record(writer, url: str, payload: bytes, content_type: str, n: int):
    from warcio.statusandheaders import StatusAndHeaders

    http = StatusAndHeaders("200 OK", [("Content-Type", content_type),
                                       ("Content-Length", str(len(payload)))], protocol="HTTP/1.1")
    headers = {"WARC-Date": "2024-05-18T00:00:00Z",  # fixed: the same corpus for every run
               "WARC-Record-ID": f"<urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, f'{url}#{n}')}>",
               "WARC-Identified-Payload-Type": content_type.split(";")[0]}
    return writer.create_warc_record(url, "response", payload=io.BytesIO(payload),
                                     http_headers=http, warc_headers_dict=headers)


def write_corpus(n_docs: int, seed: int, root: Path, shared: Path = SHARED_DATA,
                 docs_per_file: int = DOCS_PER_FILE) -> Corpus:
    from warcio.warcwriter import WARCWriter

    texts, truth, junk = build_texts(n_docs, seed, shared)
    rng = random.Random(seed + 1)
    urls = [f"https://site{rng.randrange(1000):03d}.example.com/page/{i:07d}.html"
            for i in range(n_docs)]
    is_html = [rng.random() < HTML_FRACTION for _ in range(n_docs)]
    bad = 0
    for kind in ("warc", "jsonl"):
        (root / kind).mkdir(parents=True)
        chosen = [i for i in range(n_docs) if is_html[i] == (kind == "warc")]
        for f, start in enumerate(range(0, len(chosen), docs_per_file)):
            part = chosen[start:start + docs_per_file]
            bad_at = rng.randrange(len(part))
            if kind == "warc":
                with open(root / kind / f"part-{f:05d}.warc.gz", "wb") as out:
                    writer = WARCWriter(out, gzip=True)
                    for j, i in enumerate(part):
                        if j == bad_at:  # an image: not a document
                            png = b"\x89PNG\r\n\x1a\n" + rng.randbytes(2000)
                            writer.write_record(_warc_record(writer, f"{urls[i]}.png", png,
                                                             "image/png", 0))
                        writer.write_record(_warc_record(writer, urls[i], html_page(texts[i], urls[i]),
                                                         "text/html; charset=utf-8", 1))
                bad += 1
            else:
                with gzip.open(root / kind / f"part-{f:05d}.jsonl.gz", "wt", encoding="utf-8") as out:
                    for j, i in enumerate(part):
                        if j == bad_at:  # a line that is not JSON, a record without text
                            out.write('{"id": "broken", "text": "cut off\n')
                            out.write(json.dumps({"id": f"empty-{i}", "url": f"{urls[i]}?empty"}) + "\n")
                        out.write(json.dumps({"id": f"doc-{i:07d}", "text": texts[i], "url": urls[i]}) + "\n")
                bad += 2
    nbytes = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    return Corpus(root=root, urls=urls, truth=truth, junk=junk, bad_records=bad, nbytes=nbytes)
