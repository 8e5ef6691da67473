"""collect+clean: large input files split into several work units (`collect.unit_mb`). The parts of
a file read exactly the events of the whole file (same records, order, reasons and places), and a
stage run with tiny units writes the same bytes as one with a unit per file; resume works per
part."""
from __future__ import annotations

import codecs
import itertools
import json
import random
from pathlib import Path

import pydantic
import pytest
from collect_helpers import KilledAfter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bench.harness.fuzz as fuzz
import gristmill.tasks.collect.stage as collect
from gristmill.core.stage import SerialEngine
from gristmill.tasks.collect.read.readers import WHOLE, Part, RawDoc, Skipped, read_file, split_file

DOLMA = Path("jsonl") / "dolma_cc"
WARCS = ["dolma_wget/sample-0000.warc.gz", "dolma_wget/sample-0001.warc.gz",
         "ukwa_test_suite/IAH-urls-wget.warc.gz", "ukwa_test_suite/sopa-wikipedia-homepage.warc.gz",
         "warcio_examples/example-digest.warc", "commoncrawl_whirlwind/whirlwind.warc.wet.gz"]


def _in_parts(path: Path, unit_bytes: int, **kwargs) -> tuple[list[Part], list[RawDoc | Skipped]]:
    parts = split_file(path, unit_bytes)
    return parts, [e for part in parts for e in read_file(path, part=part, **kwargs)]


def _real_lines(shared_data: Path) -> list[bytes]:
    return [line for p in sorted((shared_data / DOLMA).glob("*.jsonl"))
            for line in p.read_bytes().splitlines(keepends=True)]


