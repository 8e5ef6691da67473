"""Inputs on an object store: collect reads `s3://` sources from an S3-compatible server on
127.0.0.1 (the `s3_server` fixture: moto's server mode over HTTP, read with s3fs as any fsspec
URL), each file in byte ranges as from disk, in the pipeline's Ray workers too; an object deleted
after the run listed it is counted, not fatal."""
from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
from pipeline_helpers import committed_dir, gristmill, plan_of

import tasks.collect.stage as collect
from core.stage import SerialEngine

FILES = {"warc/a.warc.gz": "warc/dolma_wget/sample-0000.warc.gz",
         "warc/b.warc.gz": "warc/dolma_wget/sample-0001.warc.gz",
         "jsonl/c.jsonl": "jsonl/dolma_cc/cc_en_head-0091.jsonl"}
UNIT_MB = 0.02  # every file splits into several units, each read as a byte range


def _upload(shared_data: Path, prefix: str, local: Path) -> list[Path]:
    """FILES into s3://crawl/PREFIX/ and into `local`; returns the local copies."""
    import boto3

    s3 = boto3.client("s3")
    for key, source in FILES.items():
        s3.upload_file(str(shared_data / source), "crawl", f"{prefix}/{key}")
        (local / key).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shared_data / source, local / key)
    return [local / key for key in FILES]


def _texts(out: Path) -> list[str]:
    return sorted(json.loads(line)["text"] for part in sorted((out / "docs").glob("*.jsonl.gz"))
                  for line in gzip.open(part, "rt"))


def _run(sources: list[str], out: Path, engine=None) -> collect.StageResult:
    out.mkdir(parents=True)
    return collect.run(collect.Config(sources=sources, unit_mb=UNIT_MB), out, engine=engine or SerialEngine())


def test_collect_reads_an_s3_bucket_as_it_reads_the_same_files_on_disk(s3_server, shared_data, tmp_path):
    _upload(shared_data, "same", tmp_path / "local")
    units = collect.plan_units(collect.Config(sources=["s3://crawl/same/"], unit_mb=UNIT_MB), tmp_path)
    assert len(units) > 2 * len(FILES) and all(u.path.startswith("s3://crawl/same/") for u in units)
    remote = _run(["s3://crawl/same/warc/", "s3://crawl/same/jsonl/*.jsonl"], tmp_path / "s3")
    local = _run([str(tmp_path / "local" / "warc"), str(tmp_path / "local" / "jsonl" / "*.jsonl")],
                 tmp_path / "disk")
    assert remote.stats == local.stats and remote.stats["docs_out"] > 20
    assert _texts(tmp_path / "s3") == _texts(tmp_path / "disk")


def test_an_object_deleted_after_listing_is_counted_and_the_rest_is_kept(s3_server, shared_data, tmp_path):
    """The client lists the bucket once (s3fs caches the listing), so a deleted object is found
    missing only when its bytes are asked for."""
    import boto3

    _upload(shared_data, "gone", tmp_path / "local")

    class DeletesBeforeTheUnitsRun(SerialEngine):
        def map(self, fn, items):
            if fn is collect.process_unit:
                boto3.client("s3").delete_object(Bucket="crawl", Key="gone/jsonl/c.jsonl")
            return super().map(fn, items)

    sources = ["s3://crawl/gone/warc/", "s3://crawl/gone/jsonl/*.jsonl"]
    n_parts = sum(u.path.endswith("c.jsonl") for u in collect.plan_units(
        collect.Config(sources=sources, unit_mb=UNIT_MB), tmp_path))
    result = _run(sources, tmp_path / "out", DeletesBeforeTheUnitsRun())
    warcs = _run([str(tmp_path / "local" / "warc")], tmp_path / "warcs-only")
    assert n_parts > 1 and result.stats["error_input_missing"] == n_parts  # one per unit of the file
    assert _texts(tmp_path / "out") == _texts(tmp_path / "warcs-only") and warcs.stats["docs_out"] > 10
    funnel = json.loads((tmp_path / "out" / "funnel.json").read_text())
    assert funnel["accounting"]["balanced"]


@pytest.mark.slow
def test_the_pipelines_ray_workers_read_the_bucket_and_a_rerun_reuses_it(s3_server, shared_data, prefect_server,
                                                                          tmp_path):
    """`gristmill run --until collect` with s3:// sources: its Ray workers read their units from the
    server (the AWS variables reach them), the output holds what a run over the same files on disk
    keeps, and the run's key follows the objects (their ETags): the same objects are reused, a
    rewritten one is collected anew."""
    _upload(shared_data, "cli", tmp_path / "local")
    home = tmp_path / "home"
    overrides = ["collect.sources=[s3://crawl/cli/warc/,s3://crawl/cli/jsonl/]", f"collect.unit_mb={UNIT_MB}"]
    services = {**prefect_server, **s3_server}
    gristmill(home, "run", "configs/tiny.yaml", *overrides, "--until", "collect", services=services)
    local = _run([str(tmp_path / "local" / "warc"), str(tmp_path / "local" / "jsonl")], tmp_path / "disk")
    assert _texts(committed_dir(home, "collect")) == _texts(tmp_path / "disk")
    manifest = json.loads((committed_dir(home, "collect") / "manifest.json").read_text())
    assert manifest["stats"]["docs_out"] == local.stats["docs_out"]
    assert plan_of(home, overrides, "--until", "collect")["collect"] == "reuse"
    import boto3

    s3 = boto3.client("s3")  # one object rewritten with one record fewer: a new key, collected anew
    lines = (tmp_path / "local" / "jsonl" / "c.jsonl").read_bytes().splitlines(keepends=True)
    s3.put_object(Bucket="crawl", Key="cli/jsonl/c.jsonl", Body=b"".join(lines[1:]))
    assert plan_of(home, overrides, "--until", "collect")["collect"] == "run"
