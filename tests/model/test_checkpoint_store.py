"""Training checkpoints on an object store (model/checkpoint_bucket.py's BucketPlace, on each backend:
the `s3_server` and `gcs_server` fixtures' buckets) and this node's bounded object cache (core/cache.py).

A work directory under the folder a `StoreMapping` maps keeps its checkpoints on the bucket: files
first, the marker last, so a run stopped between them leaves nothing that counts; another node
(another local folder, an empty cache) resumes from the bucket to the curve of a run never stopped;
a truncated object is reported by URL and the checkpoint before it used; a bucket that cannot be
reached or is gone fails in one line naming it. The cache keeps the newest objects within its
bound, verifies what it downloads, and wiping it changes nothing but time."""
from __future__ import annotations

import hashlib
import logging
import os
import re
import uuid
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from gristmill.core import cache, object_store
from gristmill.core.cache import ObjectCache
from gristmill.core.faults import FAULT_ENV, FAULT_ONCE_ENV, InjectedFault
from gristmill.core.object_store import ObjectDamaged, ObjectStoreError, RetryPolicy
from gristmill.core.stage import MetricsLog, read_metrics
from gristmill.model import presets
from gristmill.model.checkpoint import StoreMapping, checkpoint_place
from gristmill.model.config import LoopConfig
from gristmill.model.loop import train
from gristmill.model.presets import ModelConfig, build_model

TINY = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_seq_len=32)
STAGE_DIR = Path("pretrain") / "pretrain-0123456789ab.partial"  # where a stage works, below the store root
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(params=["s3", "gs"])
def bucket(request, monkeypatch, tmp_path) -> str:
    """A fresh prefix of the test bucket of each backend; the backends made anew so that they read
    this test's variables."""
    request.getfixturevalue("s3_server" if request.param == "s3" else "gcs_server")
    object_store.forget()
    monkeypatch.setattr(object_store, "POLICY", RetryPolicy(attempts=2, first_pause_s=0.01))
    monkeypatch.setenv("GRISTMILL_CACHE", str(tmp_path / "cache-a"))
    return f"{request.param}://crawl/store-{uuid.uuid4().hex[:8]}"


def _endpoint_variable(bucket: str) -> str:
    """The variable that names the bucket's endpoint."""
    return "AWS_ENDPOINT_URL" if bucket.startswith("s3://") else "STORAGE_EMULATOR_HOST"


def _node(monkeypatch, root: Path, url: str, cache_dir: Path) -> tuple[Path, StoreMapping]:
    """Be a node whose store's local copy of `url` is `root` and whose cache is `cache_dir`: its
    stage folder and its store's mapping."""
    monkeypatch.setenv("GRISTMILL_CACHE", str(cache_dir))
    (root / STAGE_DIR).mkdir(parents=True, exist_ok=True)
    return root / STAGE_DIR, StoreMapping(root, url)


def _batch(step: int) -> dict:
    x = torch.randint(0, 200, (4, 17), generator=torch.Generator().manual_seed(step))
    return {"input_ids": x[:, :-1], "labels": x[:, 1:]}


def _fit(tok, work_dir: Path, store_mapping: StoreMapping | None, max_steps: int = 6,
         crash_at: int | None = None) -> dict:
    torch.manual_seed(0)
    model = build_model(TINY, tok)

    def get_batch(step: int) -> dict:
        if step == crash_at:
            raise RuntimeError("simulated crash")
        return _batch(step)

    cfg = LoopConfig(max_steps=max_steps, batch_size=4, checkpoint_every=2, log_every=100, keep_checkpoints=2)
    work_dir.mkdir(parents=True, exist_ok=True)
    return train(model, get_batch, cfg, checkpoint_place(work_dir, store_mapping), MetricsLog(work_dir))


def _losses(work_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(work_dir / "metrics.jsonl") if "loss" in r}


def _keys(url: str) -> list[str]:
    return object_store.find(url)


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def straight(tok, tmp_path_factory) -> tuple[dict, dict[int, float], Path]:
    """A run never stopped, its checkpoints on the local disk (no bucket mapped)."""
    work = tmp_path_factory.mktemp("straight")
    stats = _fit(tok, work, None)
    return stats, _losses(work), work


