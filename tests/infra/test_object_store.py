"""Inputs and artifacts on an object store, an S3-compatible server on 127.0.0.1 (the `s3_server`
fixture: moto's server mode over HTTP, read with s3fs as any fsspec URL).

Inputs: collect reads `s3://` sources, each file in byte ranges as from disk, in the pipeline's
Ray workers too; an object deleted after the run listed it is counted, not fatal.
Artifacts (`GRISTMILL_STORE=s3://...`, infra/remote_store.py): an output exists once its manifest
object does, another machine (another local copy) downloads it, two runs at once compute a key
once, a lease left by a killed run is taken over, and the CLI commits, resumes after kill -9 and
reuses there."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from collect_helpers import TINY_CLEANING, KilledAfter
from pipeline_helpers import REPO, cli_env, committed_dir, gristmill, manifest_files, plan_of

import gristmill.tasks.collect.stage as collect
from gristmill.core import object_store
from gristmill.core.stage import SerialEngine
from gristmill.infra.artifacts import ArtifactStore
from gristmill.infra.remote_store import Holder, RemoteStore, StoreURLError
from gristmill.tasks.collect.read.texts import Texts

FILES = {"warc/a.warc.gz": "warc/dolma_wget/sample-0000.warc.gz",
         "warc/b.warc.gz": "warc/dolma_wget/sample-0001.warc.gz",
         "jsonl/c.jsonl": "jsonl/dolma_cc/cc_en_head-0091.jsonl"}
UNIT_MB = 0.02  # every file splits into several units, each read as a byte range


def _upload(shared_data: Path, prefix: str, local: Path) -> list[Path]:
    """FILES under the URL `prefix` (a bare name: s3://crawl/PREFIX) and into `local`; returns the
    local copies."""
    url = prefix if "://" in prefix else f"s3://crawl/{prefix}"
    for key, source in FILES.items():
        object_store.put_file(shared_data / source, f"{url}/{key}")
        (local / key).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shared_data / source, local / key)
    return [local / key for key in FILES]


def _texts(out: Path) -> list[str]:
    return sorted(json.loads(line)["text"] for part in sorted((out / "docs").glob("*.jsonl.gz"))
                  for line in gzip.open(part, "rt"))


def _run(sources: list[str], out: Path, engine=None, **config) -> collect.StageResult:
    out.mkdir(parents=True)
    return collect.run(collect.Config(sources=sources, unit_mb=UNIT_MB, **config), out,
                       engine=engine or SerialEngine())


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
def test_the_pipeline_on_a_bucket_that_drops_connections_resumes_a_kill_and_another_machine_reuses_it(
        faulty_endpoint, shared_data, prefect_server, tmp_path):
    """`gristmill run --until tokenize` with sources and `GRISTMILL_STORE` in the same bucket, on S3
    and on GCS, every connection through the fault proxy (some reset mid-transfer, some delayed);
    one run shared by these checks:

    1. killed (-9) just after tokenize wrote its manifest locally: collect is on the bucket, tokenize
       is not, and its lease stays behind; the next run takes the lease over, finishes the commit
       from the partial output without computing again, and leaves no lease;
    2. collect's Ray workers read their units from the bucket (the variables reach them) and keep
       what a run over the same files on disk keeps, resets and all;
    3. pretraining on it as well, checkpointing through the proxy: the key and bytes of the same
       pretraining with its store on disk (ranks on two nodes checkpoint through it in
       tests/infra/test_cluster.py);
    4. another machine (a fresh home, the same store) plans the three stages as reused and its run
       downloads them, byte for byte;
    5. the key follows the objects (their ETags or generations): a rewritten one is collected anew."""
    scheme, endpoint, proxy = faulty_endpoint
    bucket = f"{scheme}://crawl/cli-{os.getpid()}-{time.time_ns()}"
    _upload(shared_data, bucket, tmp_path / "local")
    home = tmp_path / "home"
    overrides = [f"collect.sources=[{bucket}/warc/,{bucket}/jsonl/]", f"collect.unit_mb={UNIT_MB}"]
    services = {**prefect_server, **endpoint, "GRISTMILL_STORE": f"{bucket}/artifacts"}
    args = ["run", "configs/tiny.yaml", *overrides, "--until", "tokenize"]
    killed = subprocess.run([sys.executable, "-m", "gristmill", *args], cwd=REPO, capture_output=True, text=True,
                            env={**cli_env(home, services), "GRISTMILL_FAULT": "commit:tokenize"}, timeout=600)
    assert killed.returncode != 0
    on_bucket = object_store.find(f"{bucket}/artifacts")
    collect_key = committed_dir(home, "collect").name.split("-", 1)[1]
    partial = next((home / "artifacts" / "tokenize").glob("*.partial"))
    tokenize = partial.name.removesuffix(".partial")
    assert f"collect/collect-{collect_key}/manifest.json" in on_bucket
    assert f"tokenize/{tokenize}.lease" in on_bucket
    assert not any(k.startswith(f"tokenize/{tokenize}/") for k in on_bucket)
    resumed = gristmill(home, *args, services=services)
    assert "finishing the commit an earlier run was stopped in" in resumed.stdout + resumed.stderr
    assert "tokenize: done in" in resumed.stdout + resumed.stderr  # the stage ran, the work did not
    on_bucket = object_store.find(f"{bucket}/artifacts")
    assert f"tokenize/{tokenize}/manifest.json" in on_bucket and not any(k.endswith(".lease") for k in on_bucket)

    local = _run([str(tmp_path / "local" / "warc"), str(tmp_path / "local" / "jsonl")], tmp_path / "disk",
                 **TINY_CLEANING)  # as the run of configs/tiny.yaml cleaned
    assert _texts(committed_dir(home, "collect")) == _texts(tmp_path / "disk")
    manifest = json.loads((committed_dir(home, "collect") / "manifest.json").read_text())
    assert manifest["stats"]["docs_out"] == local.stats["docs_out"]
    assert manifest["stats"]["store_retries"] >= 0  # the driver's own retries, in the stage's stats

    pretrain = [*overrides, "pretrain.max_steps=20", "pretrain.checkpoint_every=10"]
    gristmill(home, "run", "configs/tiny.yaml", *pretrain, "--until", "pretrain", services=services)
    on_disk = tmp_path / "store-on-disk"
    for stage in ("collect", "tokenize"):
        shutil.copytree(committed_dir(home, stage), on_disk / "artifacts" / stage / committed_dir(home, stage).name)
    gristmill(on_disk, "run", "configs/tiny.yaml", *pretrain, "--until", "pretrain",
              services={**prefect_server, **endpoint})  # the sources stay on the bucket, the store does not
    ours, theirs = committed_dir(home, "pretrain"), committed_dir(on_disk, "pretrain")
    assert ours.name == theirs.name and manifest_files(ours) == manifest_files(theirs)
    assert "store_retries" in json.loads((ours / "manifest.json").read_text())["stats"]

    other = tmp_path / "other-machine"
    assert plan_of(other, pretrain, "--until", "pretrain", services=services) == \
        {"collect": "reuse", "tokenize": "reuse", "pretrain": "reuse"}
    assert not (other / "artifacts").exists()  # planning downloads nothing
    gristmill(other, "run", "configs/tiny.yaml", *pretrain, "--until", "pretrain", services=services)
    for stage in ("collect", "tokenize", "pretrain"):
        ours, theirs = committed_dir(other, stage), committed_dir(home, stage)
        assert ours.name == theirs.name
        files = json.loads((theirs / "manifest.json").read_text())["files"]
        assert all((ours / rel).read_bytes() == (theirs / rel).read_bytes() for rel in [*files, "manifest.json"])
    assert proxy.resets > 0 and proxy.delays > 0  # the bucket did misbehave

    # one object rewritten with one record fewer: a new key, collected anew
    lines = (tmp_path / "local" / "jsonl" / "c.jsonl").read_bytes().splitlines(keepends=True)
    object_store.put_bytes(f"{bucket}/jsonl/c.jsonl", b"".join(lines[1:]))
    assert plan_of(home, overrides, "--until", "collect", services=services)["collect"] == "run"


class OnTheBucket(KilledAfter):
    """An engine whose workers share no disk with this machine: they write a stage folder's work
    files under s3://crawl/PREFIX (as RayEngine does with the store on a bucket)."""

    def __init__(self, prefix: str, local_root: Path, n: int | None = None):
        super().__init__(n)
        self.prefix, self.local_root, self.jobs = prefix, local_root, []

    def map(self, fn, items):
        self.jobs.extend(items)
        return super().map(fn, items)

    def worker_dirs(self, local: Path) -> str:
        return f"s3://crawl/{self.prefix}/{local.relative_to(self.local_root).as_posix()}"


def test_collects_units_on_the_bucket_resume_on_another_machine(s3_server, shared_data, tmp_path):
    """Work-unit results go to the bucket, never to the machine's partial folder; a run killed
    after 3 units is resumed by another machine (another local folder) from those 3, and the
    output is a local run's, byte for byte; near dedup's workers read the kept texts from the units'
    spool files on the bucket; the units are removed once the output is written."""
    local = [str(p) for p in _upload(shared_data, "units", tmp_path / "local")]
    config = collect.Config(sources=local, unit_mb=UNIT_MB)
    n_units = len(collect.plan_units(config, tmp_path))
    first, second = tmp_path / "one" / "collect-k.partial", tmp_path / "two" / "collect-k.partial"
    for out in (first, second):
        out.mkdir(parents=True)
    with pytest.raises(RuntimeError, match="killed"):
        collect.run(config, first, engine=OnTheBucket("units-store", tmp_path / "one", n=3))
    on_bucket = _objects("units-store/collect-k.partial/units/")
    assert len(on_bucket) == 6 and sum(k.endswith(collect.SPOOL_SUFFIX) for k in on_bucket) == 3
    assert not (first / collect.UNITS_DIR).exists()
    resumed = OnTheBucket("units-store", tmp_path / "two")
    result = collect.run(config, second, engine=resumed)
    assert resumed.units == n_units - 3 and n_units > 6
    signature_jobs = [job for job in resumed.jobs if isinstance(job[0], Texts)]
    assert signature_jobs and all(path.startswith("s3://crawl/units-store/")
                                  for job in signature_jobs for path in job[0].paths)
    plain = _run(local, tmp_path / "plain")
    assert result.stats == plain.stats
    assert (second / "docs").exists() and all(
        (second / "docs" / p.name).read_bytes() == p.read_bytes() for p in (tmp_path / "plain" / "docs").iterdir())
    assert _objects("units-store/") == []


class WorksOnTheBucket(SerialEngine):
    """An engine whose workers write where `worker_dirs` says; keeps the jobs it was given."""

    def __init__(self, worker_dirs):
        self.worker_dirs, self.jobs = worker_dirs, []

    def map(self, fn, items):
        self.jobs.extend(items)
        return super().map(fn, items)


def test_tokenize_workers_read_and_write_on_the_bucket_as_on_disk(s3_server, shared_data, tmp_path):
    """Collect committed to the bucket by one machine, tokenized on another whose workers share no
    disk with it: each job reads its shard and the tokenizer from the bucket and writes its parts
    there; the tokens are a local run's, byte for byte, and only committed outputs stay there."""
    from gristmill.tasks.tokenize import stage as tokenize
    from gristmill.tasks.tokenize.config import Config as TokenizeConfig

    url = "s3://crawl/store-tokenize"
    sources = [str(p) for p in _upload(shared_data, "tok", tmp_path / "local")]
    config = collect.Config(sources=sources, unit_mb=UNIT_MB, docs_per_shard=10)

    def run_collect(partial: Path) -> dict:
        stats = collect.run(config, partial, engine=SerialEngine()).stats
        return {"config": {}, "upstream": {}, "stats": stats, "meta": {}}

    _machine(tmp_path, "one", url).materialize("collect", KEY, run_collect)
    other = _machine(tmp_path, "two", url)
    docs = other.load("collect", KEY)
    assert len(list((docs.path / "docs").glob("*.jsonl.gz"))) >= 3
    tokens = TokenizeConfig(vocab_size=1024)
    engine = WorksOnTheBucket(other.remote_location)
    partial = other.partial_dir("tokenize", KEY)
    partial.mkdir(parents=True)
    on_bucket = tokenize.run(tokens, partial, engine=engine, collect=docs)
    assert len(engine.jobs) >= 3 and all(job[k].startswith(f"{url}/") for job in engine.jobs
                                         for k in ("path", "parts_dir", "tokenizer_json"))
    (tmp_path / "plain").mkdir()
    plain = tokenize.run(tokens, tmp_path / "plain", engine=SerialEngine(), collect=docs)
    assert on_bucket.stats == plain.stats
    for name in ("train.bin", "val.bin", "index.json", "meta.json"):
        assert (partial / "tokens" / name).read_bytes() == (tmp_path / "plain" / "tokens" / name).read_bytes()
    assert not (partial / "parts").exists()
    assert [k for k in _objects("store-tokenize/") if not k.startswith(f"collect/collect-{KEY}/")] == []


# ---------------------------------------------------------------- artifacts on the object store

KEY = "0123456789ab"


def _machine(tmp_path: Path, name: str, url: str, lease_s: float = 60.0) -> ArtifactStore:
    """The store as one machine holds it: its own local copy of the bucket's outputs."""
    return ArtifactStore(tmp_path / name, remote=RemoteStore(url, lease_s=lease_s))


def _compute(calls: list[float], seconds: float = 0.0):
    def compute(partial: Path) -> dict:
        calls.append(time.time())
        time.sleep(seconds)
        (partial / "docs").mkdir(exist_ok=True)
        (partial / "docs" / "part-00000.bin").write_bytes(os.urandom(5000))  # equal bytes = a copy
        (partial / "stats.json").write_text('{"n": 1}')
        return {"config": {"a": 1}, "upstream": {}, "stats": {"n": 1}, "meta": {}}
    return compute


def _objects(prefix: str) -> list[str]:
    import boto3

    listed = boto3.client("s3").list_objects_v2(Bucket="crawl", Prefix=prefix).get("Contents", [])
    return sorted(o["Key"].removeprefix(prefix) for o in listed)


def test_an_output_exists_on_the_store_once_its_manifest_object_does_and_another_machine_downloads_it(
        bucket_url, tmp_path, monkeypatch):
    one, other = _machine(tmp_path, "one", bucket_url), _machine(tmp_path, "other", bucket_url)
    calls: list[float] = []
    uploads = object_store.put_file

    def refuses_the_manifest(local: Path, url: str) -> None:  # the store refusing a write
        if url.endswith("/manifest.json"):
            raise PermissionError(f"AccessDenied: {url}")
        uploads(local, url)

    monkeypatch.setattr(object_store, "put_file", refuses_the_manifest)
    with pytest.raises(PermissionError):
        one.materialize("collect", KEY, _compute(calls))
    assert object_store.find(f"{bucket_url}/collect") == [f"collect-{KEY}/config.json",
                                                         f"collect-{KEY}/docs/part-00000.bin",
                                                         f"collect-{KEY}/stats.json"]  # no manifest, no lease
    assert other.load("collect", KEY) is None and not other.has("collect", KEY)
    monkeypatch.undo()

    manifest, reused = one.materialize("collect", KEY, _compute(calls))  # the commit finished
    assert not reused and len(calls) == 1
    assert f"collect-{KEY}/manifest.json" in object_store.find(f"{bucket_url}/collect")
    assert other.has("collect", KEY) and not other.final_dir("collect", KEY).exists()
    copy, reused = other.materialize("collect", KEY, _compute(calls))
    assert reused and len(calls) == 1 and copy.path == other.final_dir("collect", KEY)
    for rel in manifest.files:
        assert (copy.path / rel).read_bytes() == (manifest.path / rel).read_bytes(), rel
    assert copy.key == KEY and copy.stats["n"] == 1 and copy.stats["store_retries"] >= 0


def test_a_manifest_on_the_bucket_listing_a_path_outside_its_artifact_writes_nothing(bucket_url, tmp_path):
    one, other = _machine(tmp_path, "one", bucket_url), _machine(tmp_path, "other", bucket_url)
    one.materialize("collect", KEY, _compute([]))
    name = f"{bucket_url}/collect/collect-{KEY}/manifest.json"
    manifest = json.loads(object_store.read_bytes(name) or b"")
    manifest["files"]["../../../escaped.bin"] = manifest["files"].pop("docs/part-00000.bin")
    object_store.put_bytes(name, json.dumps(manifest).encode())
    with pytest.raises(StoreURLError, match="a path outside the artifact"):
        other.remote.download("collect", KEY, list(manifest["files"]), tmp_path / "into")
    assert not list(tmp_path.rglob("escaped.bin"))


def test_an_output_committed_before_the_store_had_a_bucket_goes_there_when_used(bucket_url, tmp_path):
    ArtifactStore(tmp_path / "one").materialize("collect", KEY, _compute([]))  # no bucket yet
    assert _machine(tmp_path, "other", bucket_url).load("collect", KEY) is None
    here = _machine(tmp_path, "one", bucket_url)
    assert here.load("collect", KEY) is not None  # reused here, and uploaded
    copy = _machine(tmp_path, "other", bucket_url).load("collect", KEY)
    assert copy is not None and (copy.path / "docs" / "part-00000.bin").read_bytes() == \
        (here.final_dir("collect", KEY) / "docs" / "part-00000.bin").read_bytes()


def test_two_runs_at_once_on_two_machines_compute_a_key_once(bucket_url, tmp_path):
    stores = [_machine(tmp_path, f"m{i}", bucket_url) for i in range(3)]
    calls: list[float] = []
    results: dict[int, tuple] = {}

    def run(i: int) -> None:
        results[i] = stores[i].materialize("tokenize", KEY, _compute(calls, seconds=2.0))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(calls) == 1 and sorted(reused for _, reused in results.values()) == [False, True, True]
    assert len({(m.path / "docs" / "part-00000.bin").read_bytes() for m, _ in results.values()}) == 1
    assert object_store.find(f"{bucket_url}/tokenize")[-1] == f"tokenize-{KEY}/stats.json"  # the lease is gone


def test_a_lease_whose_holder_is_gone_is_taken_over_and_a_live_one_waited_for(bucket_url, tmp_path):
    """A lease left by a killed process of this host is taken over at once; one held by another
    host is waited for until it expires, since its holder was not seen to renew it."""
    killed = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                            text=True, check=True)
    store = _machine(tmp_path, "m", bucket_url)
    assert store.remote is not None
    dead = Holder(Holder.me(60).host, int(killed.stdout), time.time() - 5, time.time() + 600)
    assert object_store.create(store.remote.lease_url("collect", KEY), b"{}", dead.metadata()) is not None
    calls: list[float] = []
    store.materialize("collect", KEY, _compute(calls))
    assert len(calls) == 1

    expires = time.time() + 3
    elsewhere = Holder("another-host", 1, 0.0, expires)
    assert object_store.create(store.remote.lease_url("tokenize", KEY), b"{}", elsewhere.metadata()) is not None
    store.materialize("tokenize", KEY, _compute(calls))
    assert len(calls) == 2 and calls[1] >= expires
