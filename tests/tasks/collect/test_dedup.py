"""Near-dedup (tasks/collect/dedup/near.py, minhash.py): hashing, signatures, banding, clusters, the persisted index,
and precision/recall on a labelled set of real documents."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pydantic
import pytest
from corpus_helpers import DiesPartWay, ShuffledEngine

import gristmill.tasks.collect.dedup.minhash as minhash
import gristmill.tasks.collect.dedup.near as dedup
from gristmill.core.stage import SerialEngine
from gristmill.tasks.collect.dedup.config import DedupConfig
from gristmill.tasks.collect.dedup.index import DedupIndex
from gristmill.tasks.collect.dedup.near import near_dedup
from gristmill.tasks.collect.dedup.neardup_set import build_labelled_set, cluster_pairs, precision_recall

REPO = Path(__file__).resolve().parents[3]
CFG = DedupConfig()
TEXT = "The quick brown fox jumps over the lazy dog, again and again."




def _words(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"w{rng.randrange(5000)}" for _ in range(n)]


def _edited(words: list[str], rate: float, seed: int) -> str:
    """`words` with a fraction `rate` of them replaced."""
    rng = random.Random(seed)
    return " ".join(f"x{rng.randrange(10**6)}" if rng.random() < rate else w for w in words)


def _docs(n_unique: int = 30) -> list[str]:
    """Unique 200-word documents, each followed by a lightly edited copy every third one."""
    docs = []
    for i in range(n_unique):
        words = _words(200, seed=i)
        docs.append(" ".join(words))
        if i % 3 == 0:
            docs.append(_edited(words, 0.01, seed=100 + i))
    return docs


def test_normalize_lowercases_drops_punctuation_and_collapses_space():
    assert minhash.normalize("  Hello,\tWORLD!! “It’s” — café\u00a0(ok)…\n") == \
        "hello world it s café ok"
    assert minhash.normalize("") == "" and minhash.normalize(" ,;- ") == ""


def test_signatures_pinned_and_same_in_a_fresh_process():
    """Fixed values: a change here invalidates every persisted index (bump INDEX_FORMAT). A new
    interpreter with another PYTHONHASHSEED gives the same (no salted hash())."""
    sig = minhash.minhash_signatures([TEXT], CFG)
    assert sig.shape == (1, CFG.bands * CFG.rows) and sig.dtype == np.uint32
    assert sig[0, :6].tolist() == [112999632, 81728182, 1475216617, 18663248, 100027817,
                                   190312850]
    code = ("from gristmill.tasks.collect.dedup import config as dedup, minhash; "
            f"print(minhash.minhash_signatures([{TEXT!r}], dedup.DedupConfig())[0].tolist())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}, check=True).stdout
    assert out.strip() == str(sig[0].tolist())


def test_signatures_do_not_depend_on_chunking_and_seed_matters():
    docs = [*_docs(), "", "one", "two words"]
    whole = minhash.minhash_signatures(docs, CFG)
    assert np.array_equal(whole, minhash.minhash_signatures(docs, CFG))
    pieces = np.concatenate([minhash.minhash_signatures(docs[i:i + 7], CFG)
                             for i in range(0, len(docs), 7)])
    assert np.array_equal(whole, pieces)
    other_seed = minhash.minhash_signatures(docs, CFG.model_copy(update={"seed": 2}))
    assert (other_seed != whole).mean() > 0.9


def test_jaccard_estimate_close_to_exact():
    errors = []
    for seed, rate in enumerate((0.01, 0.03, 0.06, 0.1, 0.2)):
        words = _words(300, seed)
        a, b = " ".join(words), _edited(words, rate, seed)
        exact = minhash.exact_jaccard(a, b, CFG)
        sig = minhash.minhash_signatures([a, b], CFG)
        errors.append(abs(minhash.estimate_jaccard(sig[0], sig[1]) - exact))
    # standard error of one estimate is sqrt(J(1-J)/108) <= 0.048
    assert max(errors) < 0.12 and np.mean(errors) < 0.05
    assert minhash.exact_jaccard(TEXT, TEXT.upper() + "!!", CFG) == 1.0


def test_exact_jaccards_match_python_sets():
    texts = [" ".join(_words(n, seed)) for seed, n in enumerate((300, 40, 7, 3))]
    texts += [_edited(texts[0].split(), 0.02, seed=9), "", "", TEXT, TEXT + " again"]
    values, offsets = minhash.shingle_sets(texts, CFG)
    sets = [set(values[offsets[i]:offsets[i + 1]].tolist()) for i in range(len(texts))]
    for i, text in enumerate(texts):
        assert sets[i] == set(minhash._shingle_hashes([text], CFG)[0].tolist())
    pairs = np.array([(i, j) for i in range(len(texts)) for j in range(len(texts))])
    expected = [len(sets[i] & sets[j]) / len(sets[i] | sets[j]) if sets[i] | sets[j] else 1.0
                for i, j in pairs.tolist()]
    assert np.allclose(minhash.exact_jaccards(values, offsets, pairs), expected)
    assert 0.6 < minhash.exact_jaccard(texts[0], texts[4], CFG) < 0.9


def test_candidates_are_checked_by_exact_jaccard():
    """Pairs around the threshold: kept exactly when their exact similarity reaches it (the
    signature estimate errs by ~0.05 and would misjudge some of these)."""
    words = _words(400, seed=11)
    base = " ".join(words[:300])
    texts = [base] + [" ".join(words[s:s + 300]) for s in range(70, 100)]
    exact = np.array([minhash.exact_jaccard(base, t, CFG) for t in texts[1:]])
    assert exact.min() < CFG.threshold - 0.02 and exact.max() > CFG.threshold + 0.02
    sigs = minhash.minhash_signatures(texts, CFG)
    estimate = np.array([minhash.estimate_jaccard(sigs[0], s) for s in sigs[1:]])
    assert ((estimate >= CFG.threshold) != (exact >= CFG.threshold)).any()
    pairs = np.array([(0, i) for i in range(1, len(texts))])
    kept = dedup.exact_verify(pairs, texts, CFG, SerialEngine())
    assert kept[:, 1].tolist() == (np.flatnonzero(exact >= CFG.threshold) + 1).tolist()


def test_second_band_layout_finds_more_pairs_at_the_threshold():
    """Pairs of Jaccard ~0.6: one layout of 18 x 6 bands makes ~58% of them candidates, two
    ~82% (1 - (1 - 0.6**6)**36); the first layout's keys stay the same."""
    one = CFG.model_copy(update={"band_layouts": 1})
    pairs = []
    for seed in range(120):
        words = _words(300, seed=1000 + seed)
        pairs += [" ".join(words), _edited(words, 0.052, seed)]
    sigs = minhash.minhash_signatures(pairs, CFG)
    two_keys, one_keys = minhash.band_keys(sigs, CFG), minhash.band_keys(sigs, one)
    assert two_keys.shape == (len(pairs), 36) and one_keys.shape == (len(pairs), 18)
    assert np.array_equal(two_keys[:, :18], one_keys)
    exact = np.mean([minhash.exact_jaccard(a, b, CFG) for a, b in zip(pairs[::2], pairs[1::2])])
    assert 0.55 < exact < 0.65
    hit_one = (one_keys[::2] == one_keys[1::2]).any(axis=1).mean()
    hit_two = (two_keys[::2] == two_keys[1::2]).any(axis=1).mean()
    assert 0.4 < hit_one < 0.75 and hit_two > 0.7 and hit_two > hit_one + 0.12