def test_the_store_maps_a_stage_folder_to_its_place_on_the_bucket_and_sets_no_variable(tmp_path, monkeypatch):
    """The mapping a training stage is given (the pipeline's, or a launched rank's own store's): a work
    directory below the store's local copy keeps its checkpoints at the same path on the bucket, any
    other on its disk; opening the store leaves the environment as it was."""
    from gristmill.infra.artifacts import home_store
    from gristmill.model.checkpoint_bucket import BucketPlace
    from gristmill.model.checkpoint_local import LocalPlace

    monkeypatch.setenv("GRISTMILL_STORE", "s3://crawl/store/")
    before = dict(os.environ)
    store = home_store(tmp_path / "home")
    assert dict(os.environ) == before
    assert store.store_mapping == StoreMapping(store.root, "s3://crawl/store")
    place = checkpoint_place(store.partial_dir("pretrain", "0123456789ab"), store.store_mapping)
    assert isinstance(place, BucketPlace) and place.url == f"s3://crawl/store/{STAGE_DIR.as_posix()}/checkpoints"
    assert place.local == store.root / STAGE_DIR / "checkpoints"
    beside = checkpoint_place(tmp_path / "home" / "elsewhere", store.store_mapping)
    assert isinstance(beside, LocalPlace) and beside.root == tmp_path / "home" / "elsewhere" / "checkpoints"
    monkeypatch.setenv("GRISTMILL_STORE", str(tmp_path / "local-store"))
    assert home_store(tmp_path / "home").store_mapping is None


def test_checkpoints_on_the_bucket_marker_last_and_another_node_resumes(tok, straight, bucket, tmp_path,
                                                                        monkeypatch, caplog):
    stats, curve, local = straight
    assert [s for s, _ in checkpoint_place(local, None).complete()] == [4, 6]  # local-only: on the disk
    assert stats["checkpoints"] == 3 and stats["checkpoint_bytes"] > 0 and stats["checkpoint_s"] > 0
    url = f"{bucket}/{STAGE_DIR.as_posix()}/checkpoints"

    # Node A: stopped after step 4's files are up but before its marker.
    work_a, node_a = _node(monkeypatch, tmp_path / "a", bucket, tmp_path / "cache-a")
    armed = tmp_path / "armed"
    armed.touch()
    monkeypatch.setenv(FAULT_ENV, "checkpoint-files:4")
    monkeypatch.setenv(FAULT_ONCE_ENV, str(armed))
    with pytest.raises(InjectedFault):
        _fit(tok, work_a, node_a)
    keys = _keys(url)
    assert "step-0000002/checkpoint.json" in keys and "step-0000002/model.safetensors" in keys
    assert "step-0000004/model.safetensors" in keys and "step-0000004/checkpoint.json" not in keys
    assert not (work_a / "checkpoints").exists() or not list((work_a / "checkpoints").glob("step-*[0-9]"))

    # Node B: another local folder, an empty cache; resumes from step 2 on the bucket.
    work_b, node_b = _node(monkeypatch, tmp_path / "b", bucket, tmp_path / "cache-b")
    with caplog.at_level(logging.INFO, logger="gristmill.train"):
        resumed = _fit(tok, work_b, node_b)
    assert "resuming from step 2" in caplog.text and resumed["resumed_from_step"] == 2
    # exact, step for step; the rows up to step 2 come with its checkpoint (this node's file had none)
    assert _losses(work_b) == curve
    assert [s for s, _ in checkpoint_place(work_b, node_b).complete()] == [4, 6]
    assert not [k for k in _keys(url) if k.startswith("step-0000002/")]  # beyond keep: deleted
    rows = [r for r in read_metrics(work_b / "metrics.jsonl") if "checkpoint_s" in r]
    assert [r["step"] for r in rows] == [4, 6] and all(r["checkpoint_bytes"] > 0 for r in rows)
    assert resumed["checkpoint_bytes"] == rows[-1]["checkpoint_bytes"]
    # checkpoints hold the same files wherever they live, the metrics written before them included
    last = local / "checkpoints" / "step-0000006"
    assert {k.removeprefix("step-0000006/") for k in _keys(url) if k.startswith("step-0000006/")} == {
        p.name for p in last.iterdir()}
    assert "metrics.jsonl" in {p.name for p in last.iterdir()}
    assert stats["checkpoint_bytes"] == sum(p.stat().st_size for p in last.iterdir()
                                            if p.name not in ("checkpoint.json", "metrics.jsonl"))


