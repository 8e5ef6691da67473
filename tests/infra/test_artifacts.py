"""The artifact store: key stability and sensitivity, commit protocol, crash safety, locking."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
import weakref
from pathlib import Path

import pytest

from gristmill.infra.artifacts import MANIFEST, ArtifactStore, stage_key
from gristmill.infra.interrupt import catch_sigint


def _fields(**stats):
    return {"config": {"a": 1}, "upstream": {}, "stats": stats, "meta": {}}


def test_key_is_stable_and_order_insensitive():
    a = stage_key("sft", 1, {"lr": 1e-3, "steps": 10}, {"pretrain": "abc"})
    b = stage_key("sft", 1, {"steps": 10, "lr": 1e-3}, {"pretrain": "abc"})
    assert a == b and len(a) == 12
    # a fixed value: the key must not drift between releases or processes
    assert a == stage_key("sft", 1, {"lr": 0.001, "steps": 10}, {"pretrain": "abc"})


@pytest.mark.parametrize("change", [
    dict(stage="align"), dict(version=2), dict(config={"lr": 2e-3, "steps": 10}),
    dict(upstream={"pretrain": "abd"}), dict(fingerprint="f00"),
])
def test_key_changes_with_anything_that_changes_outputs(change):
    base = dict(stage="sft", version=1, config={"lr": 1e-3, "steps": 10},
                upstream={"pretrain": "abc"}, fingerprint=None)
    changed = {**base, **change}
    def key(d):
        return stage_key(d["stage"], d["version"], d["config"], d["upstream"], d["fingerprint"])

    assert key(base) != key(changed)


def test_materialize_commits_then_reuses(tmp_path):
    store = ArtifactStore(tmp_path)
    calls = []

    def compute(partial: Path):
        calls.append(partial)
        (partial / "out.txt").write_text("hello")
        return _fields(n=1)

    manifest, reused = store.materialize("collect", "k1", compute)
    assert not reused and calls == [store.partial_dir("collect", "k1")]
    assert manifest.path == store.final_dir("collect", "k1")
    assert (manifest.path / "out.txt").read_text() == "hello"
    assert manifest.files["out.txt"]["bytes"] == 5
    assert not store.partial_dir("collect", "k1").exists()
    again, reused = store.materialize("collect", "k1", compute)
    assert reused and len(calls) == 1 and again.stats == {"n": 1}


def test_crash_before_manifest_is_not_complete_and_partial_work_survives(tmp_path):
    store = ArtifactStore(tmp_path)

    def crash(partial: Path):
        (partial / "checkpoint.bin").write_bytes(b"step-5")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        store.materialize("pretrain", "k2", crash)
    assert store.load("pretrain", "k2") is None
    seen = []

    def resume(partial: Path):
        seen.append((partial / "checkpoint.bin").read_bytes())
        return _fields()

    store.materialize("pretrain", "k2", resume)
    assert seen == [b"step-5"]


def test_a_ctrl_c_python_swallows_in_a_weakref_callback_still_stops_the_commit(tmp_path, monkeypatch):
    """The KeyboardInterrupt of a SIGINT that lands in a weakref callback is printed and dropped by
    Python; the stage must not commit as if no one had asked it to stop."""
    store = ArtifactStore(tmp_path)

    class Collected:
        pass

    def compute(partial: Path):
        (partial / "shard.bin").write_bytes(b"tokens")
        doomed = Collected()
        # kept alive by the assignment; its callback runs (and sends SIGINT) when `doomed` goes
        callback = weakref.ref(doomed, lambda _: os.kill(os.getpid(), signal.SIGINT))
        del doomed
        assert callback() is None
        return _fields()

    swallowed = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: swallowed.append(info.exc_type))
    previous = signal.getsignal(signal.SIGINT)
    with catch_sigint(), pytest.raises(KeyboardInterrupt, match="before committing tokenize-k9"):
        store.materialize("tokenize", "k9", compute)
    assert swallowed == [KeyboardInterrupt]  # Python did swallow the first one
    assert store.load("tokenize", "k9") is None
    assert (store.partial_dir("tokenize", "k9") / "shard.bin").read_bytes() == b"tokens"
    # outside the block, SIGINT is handled as before and nothing remembers it
    assert signal.getsignal(signal.SIGINT) is previous
    store.materialize("tokenize", "k9", lambda partial: _fields())


def test_directory_without_valid_manifest_is_incomplete(tmp_path):
    store = ArtifactStore(tmp_path)
    final = store.final_dir("tokenize", "k3")
    final.mkdir(parents=True)
    (final / "tokens.bin").write_bytes(b"123")
    assert store.load("tokenize", "k3") is None
    (final / MANIFEST).write_text("{not json")
    assert store.load("tokenize", "k3") is None


def test_truncated_file_invalidates_a_committed_artifact(tmp_path):
    store = ArtifactStore(tmp_path)

    def compute(partial: Path):
        (partial / "data.bin").write_bytes(b"x" * 100)
        return _fields()

    manifest, _ = store.materialize("tokenize", "k4", compute)
    assert json.loads((manifest.path / MANIFEST).read_text())["key"] == "k4"
    (manifest.path / "data.bin").write_bytes(b"x" * 10)
    assert store.load("tokenize", "k4") is None


def _flip_a_byte(path: Path, at: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_flipped_byte_is_caught_by_sha256_on_reuse_and_by_verify_with_what_depends_on_it(tmp_path):
    """Reuse hashes the small files always, every file with verify_on_reuse="sha256"; `verify`
    re-hashes all; `dependents` follows the manifests' upstream keys; `set_aside` keeps the bytes."""
    from gristmill.infra.artifacts import SMALL_FILE_BYTES

    store = ArtifactStore(tmp_path)
    key_a, key_b, key_c = "a" * 12, "b" * 12, "c" * 12
    big = SMALL_FILE_BYTES + 1
    store.materialize("tokenize", key_a, lambda d: (d / "tokens.bin").write_bytes(b"t" * big) and _fields())
    store.materialize("pretrain", key_b, lambda d: (d / "model.json").write_text("{}") and
                      {**_fields(), "upstream": {"tokenize": key_a}})
    store.materialize("sft", key_c, lambda d: (d / "model.json").write_text("{}") and
                      {**_fields(), "upstream": {"pretrain": key_b}})
    assert store.verify() == []

    _flip_a_byte(store.final_dir("tokenize", key_a) / "tokens.bin", at=big // 2)
    assert store.load("tokenize", key_a) is not None  # size only, for a big file
    assert ArtifactStore(tmp_path, verify_on_reuse="sha256").load("tokenize", key_a) is None
    (damage,) = store.verify()
    assert (damage.stage, damage.key, damage.files) == ("tokenize", key_a, {"tokens.bin": "sha256 differs"})
    assert [(s, k) for s, k, _ in store.dependents("tokenize", key_a)] == [("pretrain", key_b), ("sft", key_c)]

    _flip_a_byte(store.final_dir("pretrain", key_b) / "model.json")
    assert store.load("pretrain", key_b) is None  # a small file is always hashed
    assert {d.stage for d in store.verify()} == {"tokenize", "pretrain"}
    assert [d.stage for d in store.verify("pretrain")] == ["pretrain"]
    aside = store.set_aside(store.final_dir("tokenize", key_a))
    assert aside.name.startswith(f"tokenize-{key_a}.corrupt-") and (aside / "tokens.bin").stat().st_size == big
    assert store.load("tokenize", key_a) is None and [s for s, _, _ in store.committed()] == ["pretrain", "sft"]
    (store.final_dir("sft", key_c) / MANIFEST).write_text('{"stage": "sft", "ke')  # torn
    assert ("sft", {MANIFEST: "not JSON"}) in [(d.stage, d.files) for d in store.verify()]
    assert [m["stage"] for m in store.manifests()] == ["pretrain"]


def _hold_lock(root: str, held: multiprocessing.Event, release: multiprocessing.Event):
    with ArtifactStore(Path(root)).lock("pretrain", "k5"):
        held.set()
        release.wait(10)


def test_lock_blocks_a_second_holder_until_released(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    held, release = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_hold_lock, args=(str(tmp_path), held, release))
    proc.start()
    assert held.wait(30)
    acquired = []

    def try_lock():
        with ArtifactStore(tmp_path).lock("pretrain", "k5"):
            acquired.append(time.monotonic())

    import threading
    thread = threading.Thread(target=try_lock)
    thread.start()
    time.sleep(0.5)
    assert acquired == []  # still held by the other process
    released_at = time.monotonic()
    release.set()
    thread.join(10)
    proc.join(10)
    assert acquired and acquired[0] > released_at


def test_lock_is_released_when_the_holder_is_killed(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    held, release = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_hold_lock, args=(str(tmp_path), held, release))
    proc.start()
    assert held.wait(30)
    proc.kill()
    proc.join(10)
    with ArtifactStore(tmp_path).lock("pretrain", "k5"):
        pass


def _materialize_and_die_in_the_commit_window(root: str) -> None:
    import os

    os.environ["GRISTMILL_FAULT"] = "commit:tokenize"

    def compute(d: Path):
        (d / "shard.bin").write_bytes(b"x" * 100)
        return _fields(n=1)

    ArtifactStore(Path(root)).materialize("tokenize", "k1", compute)


def test_a_kill_inside_the_commit_window_is_finished_by_the_next_run_without_recompute(tmp_path):
    proc = multiprocessing.get_context("spawn").Process(
        target=_materialize_and_die_in_the_commit_window, args=(str(tmp_path),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -9  # died between writing the manifest and the rename
    store = ArtifactStore(tmp_path)
    assert store.load("tokenize", "k1") is None and store.partial_dir("tokenize", "k1").is_dir()

    def must_not_run(_d):
        raise AssertionError("the stage was computed again")

    manifest, reused = store.materialize("tokenize", "k1", must_not_run)
    assert not reused and manifest.stats == {"n": 1}
    assert (store.final_dir("tokenize", "k1") / "shard.bin").read_bytes() == b"x" * 100
    assert not store.partial_dir("tokenize", "k1").exists()
