"""Benchmark decontamination: real eval files are indexed by their own shapes, a document
holding a benchmark item is flagged with that item, unrelated text is not, and the report counts."""
from __future__ import annotations

import gzip
import json
import pickle
import re

import pytest

from gristmill.core.decontam import (
    DROP_REASON,
    FALLBACK,
    DecontamConfig,
    build_index,
    drop_reason,
    item_texts,
    normalize_words,
)

EXPECTED_SHAPE = {
    "arc_challenge": "icl_multiple_choice", "arc_easy": "icl_multiple_choice",
    "boolq": "icl_multiple_choice", "copa": "icl_multiple_choice", "gsm8k": "gsm8k",
    "hellaswag": "hellaswag", "lambada_openai": "lambada", "mmlu_redux": "question_choices",
    "openbookqa": "icl_multiple_choice", "piqa": "piqa", "winogrande": "winogrande",
}


@pytest.fixture(scope="module")
def gsm8k_items(shared_data):
    path = shared_data / "eval" / "gsm8k" / "test_part1.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def index(shared_data):
    eval_dir = shared_data / "eval"
    return build_index(DecontamConfig(eval_sets=[str(eval_dir / "gsm8k"), str(eval_dir / "copa"),
                                                 str(eval_dir / "piqa")]))


def test_every_shared_benchmark_is_read_by_its_own_shape(shared_data):
    sets = sorted(p for p in (shared_data / "eval").iterdir() if p.is_dir())
    report = build_index(DecontamConfig(eval_sets=[str(p) for p in sets])).report()
    used = {name: list(info["shapes"]) for name, info in report["benchmarks"].items()}
    assert used == {name: [shape] for name, shape in EXPECTED_SHAPE.items()}
    assert report["benchmarks"]["gsm8k"]["items_indexed"] == 660
    assert report["benchmarks"]["mmlu_redux"]["items_indexed"] == 2850


def test_document_with_a_gsm8k_question_is_flagged_with_that_item(index, gsm8k_items):
    question = gsm8k_items[4]["question"]
    # A web copy: other case, other spacing and punctuation, surrounded by unrelated text.
    doc = ("Homework help forum. Posted by a parent: " + question.upper().replace(".", " ;")
           + "\n\nThanks in advance, any help is appreciated!")
    matches = index.find(doc)
    assert matches == [("gsm8k", "4")]
    assert drop_reason(matches) == DROP_REASON


def test_gsm8k_answer_without_calculator_annotations_is_found(index, gsm8k_items):
    answer = gsm8k_items[0]["answer"]  # "16 - 3 - 4 = <<16-3-4=9>>9 duck eggs ..."
    web_copy = answer.replace("<<16-3-4=9>>", "").replace("<<9*2=18>>", "")
    assert index.find(web_copy) == [("gsm8k", "0")]


def test_unrelated_text_is_not_flagged(index, shared_data):
    speech = (shared_data / "corpus" / "nltk_inaugural" / "2009-Obama.txt").read_text()
    assert index.find(speech) == []
    assert drop_reason([]) is None


def test_twelve_words_of_a_long_item_are_not_a_13_gram(index, gsm8k_items):
    words = normalize_words(gsm8k_items[4]["question"])
    assert len(words) > 13
    assert index.find(" ".join(words[:12])) == []
    assert index.find(" ".join(words[:13])) == [("gsm8k", "4")]


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_short_items_are_one_whole_ngram_and_tiny_items_are_skipped(tmp_path):
    source = _write_jsonl(tmp_path / "quiz.jsonl", [
        {"question": "What colour is the sky on Mars?", "answer": "Butterscotch"},  # 8 words
        {"question": "Yes or no?", "answer": "yes"},  # 4 words: too short to index
    ])
    index = build_index(DecontamConfig(eval_sets=[source]))
    found = index.find("Fun fact. what COLOUR is the sky on mars -- butterscotch!")
    assert found == [("quiz", "0")]
    assert index.find("What colour is the sky on Mars? Nobody knows.") == []  # part of it only
    assert index.find("yes or no? yes") == []
    info = index.report()["benchmarks"]["quiz"]
    assert (info["items_indexed"], info["items_too_short"], info["ngrams_indexed"]) == (1, 1, 1)


def test_min_overlapping_ngrams(tmp_path, gsm8k_items):
    source = _write_jsonl(tmp_path / "gsm.jsonl", gsm8k_items[:3])
    words = normalize_words(gsm8k_items[2]["question"])
    strict = build_index(DecontamConfig(eval_sets=[source], min_overlapping_ngrams=3))
    assert strict.find(" ".join(words[:14])) == []  # 2 shared 13-grams
    assert strict.find(" ".join(words[:15])) == [("gsm", "2")]  # 3 shared 13-grams