def test_a_stop_between_a_checkpoint_and_its_row_loses_no_row(tok, straight, tmp_path, monkeypatch):
    """The checkpoint step's metrics row is written after the checkpoint (it carries its seconds and
    bytes) and saved in it: a run stopped between the two gets the row back on resume."""
    _, curve, _ = straight
    armed = tmp_path / "armed"
    armed.touch()
    monkeypatch.setenv(FAULT_ENV, "checkpoint:4")
    monkeypatch.setenv(FAULT_ONCE_ENV, str(armed))
    with pytest.raises(InjectedFault):
        _fit(tok, tmp_path / "run", None)
    assert max(_losses(tmp_path / "run")) and 4 not in _losses(tmp_path / "run")
    resumed = _fit(tok, tmp_path / "run", None)
    assert resumed["resumed_from_step"] == 4 and _losses(tmp_path / "run") == curve
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == list(range(1, 7))


def test_a_truncated_object_falls_back_to_the_checkpoint_before_it(tok, straight, bucket, tmp_path, monkeypatch,
                                                                   caplog):
    _, curve, _ = straight
    work, node = _node(monkeypatch, tmp_path / "a", bucket, tmp_path / "cache-a")
    with pytest.raises(RuntimeError, match="simulated crash"):
        _fit(tok, work, node, crash_at=4)  # checkpoints 2 and 4
    weights = f"{bucket}/{STAGE_DIR.as_posix()}/checkpoints/step-0000004/model.safetensors"
    object_store.put_bytes(weights, (object_store.read_bytes(weights) or b"")[:100])
    other, node_b = _node(monkeypatch, tmp_path / "b", bucket, tmp_path / "cache-b")  # nothing cached there
    with caplog.at_level(logging.WARNING, logger="gristmill.checkpoint"):
        resumed = _fit(tok, other, node_b)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert f"{bucket}/{STAGE_DIR.as_posix()}/checkpoints/step-0000004/model.safetensors" in warnings[0]
    assert "has 100 bytes" in warnings[0]
    assert resumed["resumed_from_step"] == 2 and _losses(other) == curve  # the rows before it come with it


def test_wiping_the_cache_between_runs_changes_nothing_but_time(tok, straight, bucket, tmp_path, monkeypatch):
    _, curve, _ = straight
    work, node = _node(monkeypatch, tmp_path / "a", bucket, tmp_path / "cache-a")
    with pytest.raises(RuntimeError, match="simulated crash"):
        _fit(tok, work, node, crash_at=4)
    assert list((tmp_path / "cache-a" / "objects").glob("??/*"))  # the uploads were adopted by the cache
    import shutil

    shutil.rmtree(tmp_path / "cache-a")
    resumed = _fit(tok, work, node)
    assert resumed["resumed_from_step"] == 4 and _losses(work) == curve


def test_an_unreachable_or_missing_bucket_fails_in_one_line(tok, bucket, tmp_path, monkeypatch):
    scheme, variable = bucket.split("://")[0], _endpoint_variable(bucket)
    gone, node = _node(monkeypatch, tmp_path / "gone", f"{scheme}://no-such-bucket/store", tmp_path / "cache")
    with pytest.raises(ObjectStoreError, match=rf"^{scheme}://no-such-bucket/store/pretrain/.*/checkpoints: listing "
                                          r"checkpoints failed: not found") as found:
        _fit(tok, gone, node)
    assert "\n" not in str(found.value)

    from gristmill.infra.launch import free_port

    monkeypatch.setenv(variable, f"http://127.0.0.1:{free_port()}")  # nothing listens
    object_store.forget()
    work, node = _node(monkeypatch, tmp_path / "a", bucket, tmp_path / "cache")
    try:
        with pytest.raises(ObjectStoreError,
                           match=rf"host did not answer in 2 tries.*{variable}=http://127") as found:
            _fit(tok, work, node)
    finally:
        object_store.forget()
    assert str(found.value).startswith(f"{bucket}/{STAGE_DIR.as_posix()}/checkpoints: ")
    assert "\n" not in str(found.value)