def test_short_and_empty_documents(tmp_path):
    """Fewer words than a shingle: one shingle from the words in order. No words: never a
    candidate, always kept."""
    texts = ["", "alpha beta", "Alpha, beta!", "beta alpha", "", "gamma"]
    sig = minhash.minhash_signatures(texts, CFG)
    assert np.array_equal(sig[1], sig[2]) and not np.array_equal(sig[1], sig[3])
    result = near_dedup(texts, CFG, SerialEngine(), index_dir=tmp_path / "index")
    assert result.keep.tolist() == [True, True, False, True, True, True]
    assert result.representative == [None, None, "1", None, None, None]
    assert list(result.index.ids) == ["1", "3", "5"]  # the kept documents with words


def test_clusters_are_transitive_and_the_first_document_survives():
    words = _words(400, seed=7)
    a, b, c = (" ".join(words[s:s + 300]) for s in (0, 45, 90))
    # a~b and b~c, but a and c are below the threshold: only the chain joins them
    assert minhash.exact_jaccard(a, b, CFG) >= CFG.threshold
    assert minhash.exact_jaccard(b, c, CFG) >= CFG.threshold
    assert minhash.exact_jaccard(a, c, CFG) < CFG.threshold
    other = " ".join(_words(300, seed=8))
    result = near_dedup([other, c, a, b], CFG, SerialEngine())
    assert result.keep.tolist() == [True, True, False, False]
    assert result.representative == [None, None, "1", "1"]
    assert result.cluster.tolist() == [-1, 0, 0, 0]
    assert (result.near_duplicates, result.clusters, result.largest_cluster) == (2, 1, 3)


