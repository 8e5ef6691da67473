"""What keeps an output from counting (infra/integrity.py), applied alike on reuse and by `verify`,
and `survey`'s account of every entry under the store (infra/artifacts.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gristmill.infra.artifacts import MANIFEST, ArtifactStore
from gristmill.infra.integrity import SEAL, UNSEALED, manifest_text, seal_of

KEY, OTHER = "a" * 12, "b" * 12
CONTRACTS = {"tokenize": ("tokens/*.bin", "tokens/meta.json"), "pretrain": ("model/config.json",)}


def _tokenize(store: ArtifactStore, key: str = KEY) -> Path:
    def compute(partial: Path) -> dict:
        (partial / "tokens").mkdir()
        (partial / "tokens" / "train.bin").write_bytes(b"\x01" * 64)
        (partial / "tokens" / "meta.json").write_text("{}")
        (partial / "scratch" / "empty").mkdir(parents=True)  # a folder holding nothing: not committed
        return {"config": {"vocab": 8}, "upstream": {}, "stats": {"tokens": 64}, "meta": {}}
    return store.materialize("tokenize", key, compute)[0].path


def _rewrite(directory: Path, change, seal: bool = True) -> None:
    record = json.loads((directory / MANIFEST).read_text())
    change(record)
    if seal:
        record[SEAL] = seal_of(record)
    (directory / MANIFEST).write_text(manifest_text(record))


def _problems(store: ArtifactStore) -> dict[str, dict[str, str]]:
    return {d.path.name: d.files for d in store.verify()}


@pytest.fixture
def store(tmp_path) -> ArtifactStore:
    return ArtifactStore(tmp_path, contracts=CONTRACTS)


def test_a_committed_output_is_sealed_lists_its_files_and_keeps_no_empty_folder(store):
    path = _tokenize(store)
    record = json.loads((path / MANIFEST).read_text())
    assert record[SEAL] == seal_of(record) and sorted(record["files"]) == ["config.json", "tokens/meta.json",
                                                                           "tokens/train.bin"]
    assert not (path / "scratch").exists()
    assert store.verify() == [] and store.load("tokenize", KEY) is not None


def test_a_gutted_manifest_is_never_reused_and_verify_names_what_it_lacks(store):
    """files {} and resealed (what a tool that knows the seal would write): the contract and the
    unlisted files still show."""
    path = _tokenize(store)
    _rewrite(path, lambda record: record.update(files={}))
    assert store.load("tokenize", KEY) is None
    assert ArtifactStore(store.root, "sha256", contracts=CONTRACTS).load("tokenize", KEY) is None
    problems = _problems(store)[f"tokenize-{KEY}"]
    assert "lists no tokens/*.bin" in problems[MANIFEST] and "lists no config.json" in problems[MANIFEST]
    assert problems["tokens"] == "unlisted folder" and problems["config.json"] == "unlisted"


@pytest.mark.parametrize("change, said", [
    (lambda r: r.update(key=OTHER), f"names key '{OTHER}', its folder '{KEY}'"),
    (lambda r: r.update(stage="pretrain"), "names stage 'pretrain', its folder 'tokenize'"),
    (lambda r: r["stats"].update(tokens=65), "seal differs"),
    (lambda r: r.pop("upstream"), "no field 'upstream'"),
    (lambda r: r.update(extra=1), "unknown field 'extra'"),
    (lambda r: r["files"].update({"../outside": {"bytes": 0, "sha256": "0" * 64}}), "bad record for '../outside'"),
])
def test_a_manifest_edited_after_its_commit_is_named_and_refused(store, change, said):
    path = _tokenize(store)
    _rewrite(path, change, seal=said != "seal differs")
    assert store.load("tokenize", KEY) is None
    assert said in _problems(store)[f"tokenize-{KEY}"][MANIFEST]


def test_a_manifest_rewritten_in_another_form_is_named(store):
    path = _tokenize(store)
    (path / MANIFEST).write_text(json.dumps(json.loads((path / MANIFEST).read_text())))  # same content, one line
    assert store.load("tokenize", KEY) is None
    assert _problems(store)[f"tokenize-{KEY}"] == {MANIFEST: "its bytes are not as committed"}


def test_an_unsealed_manifest_is_refused_until_resealed(store):
    path = _tokenize(store)
    _rewrite(path, lambda record: record.pop(SEAL), seal=False)
    assert store.load("tokenize", KEY) is None
    assert _problems(store) == {f"tokenize-{KEY}": {MANIFEST: UNSEALED}}
    store.reseal(path)
    assert store.verify() == [] and store.load("tokenize", KEY) is not None


def test_a_folder_without_its_manifest_is_damaged_not_skipped(store):
    path = _tokenize(store)
    (path / MANIFEST).unlink()
    assert [key for _, key, _ in store.committed()] == [KEY]
    assert _problems(store) == {f"tokenize-{KEY}": {MANIFEST: "missing"}}


def test_files_beside_the_listed_ones_and_unreadable_ones_are_named_even_for_root(store):
    path = _tokenize(store)
    (path / "tokens" / "extra.bin").write_bytes(b"x")
    (path / "notes").mkdir()
    (path / "tokens" / "meta.json").chmod(0)  # root reads it all the same: the mode is the finding
    assert store.load("tokenize", KEY) is None
    assert _problems(store)[f"tokenize-{KEY}"] == {"tokens/extra.bin": "unlisted", "notes": "unlisted folder",
                                                     "tokens/meta.json": "unreadable: mode 000"}


def test_a_fifo_in_place_of_a_file_is_named_without_reading_it(store):
    path = _tokenize(store)
    (path / "tokens" / "train.bin").unlink()
    os.mkfifo(path / "tokens" / "train.bin")
    assert _problems(store)[f"tokenize-{KEY}"] == {"tokens/train.bin": "not a regular file"}


def test_survey_names_every_entry_by_the_layout_and_the_rest_as_unknown(store):
    _tokenize(store)
    _tokenize(store, OTHER)
    store.set_aside(store.final_dir("tokenize", OTHER))
    store.partial_dir("pretrain", KEY).mkdir(parents=True)
    store.add_gate_decision("tokenize", KEY, {"approved": True})
    (store.root / "tokenize" / "notes.txt").write_text("mine")
    (store.root / "prtrain").mkdir()  # not a stage of the contracts
    kinds = {entry.path.relative_to(store.root).as_posix(): entry.kind for entry in store.survey()}
    assert kinds.pop(next(k for k in kinds if ".corrupt-" in k)) == "set aside"
    assert kinds == {f"tokenize/tokenize-{KEY}": "committed", f"tokenize/tokenize-{KEY}.lock": "lock",
                     f"tokenize/tokenize-{OTHER}.lock": "lock", f"tokenize/tokenize-{KEY}.gates.jsonl": "gates",
                     f"pretrain/pretrain-{KEY}.partial": "partial", "tokenize/notes.txt": "unknown",
                     "prtrain": "unknown"}
    assert [e.kind for e in store.survey("pretrain")] == ["partial"]
