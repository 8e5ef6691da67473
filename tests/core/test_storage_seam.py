"""The one storage seam (core/object_store.py), on each real backend: S3 (moto's server) and Google
Cloud Storage (fake-gcs-server), both on 127.0.0.1 and shared by the session.

Each backend's conditional writes are its own precondition (S3 If-None-Match / If-Match on the ETag,
GCS ifGenerationMatch), so of two creates exactly one wins; a get is checked against its record; the
one retry policy retries what is transient and nothing else, within its attempts and seconds; and a
URL the seam cannot serve is one line saying what to use or install."""
from __future__ import annotations

import hashlib
import os
import socket
import threading

import pytest

from gristmill.core import object_store
from gristmill.core.object_store import ObjectDamaged, ObjectStoreError, RetryPolicy


def test_conditional_writes_let_exactly_one_of_many_create_and_only_the_holder_replace(bucket_url):
    url = f"{bucket_url}/x.lease"
    won: list[str] = []

    def create(i: int) -> None:
        if (token := object_store.create(url, f"{i}".encode(), {"holder": str(i)})) is not None:
            won.append(token)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(won) == 1
    token, metadata = object_store.head(url) or ("", {})
    assert token == won[0] and set(metadata) == {"holder"}
    assert object_store.replace(url, b"stale", {}, "1" if bucket_url.startswith("gs") else '"nope"') is None
    newer = object_store.replace(url, b"renewed", {"holder": metadata["holder"]}, token)
    assert newer is not None and newer != token and object_store.read_bytes(url) == b"renewed"
    assert not object_store.delete_if(url, token)  # the old version is not the object's any more
    assert object_store.delete_if(url, newer) and object_store.head(url) is None
    assert object_store.create(url, b"again", {}) is not None  # gone: creatable again


def test_put_get_list_and_delete_with_the_record_checked(bucket_url, tmp_path):
    data = b"gristmill " * 1000
    (tmp_path / "a.bin").write_bytes(data)
    object_store.put_file(tmp_path / "a.bin", f"{bucket_url}/d/a.bin")
    object_store.put_bytes(f"{bucket_url}/d/e/b.txt", b"b")
    assert object_store.names(f"{bucket_url}/d") == ["a.bin", "e"]
    assert object_store.find(bucket_url) == ["d/a.bin", "d/e/b.txt"]
    object_store.get_file(f"{bucket_url}/d/a.bin", tmp_path / "got", len(data), hashlib.sha256(data).hexdigest())
    assert (tmp_path / "got").read_bytes() == data
    with pytest.raises(ObjectDamaged, match=r"^\S+/d/a.bin: its bytes do not match the sha256"):
        object_store.get_file(f"{bucket_url}/d/a.bin", tmp_path / "got", len(data), "0" * 64)
    with pytest.raises(ObjectDamaged, match=r"has 10000 bytes, its record lists 9"):
        object_store.get_file(f"{bucket_url}/d/a.bin", tmp_path / "got", 9, None)
    with pytest.raises(FileNotFoundError):
        object_store.get_file(f"{bucket_url}/d/none", tmp_path / "none")
    assert object_store.read_bytes(f"{bucket_url}/d/none") is None
    object_store.remove(bucket_url, recursive=True)
    assert object_store.names(bucket_url) == [] and object_store.find(bucket_url) == []
    object_store.remove(f"{bucket_url}/d/none")  # nothing there is not an error


def test_the_policy_retries_what_is_transient_within_its_budget_and_nothing_else(monkeypatch):
    monkeypatch.setattr(object_store.time, "sleep", lambda s: None)
    policy = RetryPolicy(attempts=4, first_pause_s=0.01, budget_s=60)
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError(104, "Connection reset by peer")
        return "ok"

    before = object_store.retries()
    assert policy.call("s3://b/k", "reading", flaky) == "ok" and len(calls) == 3
    assert object_store.retries() - before == 2

    def reset() -> None:
        calls.append(1)
        raise TimeoutError("read timed out")

    calls.clear()
    with pytest.raises(ObjectStoreError, match=r"^s3://b/k: reading failed: its host did not answer in 4 tries"):
        policy.call("s3://b/k", "reading", reset)
    assert len(calls) == 4

    class Forbidden(Exception):
        status = 403

    for error, message in ((Forbidden("Forbidden"), "refused"), (PermissionError("AccessDenied"), "refused"),
                           (FileNotFoundError("k"), "not found"), (ValueError("bad"), "ValueError: bad")):
        calls.clear()

        def fails(error=error) -> None:
            calls.append(1)
            raise error

        with pytest.raises(ObjectStoreError, match=rf"^s3://b/k: reading.*{message}") as raised:
            policy.call("s3://b/k", "reading", fails, object_store.S3Backend.__new__(object_store.S3Backend))
        assert len(calls) == 1 and "\n" not in str(raised.value)
    with pytest.raises(ObjectStoreError, match="check AWS_ACCESS_KEY_ID"):
        policy.call("s3://b/k", "x", lambda: (_ for _ in ()).throw(PermissionError("no")),
                    object_store.S3Backend.__new__(object_store.S3Backend))