def test_big_bucket_of_copies_keeps_one():
    """30 exact copies share every bucket: one survivor, one cluster, bounded candidate pairs."""
    text = " ".join(_words(200, seed=3))
    texts = [" ".join(_words(200, seed=s)) for s in range(10, 15)] + [text] * 30
    result = near_dedup(texts, CFG, SerialEngine())
    assert result.keep.tolist() == [True] * 6 + [False] * 29
    assert result.clusters == 1 and set(result.representative[6:]) == {"5"}
    assert result.largest_cluster == 30 and result.counts()["largest_cluster"] == 30  # the collect stat
    assert result.candidate_pairs <= 30 * dedup._PAIRED_PER_BUCKET


def test_same_result_for_any_engine_order_chunking_and_partitions(monkeypatch, tmp_path):
    docs = _docs(40)
    random.Random(0).shuffle(docs)
    base = near_dedup(docs, CFG, SerialEngine(), index_dir=tmp_path / "base")
    assert base.index.bits == 0
    assert base.near_duplicates == 14
    monkeypatch.setattr(dedup, "_EXACT_PAIRS_PER_BLOCK", 3)  # many exact-check blocks, any order
    shards = np.concatenate([base.index.shard(0)])
    for n, (engine, cfg) in enumerate(((ShuffledEngine(1), CFG),
                                       (ShuffledEngine(2), CFG.model_copy(update={"chunk_docs": 3,
                                                                                  "partition_mb": 0.01})),
                                       (SerialEngine(), CFG.model_copy(update={"chunk_docs": 1,
                                                                               "partition_mb": 0.001})))):
        other = near_dedup(docs, cfg, engine, index_dir=tmp_path / str(n))
        assert np.array_equal(other.keep, base.keep)
        assert np.array_equal(other.cluster, base.cluster)
        assert other.representative == base.representative
        assert other.counts() == base.counts()
        assert np.array_equal(other.index.signatures, base.index.signatures)
        assert np.array_equal(other.index.ids, base.index.ids)
        assert other.index.bits == dedup._partition_bits(len(docs), cfg) and (n == 0) == (other.index.bits == 0)
        assert np.array_equal(np.concatenate([other.index.shard(q) for q in range(1 << other.index.bits)]),
                              shards)


