"""Fuzzed inputs for the collect stage: readers and the cleaning chain never raise on bad input,
every fault is a counted drop or a quarantined entry with a sample, every record of an intact
file is counted once, and the funnel's accounting (in = kept + dropped + quarantined) holds on
whole stage runs over damaged files.

Hypothesis runs derandomized (the same examples on every run, so CI cannot turn red on a case
it never met before; `python -m bench.fuzz --seed N` explores further) without an example
database (nothing written into the repo), with max_examples that keep this file near 30 s on two
cores. Byte- and text-level inputs are hypothesis strategies (they shrink to a minimal case);
the structured fault kinds are bench/harness/damaged.py's generators, fed a seed hypothesis draws.
"""
from __future__ import annotations

import gzip
import itertools
import json
import random
import re
import tracemalloc
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bench.harness.fuzz as fuzz
import gristmill.tasks.collect.read.readers as readers
from gristmill.tasks.collect.config import Config
from gristmill.tasks.collect.read.readers import (
    FILE_LEVEL_ERRORS,
    SUPPORTED_SUFFIXES,
    RawDoc,
    Skipped,
    read_file,
)
from gristmill.tasks.collect.stage import document_events

CFG = Config(blocked_domains=("blocked.example.org",))
NO_SAMPLE = {"error_empty_file", "error_no_text_column"}  # the only errors without a sample
REASON = re.compile(r"(skipped|error)_[a-z0-9_]+")


def fuzz_settings(max_examples: int):
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def _read(path, records: int | None) -> list:
    """All events of a file, checked: each is a document or a snake_case reason, each error
    carries a sample for quarantine, each record names its own place in the file, and a file of
    known content shows each record once."""
    events = list(read_file(path, max_doc_bytes=fuzz.MAX_DOC_BYTES))
    for event in events:
        assert isinstance(event, (RawDoc, Skipped)), event
        if isinstance(event, Skipped):
            assert REASON.fullmatch(event.reason), event.reason  # counter and metric names
            if event.reason.startswith("error_") and event.reason not in NO_SAMPLE:
                assert event.sample is not None, event
    places = [e.where for e in events if not (isinstance(e, Skipped) and e.reason in FILE_LEVEL_ERRORS)]
    assert all(places) and len(set(places)) == len(places)  # no record read twice
    if records is not None:
        assert len(places) == records
    return events


# --- readers ---------------------------------------------------------------------------------

@fuzz_settings(200)
@given(data=st.binary(max_size=4096), suffix=st.sampled_from(SUPPORTED_SUFFIXES))
def test_random_bytes_in_any_format_are_counted_not_raised(workdir, data, suffix):
    path = workdir / f"random{suffix}"
    path.write_bytes(data)
    records = (0 if not data else 1 if suffix == ".txt" else
               fuzz.count_jsonl_records(data) if suffix == ".jsonl" else None)
    _read(path, records)


@fuzz_settings(250)
@given(kind=st.sampled_from(sorted(fuzz.FAULTS)), seed=st.integers(0, 2**32 - 1))
def test_every_fault_kind_is_read_and_counted(workdir, kind, seed):
    """Truncated/corrupt gzip and zstd, broken WARC headers, multi-MB lines, encodings, empty
    files, odd JSON lines, Parquet/Arrow garbage (bench/harness/damaged.py)."""
    f = fuzz.FAULTS[kind](random.Random(seed), fuzz.PROSE)
    path = workdir / f"{kind}-{f.name}"
    path.write_bytes(f.data)
    _read(path, f.records)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6)
RECORDS = st.fixed_dictionaries({}, optional={
    "text": st.text() | JSON_VALUES, "url": st.text(max_size=30) | JSON_VALUES,
    "id": st.text(max_size=30) | JSON_VALUES,
    "metadata": st.fixed_dictionaries({"url": st.text(max_size=30) | JSON_VALUES}) | JSON_VALUES})
LINES = st.one_of(RECORDS.map(json.dumps), JSON_VALUES.map(json.dumps)).map(str.encode) \
    | st.binary(max_size=80).map(lambda b: b.replace(b"\n", b""))