def _parquet(path: Path, shared_data: Path, rows_per_group: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [json.loads(line) for line in _real_lines(shared_data)]
    table = pa.table({"text": [r["text"] for r in records], "id": [r["id"] for r in records],
                      "url": [r["metadata"]["url"] for r in records]})
    pq.write_table(table, path, row_group_size=rows_per_group)
    return path


# --- readers: the parts of a file read what the whole file reads -----------------------------

@pytest.mark.parametrize("name", WARCS)
def test_warc_parts_read_the_whole_file(shared_data, name):
    path = shared_data / "warc" / name
    whole = list(read_file(path))
    n_parts = set()
    for unit_bytes in (1, 4_000, 50_000):
        parts, events = _in_parts(path, unit_bytes)
        assert events == whole  # same records, order, reasons and places (file@<offset>)
        n_parts.add(len(parts))
    if path.stat().st_size > 50_000:
        assert len(n_parts) == 3 and min(n_parts) > 1


def test_parts_of_a_record_based_file_start_at_records(shared_data):
    path = shared_data / "warc" / "dolma_wget" / "sample-0000.warc.gz"
    offsets = [int(e.where.rsplit("@", 1)[1]) for e in read_file(path)]
    parts = split_file(path, 10_000)
    assert len(parts) > 5 and parts[-1].end is None
    assert parts[0].start == 0 and {p.start for p in parts} <= set(offsets)
    assert all(a.end == b.start for a, b in itertools.pairwise(parts))


def test_damaged_warcs_read_the_same_in_parts(shared_data, tmp_path):
    data = (shared_data / "warc" / "dolma_wget" / "sample-0001.warc.gz").read_bytes()
    cut = tmp_path / "cut.warc.gz"  # ends inside a record
    cut.write_bytes(data[: len(data) // 2])
    garbled = tmp_path / "garbled.warc.gz"  # a damaged stretch in the middle
    middle = len(data) // 2
    garbled.write_bytes(data[:middle] + b"X" * 3000 + data[middle + 3000:])
    for path, reason in ((cut, "error_truncated_record"), (garbled, "error_corrupt_warc")):
        whole = list(read_file(path))
        assert reason in {e.reason for e in whole if isinstance(e, Skipped)}
        for unit_bytes in (1, 5_000):
            assert _in_parts(path, unit_bytes)[1] == whole
    # damage the framing pass sees keeps the file whole: its resync is read as before
    assert split_file(garbled, 5_000) == [WHOLE]


def test_jsonl_parts_are_line_aligned_and_read_each_line_once(shared_data, tmp_path):
    real = _real_lines(shared_data)
    short = [json.dumps({"text": json.loads(line)["text"][:200], "url": f"https://x.org/{i}"}).encode()
             for i, line in enumerate(real[:4])]
    lines = [codecs.BOM_UTF8 + short[0] + b"\n", b"this is not json\n", b"\n",
             b'{"text": "caf\xe9"}\n', short[1] + b"\r\n", b"   \n", real[0], b"[1, 2]\n",
             short[2] + b"\n", b"{\n", short[3]]  # the last line has no line end
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"".join(lines))
    max_doc_bytes = 1_000  # real[0] (1.3 kB) is skipped as too large, in whichever part it starts
    whole = list(read_file(path, max_doc_bytes=max_doc_bytes))
    reasons = sorted(e.reason for e in whole if isinstance(e, Skipped))
    assert reasons == ["error_bad_json", "error_bad_json", "error_invalid_utf8", "error_missing_text",
                       "skipped_too_large"]
    assert [d.payload[:50] for d in whole if isinstance(d, RawDoc)] == \
        [json.loads(s)["text"][:50] for s in short]
    size = path.stat().st_size
    for unit_bytes in (*range(1, 40), 100, 1_000, size - 1):
        parts, events = _in_parts(path, unit_bytes, max_doc_bytes=max_doc_bytes)
        assert events == whole, unit_bytes
        assert parts[0].start == 0 and parts[-1].end == size and len(parts) == -(-size // unit_bytes)
        assert all(a.end == b.start for a, b in itertools.pairwise(parts))  # they tile the file


def test_unsplittable_files_are_one_part(shared_data, tmp_path):
    compressed = shared_data / DOLMA / "documents-000.json.gz"  # one gzip stream: not seekable
    text = shared_data / "corpus" / "botchan_en.txt"  # one document
    small = shared_data / DOLMA / "cc_en_head-0091.jsonl"
    for path, unit_bytes in ((compressed, 1_000), (text, 1_000), (small, small.stat().st_size)):
        assert split_file(path, unit_bytes) == [WHOLE]
    assert len(split_file(small, small.stat().st_size - 1)) == 2


def test_parquet_parts_are_runs_of_row_groups(shared_data, tmp_path):
    path = _parquet(tmp_path / "docs.parquet", shared_data, rows_per_group=3)
    whole = list(read_file(path))
    assert len(whole) == 20 and whole[7].where == f"{path}#7"
    for unit_bytes in (1, 20_000):
        parts, events = _in_parts(path, unit_bytes)
        assert events == whole  # row numbers count from the file's first row
        assert len(parts) > 1 and parts[0].start == 0 and parts[-1].end == 7  # 7 row groups
    assert split_file(path, 1) == [Part(g, g + 1) for g in range(7)]


def test_a_damaged_row_group_is_one_error_and_the_next_is_read(shared_data, tmp_path):
    import pyarrow.parquet as pq

    path = _parquet(tmp_path / "docs.parquet", shared_data, rows_per_group=3)
    page = pq.ParquetFile(path).metadata.row_group(1).column(0).data_page_offset  # rows 3-5's text
    data = bytearray(path.read_bytes())
    data[page:page + 8] = b"\xff" * 8  # a page header that cannot be decoded
    path.write_bytes(data)
    whole = list(read_file(path))
    assert [e.where.rsplit("#", 1)[1] for e in whole] == ["0", "1", "2", "3", *map(str, range(6, 20))]
    assert whole[3].reason == "error_corrupt_parquet" and all(isinstance(e, RawDoc) for e in whole[4:])
    assert _in_parts(path, 1)[1] == whole


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(sorted(fuzz.FAULTS)), seed=st.integers(0, 2**16),
       n_parts=st.integers(2, 12))
def test_fuzzed_inputs_read_the_same_in_parts(tmp_path_factory, kind, seed, n_parts):
    """Damaged and odd files of every kind (bench/harness/damaged.py's faults): whatever a file holds, its
    parts read the whole file's events."""
    made = fuzz.FAULTS[kind](random.Random(seed), fuzz.PROSE)
    path = tmp_path_factory.mktemp("fuzz") / made.name
    path.write_bytes(made.data)
    whole = list(read_file(path, max_doc_bytes=fuzz.MAX_DOC_BYTES))
    unit_bytes = max(1, len(made.data) // n_parts)
    assert _in_parts(path, unit_bytes, max_doc_bytes=fuzz.MAX_DOC_BYTES)[1] == whole


# --- the stage -------------------------------------------------------------------------------

def _inputs(shared_data: Path, tmp_path: Path) -> list[str]:
    """Real WARC, JSONL and Parquet files, one JSONL with bad lines between real ones."""
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    real = _real_lines(shared_data)
    (inputs / "bad.jsonl").write_bytes(b"".join(
        [real[0], b"{oops\n", real[1], b'{"text": "caf\xe9"}\n', real[2][: len(real[2]) // 2] + b"\n",
         *real[3:9]]))
    _parquet(inputs / "docs.parquet", shared_data, rows_per_group=2)
    return [str(shared_data / "warc" / "dolma_wget"), str(shared_data / "warc" / WARCS[2]),
            str(shared_data / DOLMA / "*.jsonl"), str(inputs)]


def _run(out: Path, engine=None, **config) -> collect.StageResult:
    out.mkdir(parents=True, exist_ok=True)
    return collect.run(collect.Config(**config), out, engine=engine or SerialEngine())


def _files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_tiny_units_write_the_same_bytes_as_one_unit_per_file(shared_data, tmp_path):
    sources = _inputs(shared_data, tmp_path)
    tiny, whole = collect.Config(sources=sources, unit_mb=0.005), collect.Config(sources=sources)
    n_files = len(collect.plan_units(whole, tmp_path))
    assert len(collect.plan_units(tiny, tmp_path)) > 4 * n_files  # 5 kB units: every file splits
    a = _run(tmp_path / "tiny", **tiny.model_dump())
    b = _run(tmp_path / "whole", **whole.model_dump())
    assert a.stats == b.stats and a.stats["docs_out"] > 20
    assert a.stats["error_bad_json"] == 2 and a.stats["error_invalid_utf8"] == 1
    files = _files(tmp_path / "tiny")
    assert files == _files(tmp_path / "whole")  # docs, funnel.json, review/ (quarantine), index
    quarantined = [json.loads(line) for line in files["review/quarantine.jsonl"].splitlines()]
    assert {q["reason"] for q in quarantined} == {"error_bad_json", "error_invalid_utf8"}


def test_resume_redoes_only_unfinished_parts(shared_data, tmp_path):
    sources = [str(shared_data / "warc" / "dolma_wget"), str(shared_data / DOLMA / "*.jsonl")]
    config = {"sources": sources, "unit_mb": 0.02}
    n_units = len(collect.plan_units(collect.Config(**config), tmp_path))
    assert n_units > 10
    with pytest.raises(RuntimeError, match="killed"):
        _run(tmp_path / "out", KilledAfter(4), **config)
    resumed_engine = KilledAfter()
    resumed = _run(tmp_path / "out", resumed_engine, **config)
    assert resumed_engine.units == n_units - 4
    fresh = _run(tmp_path / "fresh", **config)
    assert resumed.stats == fresh.stats and _files(tmp_path / "out") == _files(tmp_path / "fresh")


def test_resume_with_another_unit_size_reuses_only_the_same_parts(shared_data, tmp_path):
    sources = [str(shared_data / "warc" / "dolma_wget"), str(shared_data / DOLMA / "*.jsonl")]
    with pytest.raises(RuntimeError, match="killed"):
        _run(tmp_path / "out", KilledAfter(6), sources=sources, unit_mb=0.02)
    # the partial dir is the same (unit_mb is not hashed); results of other parts are not reused
    resumed = _run(tmp_path / "out", sources=sources, unit_mb=0.05)
    fresh = _run(tmp_path / "fresh", sources=sources)
    assert resumed.stats == fresh.stats and _files(tmp_path / "out") == _files(tmp_path / "fresh")


class ChangesInputs(SerialEngine):
    """Runs `change()` after the plan and before the units read their files, as another process
    deleting or rewriting an input mid-run would."""

    def __init__(self, change):
        self.change = change

    def map(self, fn, items):
        if fn is collect.process_unit:
            self.change()
        return super().map(fn, items)


def test_an_input_gone_or_resized_after_listing_is_a_counted_error_per_unit(shared_data, tmp_path):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    real = _real_lines(shared_data)
    gone, cut, kept = (inputs / f"{name}.jsonl" for name in ("gone", "cut", "kept"))
    for path, lines in ((gone, real[:8]), (cut, real[8:16]), (kept, real[16:24])):
        path.write_bytes(b"".join(lines))
    config = {"sources": [str(inputs)], "unit_mb": cut.stat().st_size / 3 / 1e6}  # cut: 3 or more units
    units = collect.plan_units(collect.Config(**config), tmp_path)
    n_units = {p: sum(u.path == str(p) for u in units) for p in (gone, cut, kept)}
    planned = {p: p.stat().st_size for p in (gone, cut)}

    def change() -> None:
        gone.unlink()
        cut.write_bytes(cut.read_bytes()[: planned[cut] // 2])  # truncated mid-record

    result = _run(tmp_path / "out", ChangesInputs(change), **config)  # the stage checks its accounting
    assert result.stats["error_input_changed"] == n_units[cut] >= 3
    assert result.stats["error_input_missing"] == n_units[gone] >= 1
    funnel = json.loads((tmp_path / "out" / "funnel.json").read_text())
    assert funnel["accounting"]["balanced"], funnel["accounting"]
    # the bytes of each listed file are counted once; the file left alone reads as it does alone
    only_kept = _run(tmp_path / "alone", sources=[str(kept)])
    assert result.stats["docs_out"] == only_kept.stats["docs_out"] > 0


def test_unit_size_is_validated_and_not_hashed():
    assert collect.Config(unit_mb=0.001).hashed_dict() == collect.Config().hashed_dict()
    assert "unit_mb" not in collect.Config().hashed_dict()
    with pytest.raises(pydantic.ValidationError, match="unit_mb"):
        collect.Config(unit_mb=0)


def test_unit_results_are_named_by_what_they_read(tmp_path):
    config = collect.Config(sources=["x.jsonl"])
    a = collect.WorkUnit(config=config, source="x.jsonl", index=1, path="x.jsonl", part=Part(0, 10))
    b = collect.WorkUnit(config=config, source="x.jsonl", index=1, path="x.jsonl", part=Part(0, 20))
    assert collect.unit_result_path(tmp_path, a) != collect.unit_result_path(tmp_path, b)
    assert Path(collect.unit_result_path(tmp_path, a)).name.startswith("unit-00001-")


def test_a_stage_killed_in_its_corpus_level_steps_redoes_only_their_unfinished_tasks(
        shared_data, tmp_path, monkeypatch):
    """Killed in exact dedup's hash ranges, then in near dedup's key ranges: each rerun redoes
    only what was not finished (units, runs, chunks and ranges written before are reused), and
    the output is a fresh run's, byte for byte."""
    from corpus_helpers import DiesPartWay

    import gristmill.tasks.collect.dedup.exact_dedup as exact_dedup
    import gristmill.tasks.collect.dedup.near as dedup

    monkeypatch.setattr(exact_dedup, "RUN_ROWS", 16)
    original = sorted((shared_data / DOLMA).glob("*.jsonl"))[0]
    edited = tmp_path / "edited.jsonl"  # each document with a word more: a near-duplicate
    edited.write_text("".join(json.dumps({**record, "text": record["text"] + " Indeed."}) + "\n"
                              for record in map(json.loads, original.read_text().splitlines())))
    sources = [str(shared_data / "warc" / "dolma_wget"), str(shared_data / DOLMA / "*.jsonl"),
               str(original), str(edited)]  # and a file twice: exact duplicates
    config = {"sources": sources, "dedup": {"chunk_docs": 8, "partition_mb": 0.0005}}
    with pytest.raises(RuntimeError, match="killed"):
        _run(tmp_path / "out", DiesPartWay(exact_dedup._partition_task, 1), **config)
    with pytest.raises(RuntimeError, match="killed"):
        second = DiesPartWay(dedup._partition_task, 5)
        _run(tmp_path / "out", second, **config)
    resumed = DiesPartWay()
    result = _run(tmp_path / "out", resumed, **config)
    runs, hash_ranges = (len(second.done[f"exact_dedup.{task}"]) for task in ("_run_task", "_partition_task"))
    assert runs >= 2 and second.done["exact_dedup._run_task"] == [True] * runs
    assert second.done["exact_dedup._partition_task"] == [True] + [False] * (hash_ranges - 1)
    chunks, ranges = (len(resumed.done[f"near.{task}"]) for task in ("_chunk_task", "_partition_task"))
    assert resumed.done["exact_dedup._partition_task"] == [True] * hash_ranges and hash_ranges >= 2
    assert resumed.done["near._chunk_task"] == [True] * chunks and chunks >= 3
    assert resumed.done["near._partition_task"] == [True] * 5 + [False] * (ranges - 5)
    fresh = _run(tmp_path / "fresh", **config)
    assert result.stats == fresh.stats
    assert result.stats["near_duplicates"] > 0 and result.stats["exact_duplicates"] > 0
    assert _files(tmp_path / "out") == _files(tmp_path / "fresh")


def test_a_unit_holds_a_batch_of_records_bounded_in_count_and_in_bytes():
    """The chain runs a step at a time over a batch of a unit's records: BATCH_RECORDS small
    ones, or fewer large ones once their payloads reach BATCH_BYTES, every record in order once."""
    def records(sizes):
        return [RawDoc(url=f"https://example.org/{i}", payload=b"", is_html=False, nbytes=n)
                for i, n in enumerate(sizes)]

    small = records([5_000] * (2 * collect.BATCH_RECORDS + 7))
    assert [len(b) for b in collect._batches(iter(small))] == [collect.BATCH_RECORDS] * 2 + [7]
    large = records([collect.BATCH_BYTES // 3 + 1] * 7 + [0])
    batches = list(collect._batches(iter(large)))
    assert [len(b) for b in batches] == [3, 3, 2]
    assert [r.url for b in batches for r in b] == [r.url for r in large]