def test_components_match_a_plain_graph_search():
    rng = np.random.default_rng(0)
    n = 200
    pairs = np.sort(rng.integers(0, n, (150, 2)), axis=1)
    roots = dedup._components(n, pairs)
    neighbours = {i: set() for i in range(n)}
    for a, b in pairs.tolist():
        neighbours[a].add(b)
        neighbours[b].add(a)
    for start in range(n):
        seen, todo = {start}, [start]
        while todo:
            for nxt in neighbours[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        assert roots[start] == min(seen)


def test_index_round_trip_and_refresh(tmp_path):
    old = [" ".join(_words(200, seed=s)) for s in range(20)]
    first = near_dedup(old, CFG, SerialEngine(), ids=[f"old-{i}" for i in range(20)],
                       index_dir=tmp_path / "v1")
    loaded = DedupIndex.load(tmp_path / "v1")
    assert list(loaded.ids) == [f"old-{i}" for i in range(20)] == list(first.index.ids)
    sigs = minhash.minhash_signatures(old, CFG)
    assert np.array_equal(loaded.signatures, sigs)
    rows = loaded.shard(0)
    assert len(rows) == 20 * 36 and np.all(rows["key"][1:] >= rows["key"][:-1])  # sorted by key
    assert sorted(rows["key"].tolist()) == sorted(minhash.band_keys(sigs, CFG).ravel().tolist())

    copy_of_old = _edited(old[4].split(), 0.01, seed=1)
    fresh = " ".join(_words(200, seed=99))
    new = [fresh, copy_of_old, _edited(fresh.split(), 0.01, seed=2)]
    small = CFG.model_copy(update={"partition_mb": 0.003})  # 8 key ranges against 1 shard
    second = near_dedup(new, small, SerialEngine(), index=loaded, ids=["n-0", "n-1", "n-2"],
                        index_dir=tmp_path / "v2")
    assert second.keep.tolist() == [True, False, False]
    assert second.representative == [None, "old-4", "n-0"]
    assert (second.removed_by_index, second.near_duplicates) == (1, 2)
    assert second.largest_cluster == 2  # old-4 + its copy: an index member counts
    assert list(second.index.ids) == [f"old-{i}" for i in range(20)] + ["n-0"]
    assert second.index.bits == 3

    # refreshes chain: the v2 index (8 shards) knows run 2's docs, read by a run of 1 range
    third = near_dedup([_edited(fresh.split(), 0.02, seed=3)], CFG, SerialEngine(),
                       index=DedupIndex.load(tmp_path / "v2"), ids=["t-0"], index_dir=tmp_path / "v3")
    assert third.keep.tolist() == [False] and third.representative == ["n-0"]
    assert len(third.index) == 21 and third.index.bits == 0


def test_index_refuses_other_config_and_bad_files(tmp_path):
    index = near_dedup(_docs(3), CFG, SerialEngine(), index_dir=tmp_path / "ix").index
    with pytest.raises(ValueError, match="rows"):
        near_dedup(["x y z"], CFG.model_copy(update={"rows": 5}), SerialEngine(),
                   index=index)
    with pytest.raises(FileNotFoundError, match=r"index\.json"):
        DedupIndex.load(tmp_path / "missing")
    np.save(tmp_path / "ix" / "signatures.npy", np.asarray(index.signatures)[:, :3])
    with pytest.raises(ValueError, match=r"signatures\.npy"):
        DedupIndex.load(tmp_path / "ix")
    with pytest.raises(ValueError, match="ids"):
        near_dedup(["a b c"], CFG, SerialEngine(), ids=["1", "2"])
    with pytest.raises(ValueError, match="band_layouts"):
        near_dedup(["x y z"], CFG.model_copy(update={"band_layouts": 1}), SerialEngine(),
                   index=index)
    meta = json.loads((tmp_path / "ix" / "index.json").read_text())  # an index of format 2
    (tmp_path / "ix" / "index.json").write_text(json.dumps({**meta, "format": 2}))
    with pytest.raises(ValueError, match=r"index format 2.*rebuild the index"):
        DedupIndex.load(tmp_path / "ix")


@pytest.mark.parametrize("kwargs, field", [
    ({"bands": 0}, "bands"), ({"rows": -1}, "rows"), ({"threshold": 1.5}, "threshold"),
    ({"threshold": 0}, "threshold"), ({"shingle_words": 0}, "shingle_words"),
    ({"chunk_docs": 0}, "chunk_docs"), ({"band": 3}, "band"), ({"bands": 100, "rows": 50}, "bands x rows"),
])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(pydantic.ValidationError, match=field):
        DedupConfig(**kwargs)


def test_precision_recall_counts_pairs():
    truth = {(0, 1), (0, 2), (1, 2), (3, 4)}
    assert cluster_pairs([0, 0, 0, -1, -1]) == {(0, 1), (0, 2), (1, 2)}
    assert precision_recall([0, 0, 0, -1, -1], truth) == (1.0, 0.75)
    assert precision_recall([0, 0, 1, 1, -1], truth) == (0.5, 0.25)
    assert precision_recall([-1] * 5, truth) == (1.0, 0.0)


def test_precision_and_recall_on_labelled_real_documents(shared_data):
    """~310 documents (40 originals, 1-3 edited copies each). Floors: precision 0.95 (the goal);
    recall 0.95: with this config, seeds 0-7 of this set size measured 0.93-1.00 (0.98 for
    seed 0; one band layout checked at 0.6: 0.87-0.98); a few labelled pairs (two copies of one
    original) are below the threshold and are found only through the original they share."""
    texts, truth = build_labelled_set(shared_data, n_originals=40, seed=0, n_distinct=200)
    assert 300 <= len(texts) <= 330 and len(truth) >= 100
    result = near_dedup(texts, CFG, SerialEngine())
    precision, recall = precision_recall(result.cluster, truth)
    assert precision >= 0.95
    assert recall >= 0.95
    assert result.near_duplicates == len(texts) - result.keep.sum() > 60




def test_a_killed_run_redoes_only_its_unfinished_chunks_and_partitions(tmp_path):
    docs = _docs(40)
    cfg = CFG.model_copy(update={"chunk_docs": 4, "partition_mb": 0.005})  # 14 chunks, 8 ranges
    base = near_dedup(docs, cfg, SerialEngine(), index_dir=tmp_path / "base")
    work = tmp_path / "spill"
    with pytest.raises(RuntimeError, match="killed"):
        near_dedup(docs, cfg, DiesPartWay(dedup._chunk_task, 5), work_dir=work)
    with pytest.raises(RuntimeError, match="killed"):
        first = DiesPartWay(dedup._partition_task, 3)
        near_dedup(docs, cfg, first, work_dir=work)
    assert first.done["near._chunk_task"] == [True] * 5 + [False] * 9
    resumed = DiesPartWay()
    result = near_dedup(docs, cfg, resumed, work_dir=work, index_dir=tmp_path / "resumed")
    assert resumed.done == {"near._chunk_task": [True] * 14, "near._partition_task": [True] * 3 + [False] * 5}
    assert result.counts() == base.counts() and result.representative == base.representative
    assert np.array_equal(result.index.signatures, base.index.signatures)
    other = near_dedup(docs[:-1], cfg, DiesPartWay(), work_dir=work)  # another input: its own files
    assert other.near_duplicates == base.near_duplicates - 1