def test_the_budget_bounds_the_seconds_spent_retrying(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(object_store.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(object_store.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))

    def slow_refusal() -> None:
        clock[0] += 5.0  # a try that takes its client's timeout
        raise ConnectionRefusedError(111, "Connection refused")

    with pytest.raises(ObjectStoreError, match="failed: its host did not answer"):
        RetryPolicy(attempts=100, first_pause_s=1.0, max_pause_s=2.0, budget_s=30).call("gs://b/k", "x", slow_refusal)
    assert clock[0] <= 30 + 5


@pytest.mark.parametrize("url,message", [
    ("ftp://host/prefix", r"^ftp://host/prefix: not an object store gristmill knows \(use s3://, gs:// or a local"),
    ("azure://c/p", r"not an object store gristmill knows"),
])
def test_an_unknown_scheme_is_one_line(url, message):
    with pytest.raises(ObjectStoreError, match=message):
        object_store.backend_of(url)


def test_a_backend_whose_package_is_missing_names_what_to_install(monkeypatch):
    import builtins

    real = builtins.__import__

    def without_gcsfs(name, *args, **kwargs):
        if name == "gcsfs" or name.startswith("gcsfs."):
            raise ImportError("No module named 'gcsfs'")
        return real(name, *args, **kwargs)

    object_store.forget()
    monkeypatch.setattr(builtins, "__import__", without_gcsfs)
    with pytest.raises(ObjectStoreError, match=r"^gs://b/p: gs:// needs the gcsfs package: pip install "
                                               r"'gristmill\[gcs\]'"):
        object_store.backend_of("gs://b/p")


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_an_endpoint_that_does_not_answer_is_one_line_naming_it(scheme, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    endpoint = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("AWS_ENDPOINT_URL" if scheme == "s3" else "STORAGE_EMULATOR_HOST", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setattr(object_store, "POLICY", RetryPolicy(attempts=2, first_pause_s=0.01))
    object_store.forget()
    try:
        with pytest.raises(ObjectStoreError) as raised:
            object_store.read_bytes(f"{scheme}://b/k")
    finally:
        object_store.forget()
    variable = "AWS_ENDPOINT_URL" if scheme == "s3" else "STORAGE_EMULATOR_HOST"
    assert str(raised.value).startswith(f"{scheme}://b/k: reading failed: its host did not answer in 2 tries")
    assert f"{variable}={endpoint}" in str(raised.value) and "\n" not in str(raised.value)


@pytest.fixture(params=["s3", "gs"])
def faulty_bucket(request, monkeypatch, tmp_path):
    """A fresh prefix of a bucket seen through the fault proxy: a fifth of the connections reset
    mid-transfer, a tenth delayed. The policy pauses briefly (the budget is not what is tested)."""
    import uuid

    from fault_proxy import FaultProxy

    variable = "AWS_ENDPOINT_URL" if request.param == "s3" else "STORAGE_EMULATOR_HOST"
    env = request.getfixturevalue("s3_server" if request.param == "s3" else "gcs_server")
    with FaultProxy(int(env[variable].rsplit(":", 1)[1]), reset=0.2, delay=0.1, seed=7) as proxy:
        monkeypatch.setenv(variable, proxy.url)
        monkeypatch.setattr(object_store, "POLICY", RetryPolicy(attempts=10, first_pause_s=0.01, max_pause_s=0.1))
        object_store.forget()
        try:
            yield f"{request.param}://crawl/faulty-{uuid.uuid4().hex[:8]}", proxy
        finally:
            object_store.forget()


def test_a_bucket_that_drops_connections_loses_nothing_and_the_retries_are_counted(faulty_bucket, tmp_path):
    """An output committed through the proxy (its files, its manifest last, under a lease) is
    fetched by another machine byte for byte; every retry is the one policy's, and counted."""
    from gristmill.infra.artifacts import ArtifactStore
    from gristmill.infra.remote_store import RemoteStore

    url, proxy = faulty_bucket
    before = object_store.retries()

    def compute(partial):
        for i in range(12):
            (partial / f"part-{i:02d}.bin").write_bytes(bytes(range(256)) * (50 * (i + 1)))
        return {"config": {}, "upstream": {}, "stats": {"n": 12}, "meta": {}}

    one = ArtifactStore(tmp_path / "one", remote=RemoteStore(url))
    made, reused = one.materialize("collect", "0123456789ab", compute)
    other = ArtifactStore(tmp_path / "other", remote=RemoteStore(url))
    copy = other.load("collect", "0123456789ab")
    assert not reused and copy is not None and set(copy.files) == set(made.files)
    for rel in made.files:
        assert (copy.path / rel).read_bytes() == (made.path / rel).read_bytes(), rel
    with (tmp_path / "one" / "collect" / "collect-0123456789ab" / "part-11.bin").open("rb") as local, \
            object_store.open_object(f"{url}/collect/collect-0123456789ab/part-11.bin") as remote:
        remote.seek(1000)
        assert remote.read() == local.read()[1000:]  # a read resumed at its offset after a reset
    assert not any(name.endswith(".lease") for name in object_store.find(url))
    assert proxy.resets > 0 and object_store.retries() > before


# What may import an object store's client (fsspec, its S3 and GCS filesystems, boto, Google's
# libraries) outside core/object_store.py, and why: none of these reaches a bucket.
CLIENTS_ALLOWED = {
    "core/sources.py": {"fsspec.implementations.local": "tells a local source's files from a URL's"},
    "core/files.py": {"fsspec.utils": "infers a file's compression from its name",
                      "fsspec.compression": "decompresses a stream already opened"},
}
CLIENT_PACKAGES = ("fsspec", "s3fs", "gcsfs", "boto3", "botocore", "aiobotocore", "google")


def _client_imports(path) -> set[str]:
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return {n for n in names if n.split(".")[0] in CLIENT_PACKAGES}


def test_only_the_storage_seam_calls_an_object_store_client():
    """Every bucket call goes through core/object_store.py: no other product module imports a
    client, but for the allow-listed uses above, each with its reason."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    found = {}
    for folder in ("core", "model", "tasks", "infra", "flows", "gristmill"):
        for path in sorted((repo / folder).rglob("*.py")):
            rel = path.relative_to(repo).as_posix()
            if rel != "core/object_store.py" and (names := _client_imports(path) - set(CLIENTS_ALLOWED.get(rel, {}))):
                found[rel] = sorted(names)
    assert found == {}
    assert {n.split(".")[0] for n in _client_imports(repo / "core" / "object_store.py")} >= {"s3fs", "gcsfs", "fsspec"}


def test_a_bucket_gone_mid_commit_fails_in_one_line_commits_nothing_and_the_next_run_finishes_it(
        bucket_url, tmp_path, monkeypatch):
    """The bucket stops answering once the stage computed: the commit fails after the policy's
    tries in one line naming the URL, no manifest reaches the bucket, the computed output stays
    here, and the next run, the bucket back, commits it without computing again."""
    from gristmill.infra.artifacts import ArtifactStore
    from gristmill.infra.launch import free_port
    from gristmill.infra.remote_store import RemoteStore

    variable = "AWS_ENDPOINT_URL" if bucket_url.startswith("s3") else "STORAGE_EMULATOR_HOST"
    endpoint = os.environ[variable]
    monkeypatch.setattr(object_store, "POLICY", RetryPolicy(attempts=2, first_pause_s=0.01))
    calls: list[int] = []

    def compute_then_lose_the_bucket(partial):
        calls.append(1)
        (partial / "part.bin").write_bytes(b"computed once")
        monkeypatch.setenv(variable, f"http://127.0.0.1:{free_port()}")  # nothing listens there
        object_store.forget()
        return {"config": {}, "upstream": {}, "stats": {}, "meta": {}}

    store = ArtifactStore(tmp_path / "m", remote=RemoteStore(bucket_url, lease_s=5))
    with pytest.raises(ObjectStoreError) as lost:
        store.materialize("collect", "0123456789ab", compute_then_lose_the_bucket)
    assert str(lost.value).startswith(f"{bucket_url}/collect/collect-0123456789ab/")
    assert "did not answer in 2 tries" in str(lost.value) and "\n" not in str(lost.value)
    monkeypatch.setenv(variable, endpoint)
    object_store.forget()
    assert not any(name.endswith("manifest.json") for name in object_store.find(bucket_url))
    assert (store.partial_dir("collect", "0123456789ab") / "part.bin").is_file()  # nothing computed is lost
    manifest, reused = store.materialize("collect", "0123456789ab", compute_then_lose_the_bucket)
    assert not reused and len(calls) == 1 and (manifest.path / "part.bin").read_bytes() == b"computed once"
    assert "collect/collect-0123456789ab/manifest.json" in object_store.find(bucket_url)