def test_shapes_strip_prompt_labels_and_split_winogrande_fillings(shared_data):
    def first(name):
        path = next((shared_data / "eval" / name).glob("*.jsonl"))
        return json.loads(path.read_text().splitlines()[0])

    shape, [text] = item_texts(first("boolq"))
    assert shape == "icl_multiple_choice" and not text.startswith("Passage:")
    assert "Question:" not in text
    shape, texts = item_texts(first("winogrande"))
    assert shape == "winogrande" and texts == [
        "Sarah was a much better surgeon than Maria so Sarah always got the easier cases.",
        "Sarah was a much better surgeon than Maria so Maria always got the easier cases."]
    record = {"question": "Which gas do plants absorb?", "answer": 1,
              "choices": {"text": ["oxygen", "carbon dioxide"], "label": ["A", "B"]}}
    assert item_texts(record) == ("question_choices", [
        "Which gas do plants absorb? oxygen carbon dioxide A B"])


def test_unknown_record_shape_falls_back_to_all_string_fields():
    record = {"prompt": "Name the largest planet.", "meta": {"hint": "gas giant"}, "label": 3}
    assert item_texts(record) == (FALLBACK, ["Name the largest planet. gas giant"])


def test_parquet_eval_set_and_record_ids(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "mybench"
    folder.mkdir()
    pq.write_table(pa.table({"id": ["q-17"], "question": ["Which river flows through the city "
                                                           "of Vienna in Austria?"],
                             "answer": ["The Danube"]}), folder / "test.parquet")
    index = build_index(DecontamConfig(eval_sets=[str(folder)]))
    assert index.find("which river flows through the city of vienna in austria the danube") == [
        ("mybench", "q-17")]


def test_report_counts_items_documents_and_lists_doc_ids(index, gsm8k_items):
    docs = {"doc-a": gsm8k_items[1]["question"] + " " + gsm8k_items[2]["question"],
            "doc-b": "intro " + gsm8k_items[1]["question"],
            "doc-c": "nothing to see here, just an ordinary page about gardening tools"}
    for doc_id, text in docs.items():
        index.record(doc_id, index.find(text))
    report = json.loads(json.dumps(index.report()))  # JSON-serializable as is
    gsm8k = report["benchmarks"]["gsm8k"]
    assert (report["documents_checked"], report["documents_flagged"]) == (3, 2)
    assert (gsm8k["items_found"], gsm8k["documents_flagged"]) == (2, 2)
    assert gsm8k["found"] == {"1": ["doc-a", "doc-b"], "2": ["doc-a"]}
    assert gsm8k["items_indexed"] == 660
    assert report["benchmarks"]["copa"]["items_found"] == 0


def test_index_pickles_for_engine_workers(index, gsm8k_items):
    text = gsm8k_items[7]["question"]
    assert pickle.loads(pickle.dumps(index)).find(text) == index.find(text) == [("gsm8k", "7")]


def test_missing_or_duplicate_eval_sets_are_named(tmp_path):
    with pytest.raises(ValueError, match="nope"):
        build_index(DecontamConfig(eval_sets=[str(tmp_path / "nope")]))
    a = _write_jsonl(tmp_path / "x.jsonl", [{"question": "q " * 20, "answer": "a"}])
    (tmp_path / "sub").mkdir()
    b = _write_jsonl(tmp_path / "sub" / "x.jsonl", [{"question": "z " * 20, "answer": "a"}])
    with pytest.raises(ValueError, match="'x'"):
        build_index(DecontamConfig(eval_sets=[a, b]))


def test_a_bad_eval_set_line_is_named_by_file_and_line(tmp_path):
    gzipped = tmp_path / "quiz.jsonl.gz"
    with gzip.open(gzipped, "wt") as f:
        f.write(json.dumps({"question": "q " * 20, "answer": "a"}) + "\n\n{oops\n")
    with pytest.raises(ValueError, match=rf"eval set file {re.escape(str(gzipped))}:3: not JSON"):
        build_index(DecontamConfig(eval_sets=[str(gzipped)]))
    listed = tmp_path / "listed.jsonl"
    listed.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=rf"eval set file {re.escape(str(listed))}:1: expected a JSON object"):
        build_index(DecontamConfig(eval_sets=[str(listed)]))