def test_a_bucket_lost_mid_stage_fails_the_checkpoint_in_one_line_and_the_next_run_resumes(
        tok, straight, bucket, tmp_path, monkeypatch):
    """The endpoint stops answering after checkpoint 2: checkpoint 4's first call to the bucket fails
    after its tries in one line naming the object; no marker of step 4 exists, and once the bucket answers
    again the next run resumes from step 2 to the uninterrupted curve."""

    from gristmill.infra.launch import free_port

    _, curve, _ = straight
    variable = _endpoint_variable(bucket)
    work, node = _node(monkeypatch, tmp_path / "a", bucket, tmp_path / "cache-a")
    endpoint = os.environ[variable]
    real = presets.build_model

    def lose_the_bucket_after_step_2(step: int) -> dict:
        if step == 3:  # step 4's batch: checkpoint 2 is on the bucket
            os.environ[variable] = f"http://127.0.0.1:{free_port()}"  # nothing listens
            object_store.forget()
        return _batch(step)

    torch.manual_seed(0)
    cfg = LoopConfig(max_steps=6, batch_size=4, checkpoint_every=2, log_every=100, keep_checkpoints=2)
    try:
        with pytest.raises(ObjectStoreError) as lost:
            train(real(TINY, tok), lose_the_bucket_after_step_2, cfg, checkpoint_place(work, node), MetricsLog(work))
    finally:
        os.environ[variable] = endpoint
        object_store.forget()
    assert re.match(rf"{bucket}/{STAGE_DIR.as_posix()}/checkpoints/step-0000004\S*: [a-z ]+ failed: its host did "
                    r"not answer in 2 tries", str(lost.value)) and "\n" not in str(lost.value)
    assert "step-0000004/checkpoint.json" not in _keys(f"{bucket}/{STAGE_DIR.as_posix()}/checkpoints")
    resumed = _fit(tok, work, node)
    assert resumed["resumed_from_step"] == 2 and _losses(work) == curve


def test_refused_credentials_are_one_line_and_not_retried():
    calls = []

    def refused():
        calls.append(1)
        raise PermissionError("The AWS Access Key Id you provided does not exist in our records.")

    with pytest.raises(ObjectStoreError, match=r"^s3://b/k: uploading refused .*check AWS_ACCESS_KEY_ID"):
        object_store.POLICY.call("s3://b/k", "uploading", refused,
                                 object_store.S3Backend.__new__(object_store.S3Backend))
    assert calls == [1]


def _put(url: str, data: bytes) -> tuple[int, str]:
    object_store.put_bytes(url, data)
    return len(data), hashlib.sha256(data).hexdigest()


def test_the_cache_evicts_the_least_recently_used_within_its_bound(bucket, tmp_path):
    objects = {name: _put(f"{bucket}/{name}", name.encode() * 100) for name in ("a", "b", "c")}
    store = ObjectCache(tmp_path / "cache", limit=250)
    a = store.fetch(f"{bucket}/a", *objects["a"])
    b = store.fetch(f"{bucket}/b", *objects["b"])
    assert a.read_bytes() == b"a" * 100 and store.size() == 200
    import os

    os.utime(b, (1, 1))  # b used long ago
    store.fetch(f"{bucket}/a", *objects["a"])  # a hit: nothing downloaded, a now the newest
    c = store.fetch(f"{bucket}/c", *objects["c"])
    assert sorted(p.name for p in store.entries()) == sorted([a.name, c.name]) and store.size() <= 250
    # what differs from its record is never kept
    with pytest.raises(ObjectDamaged, match=r"://.*/b: has 100 bytes, its record lists 101"):
        store.fetch(f"{bucket}/b", 101, objects["b"][1])
    with pytest.raises(ObjectDamaged, match="sha256"):
        store.fetch(f"{bucket}/b", 100, objects["a"][1][:-1] + "0")
    assert not list(store.dir.glob(".incoming-*")) and store.size() <= 250


