"""What several collect tests share: engines that shuffle or die part way, a local Common Crawl
server, and real web documents with near-copies of them."""
from __future__ import annotations

import gzip
import json
import random
import shutil
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import gristmill.tasks.collect.dedup.exact_dedup as exact_dedup
import gristmill.tasks.collect.dedup.near as dedup
import gristmill.tasks.collect.stage as collect
from gristmill.core.stage import SerialEngine
from gristmill.tasks.collect.clean.cleaning import clean_documents


class ShuffledEngine:
    """Runs items in a seeded random order (as parallel workers may finish them), returns them
    in input order."""

    def __init__(self, seed: int):
        self.seed = seed

    def map(self, fn, items):
        order = list(range(len(items)))
        random.Random(self.seed).shuffle(order)
        results = {i: fn(items[i]) for i in order}
        return [results[i] for i in range(len(items))]


class DiesPartWay(SerialEngine):
    """Runs the first `n` items of a map of `fn`, then dies as a killed driver would; records,
    for every map of a spilling task, which items an earlier attempt had finished (their `done`
    flag), by module and task."""

    def __init__(self, fn=None, n: int = 0):
        self.fn, self.n, self.done = fn, n, {}

    def map(self, fn, items):
        if fn in (dedup._chunk_task, dedup._partition_task, exact_dedup._run_task,
                  exact_dedup._partition_task):
            self.done[f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}"] = [item[-2] for item in items]
        if fn is self.fn:
            super().map(fn, items[:self.n])
            raise RuntimeError("killed")
        return super().map(fn, items)


DOLMA = Path("jsonl") / "dolma_cc"  # real Common Crawl documents (Dolma) in the shared data
CRAWL = "CC-MAIN-2024-22"  # a crawl id of the real shape; the local server serves the files below under it


# (name in the crawl, file in shared data) in listing order
WARC_FILES = [
    ("whirlwind.warc.gz", "commoncrawl_whirlwind/whirlwind.warc.gz"),
    ("sample-0000.warc.gz", "dolma_wget/sample-0000.warc.gz"),
    ("example.warc.gz", "warcio_examples/example.warc.gz"),
    ("sample-0001.warc.gz", "dolma_wget/sample-0001.warc.gz"),
]


WET_FILES = [("whirlwind.warc.wet.gz", "commoncrawl_whirlwind/whirlwind.warc.wet.gz")]


class Handler(BaseHTTPRequestHandler):
    """Static files under `root` with Range support, plus faults set per path in `faults`:
    {"503": n} answers 503 n times; {"drop": n} sends half the body then closes, n times;
    {"corrupt": n} serves a copy with flipped bytes n times (0 or absent: behave)."""

    root: Path
    faults: dict[str, Counter]
    requests: list[tuple[str, str | None]]  # (path, Range header)
    ignore_range = False

    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    def _fault(self, kind: str) -> bool:
        counter = self.faults.get(self.path)
        if counter and counter[kind] > 0:
            counter[kind] -= 1
            return True
        return False

    def do_GET(self) -> None:
        self.requests.append((self.path, self.headers.get("Range")))
        file = self.root / self.path.lstrip("/")
        if self._fault("503"):
            return self.send_error(503, "Slow Down")
        if not file.is_file():
            return self.send_error(404, "Not Found")
        data = file.read_bytes()
        if self._fault("corrupt"):
            middle = len(data) // 2
            data = data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 64]) + \
                data[middle + 64:]
        start = 0
        ranged = self.headers.get("Range")
        if ranged and not self.ignore_range:
            start = int(ranged.removeprefix("bytes=").split("-")[0])
            if start >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self._fault("drop"):
            body = body[: len(body) // 2]  # then the connection closes (HTTP/1.0)
        self.wfile.write(body)


def _write_listing(root: Path, kind: str, files: list[tuple[str, str]], shared: Path) -> None:
    lines = []
    for name, source in files:
        rel = f"crawl-data/{CRAWL}/segments/1716000000000.0/{kind}/{name}"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(shared / "warc" / source, root / rel)
        lines.append(rel)
    listing = root / "crawl-data" / CRAWL / f"{kind}.paths.gz"
    listing.write_bytes(gzip.compress("\n".join(lines).encode() + b"\n"))


@pytest.fixture
def crawl_server(tmp_path, shared_data):
    """A crawl layout under tmp_path/site, served on 127.0.0.1; yields the handler class."""
    root = tmp_path / "site"
    _write_listing(root, "warc", WARC_FILES, shared_data)
    _write_listing(root, "wet", WET_FILES, shared_data)
    handler = type("TestHandler", (Handler,), {"root": root, "faults": {}, "requests": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    handler.base_url = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield handler
    httpd.shutdown()
    httpd.server_close()


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t, "url": f"https://example.org/{i}"}) + "\n"
                            for i, t in enumerate(texts)))
    return path


def web_documents(shared_data: Path, n: int) -> list[str]:
    """Real web documents (of 200+ words in 5+ paragraphs) that pass the default filters."""
    texts = [json.loads(line)["text"] for p in sorted((shared_data / DOLMA).glob("*.jsonl"))
             for line in p.open()]
    texts = [t for t in texts if len(t.split()) >= 200 and t.count("\n") >= 4]
    outcomes = clean_documents([(t, "") for t in texts], collect.Config())
    return [t for t, outcome in zip(texts, outcomes) if outcome.kept][:n]


def edited(text: str) -> str:
    """A near-copy: boilerplate around it and one paragraph dropped."""
    paragraphs = text.split("\n")
    del paragraphs[len(paragraphs) // 2]
    return "Home | About | Contact\n" + "\n".join(paragraphs) + "\nCopyright 2024 Example Ltd."