def _expected(line: bytes) -> set[str]:
    """What a JSON line may become: a document (or a binary payload) or one counted error."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        return {"error_invalid_utf8"}
    except (ValueError, RecursionError):
        return {"error_bad_json"}
    ok = isinstance(record, dict) and isinstance(record.get("text"), str)
    return {"doc", "skipped_binary"} if ok else {"error_missing_text"}


@fuzz_settings(200)
@given(lines=st.lists(LINES, max_size=15), bom=st.booleans())
def test_each_json_line_is_one_event_of_the_right_kind(workdir, lines, bom):
    data = (fuzz.BOM if bom else b"") + b"\n".join(lines) + b"\n"
    path = workdir / "lines.jsonl"
    path.write_bytes(data)
    events = _read(path, fuzz.count_jsonl_records(data))
    content = [line for i, line in enumerate(lines) if line.strip()]
    kinds = [e.reason if isinstance(e, Skipped) else "doc" for e in events]
    assert all(kind in _expected(line) for kind, line in zip(kinds, content)), (kinds, content)


@pytest.mark.parametrize("damaged", [2, 4, 6])
def test_a_record_longer_than_its_content_length_is_read_once(shared_data, workdir, damaged):
    """A response whose Content-Length says a third of its block: the rest of its gzip member
    is one damaged stretch. warcio then reports an offset before records already read; resuming
    there re-read them for ever (found by the broken_warc fault)."""
    data, members = (shared_data / "warc" / "dolma_wget" / "sample-0000.warc.gz").read_bytes(), []
    while data and len(members) < 8:  # one gzip member per record
        member = zlib.decompressobj(31)
        members.append(member.decompress(data))
        data = member.unused_data
    length = int(re.search(rb"Content-Length: (\d+)", members[damaged])[1])
    members[damaged] = members[damaged].replace(b"Content-Length: %d" % length,
                                                b"Content-Length: %d" % (length // 3), 1)
    path = workdir / "understated.warc.gz"
    path.write_bytes(b"".join(gzip.compress(m, mtime=0) for m in members))
    events = list(itertools.islice(read_file(path), 100))
    reasons = [e.reason if isinstance(e, Skipped) else "doc" for e in events]
    assert reasons.count("error_corrupt_warc") == 1 and len(events) == len(members) + 1
    assert reasons.count("doc") == 3 and reasons.count("skipped_record_request") == 4


def test_a_zstd_bomb_is_decompressed_in_bounded_memory(workdir):
    import zstandard

    compressor = zstandard.ZstdCompressor(level=19).compressobj()
    line = b'{"text": "' + b"a" * (1 << 20)
    data = b"".join(compressor.compress(line) for _ in range(200)) + compressor.flush()
    path = workdir / "bomb.jsonl.zst"
    path.write_bytes(data)  # ~10 KB expanding to 200 MiB: one line, too large
    tracemalloc.start()
    try:
        events = list(read_file(path, max_doc_bytes=fuzz.MAX_DOC_BYTES))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(data) < 100_000 and [e.reason for e in events] == ["skipped_too_large"]
    assert peak < 80 * 2**20  # fed 1 MiB at a time it held all 200 MiB at once


# --- the cleaning chain ----------------------------------------------------------------------

SURROGATES = st.integers(0xD800, 0xDFFF).map(chr)
ODD_TEXT = st.text(st.characters() | SURROGATES | st.sampled_from("\x00\n\r\u2028 .@"), max_size=300)
URLS = st.one_of(st.text(st.characters() | SURROGATES, max_size=40), st.sampled_from(
    ["", "http://[::1", "https://blocked.example.org/a", "http://ex ample.com", "javascript:x",
     "http://xn--e1afmkfd.xn--p1ai/", "http://a:99999999/", "http://\udcff/"]))


def _clean(doc: RawDoc) -> dict:
    [event] = document_events([doc], CFG)
    assert event["reason"] == "kept" or REASON.fullmatch(event["reason"].replace("dropped_", "skipped_", 1))
    json.dumps(event, ensure_ascii=False).encode("utf-8")  # how a unit writes it
    return event


@fuzz_settings(80)
@given(text=ODD_TEXT, url=URLS)
def test_any_text_and_url_get_a_reason_and_can_be_written(text, url):
    _clean(RawDoc(url=url, payload=text, is_html=False, nbytes=len(text)))


@fuzz_settings(40)
@given(prose=st.sampled_from(fuzz.PROSE), edits=st.lists(
    st.tuples(st.integers(0, 2000), ODD_TEXT.map(lambda t: t[:8])), max_size=8), url=URLS)
def test_prose_with_damage_runs_the_whole_chain(prose, edits, url):
    """Text that passes language ID, so the Gopher, FineWeb, C4 and PII steps see the damage."""
    text = prose
    for at, insert in edits:
        text = text[:at] + insert + text[at:]
    _clean(RawDoc(url=url, payload=text, is_html=False, nbytes=len(text)))


@fuzz_settings(40)
@given(html=st.binary(max_size=2000) | st.sampled_from(fuzz.PROSE).map(
    lambda t: f"<html><body><p>{t}</p><div><div><div>".encode("utf-16")))
def test_any_html_bytes_get_a_reason(html):
    _clean(RawDoc(url="https://fuzz.example.org/", payload=html, is_html=True, nbytes=len(html)))


# --- whole stage runs ------------------------------------------------------------------------

@fuzz_settings(20)
@given(kinds=st.lists(st.sampled_from(sorted(fuzz.FAULTS)), min_size=1, max_size=3),
       seed=st.integers(0, 2**32 - 1), weight=st.sampled_from([1.0, 0.5, 2.0]))
def test_stage_accounts_for_every_record_of_fuzzed_sources(workdir, kinds, seed, weight):
    rng = random.Random(seed)
    files = [fuzz.FAULTS[kind](rng, fuzz.PROSE) for kind in kinds]
    trial = fuzz.run_trial(files, workdir / "trial", anchor_weight=weight)
    assert trial.survived, trial.failure
    assert trial.docs_lost == 0 and trial.records_unread == 0


def test_run_fuzz_is_deterministic_and_every_trial_survives(tmp_path):
    first = fuzz.trial_files(random.Random("3:0"))
    assert [(f.name, f.data) for f in first] == \
        [(f.name, f.data) for f in fuzz.trial_files(random.Random("3:0"))]
    result = fuzz.run_fuzz(3, 3, tmp_path)
    assert result["failures"] == []
    assert (result["trials"], result["survived"], result["docs_lost"], result["records_unread"]) \
        == (3, 3, 0, 0)
    assert sum(result["faults"].values()) >= 3 and not list(tmp_path.iterdir())  # cleaned up


def test_a_trial_catches_a_reader_that_loses_a_record(tmp_path, monkeypatch):
    real = readers.read_jsonl
    monkeypatch.setattr(readers, "read_jsonl",
                        lambda f, name, max_bytes, part: itertools.islice(real(f, name, max_bytes, part), 1, None))
    trial = fuzz.run_trial([], tmp_path)  # the intact JSONL source alone, its first record lost
    assert not trial.survived and trial.records_unread == 1 and trial.docs_lost == 0