def test_the_default_bound_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("GRISTMILL_CACHE_MAX_GB", raising=False)
    assert cache.max_bytes() == 20 * 2**30
    monkeypatch.setenv("GRISTMILL_CACHE_MAX_GB", "0.5")
    monkeypatch.setenv("GRISTMILL_CACHE", str(tmp_path))
    assert ObjectCache().limit == 2**29 and ObjectCache().dir == tmp_path / "objects"


def _output(store, stage: str, size: int):
    import os

    def compute(partial: Path) -> dict:
        (partial / "shards").mkdir()
        (partial / "shards" / "train.bin").write_bytes(os.urandom(size))
        return {"config": {"size": size}, "upstream": {}, "stats": {}, "meta": {}}

    return store.materialize(stage, "0123456789ab", compute)[0]


def test_downloaded_artifacts_live_in_the_bounded_cache(bucket, tmp_path, monkeypatch):
    """Another node's copy of two outputs: fetched through its cache (stored once, hard links),
    the least recently used one deleted again when both exceed the bound, downloaded anew when a
    run asks for it; wiping the cache changes nothing but time."""
    from gristmill.infra.artifacts import ArtifactStore
    from gristmill.infra.remote_store import RemoteStore

    one = ArtifactStore(tmp_path / "one", remote=RemoteStore(bucket))
    made = {stage: _output(one, stage, 30_000) for stage in ("tokenize", "pretrain")}
    monkeypatch.setenv("GRISTMILL_CACHE", str(tmp_path / "node-cache"))
    monkeypatch.setenv("GRISTMILL_CACHE_MAX_GB", str(45_000 / 2**30))  # room for one output, not two
    other = ArtifactStore(tmp_path / "other", remote=RemoteStore(bucket))
    tokens = other.load("tokenize", "0123456789ab")
    assert tokens is not None and tokens.path.is_relative_to(tmp_path / "other")
    shard = tokens.path / "shards" / "train.bin"
    assert shard.read_bytes() == (made["tokenize"].path / "shards" / "train.bin").read_bytes()
    assert shard.stat().st_nlink == 2  # the cache's entry and the store's copy: one file on disk
    assert ObjectCache().size() < 45_000
    assert other.load("pretrain", "0123456789ab") is not None  # tokenize is now the least recently used
    assert not tokens.path.exists() and ObjectCache().size() <= 45_000
    assert other.verify() == []  # nothing half deleted is left to count
    again = other.load("tokenize", "0123456789ab")  # downloaded anew
    assert again is not None and (again.path / "shards" / "train.bin").read_bytes() == \
        (made["tokenize"].path / "shards" / "train.bin").read_bytes()
    import shutil

    shutil.rmtree(tmp_path / "node-cache")  # wiped: the local copies stay, and so do their answers
    assert other.load("tokenize", "0123456789ab") is not None and other.load("pretrain", "0123456789ab") is not None


def test_every_rank_uploads_its_files_and_rank_0_the_marker_listing_all(bucket, tmp_path):
    """Two gloo ranks on two "nodes" (roots and caches of their own): rank 1's files reach the
    bucket from rank 1, the marker lists every rank's, and each rank resumes with all of them."""
    import multiprocessing

    from checkpoint_ranks import save_and_resume

    from gristmill.infra.launch import free_port

    context = multiprocessing.get_context("spawn")
    results, port = context.Queue(), free_port()
    procs = [context.Process(target=save_and_resume, args=(rank, port, str(tmp_path / f"node-{rank}"), bucket,
                                                           results)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    got = {rank: rest for rank, *rest in (results.get(timeout=120) for _ in procs)}
    for proc in procs:
        proc.join(30)
    files = ["checkpoint.json", "model.safetensors", "rng-0.pt", "rng-1.pt"]
    assert got[0] == [120, 2, files] and got[1][1:] == [2, files]
    assert _keys(f"{bucket}/{STAGE_DIR.as_posix()}/checkpoints") == [f"step-0000002/{f}" for f in files]
