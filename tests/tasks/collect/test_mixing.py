"""Data mixing: weights up/down-sample by tokens, budgets and the total cap bind, the mix is
deterministic and its record says what was taken."""
from __future__ import annotations

import json
from collections import Counter

import pytest
from pydantic import ValidationError

from gristmill.tasks.collect.output.mixing import MixConfig, mix_documents


def _docs(source: str, count: int, nbytes: int = 400) -> list[dict]:
    # ASCII text, so bytes == characters; 400 bytes = 100 tokens at 4 bytes/token
    return [{"id": f"{source}-{i}", "text": f"{source}{i:04d} ".ljust(nbytes, "x"),
             "source": source} for i in range(count)]


SOURCES = {"web": _docs("web", 40), "books": _docs("books", 10)}


def test_default_mix_takes_every_document_once():
    mixed, record = mix_documents(SOURCES, MixConfig())
    assert sorted(d["id"] for d in mixed) == sorted(d["id"] for docs in SOURCES.values()
                                                    for d in docs)
    assert record["sources"]["web"]["tokens_available"] == 40 * 100
    assert record["tokens"] == 50 * 100


def test_weight_two_repeats_every_document_twice_and_half_keeps_a_seeded_half():
    mixed, record = mix_documents(SOURCES, MixConfig(weights={"books": 2.0, "web": 0.5}))
    counts = Counter(d["id"] for d in mixed)
    assert {counts[f"books-{i}"] for i in range(10)} == {2}
    web_taken = [i for i in range(40) if counts[f"web-{i}"]]
    assert len(web_taken) == 20 and max(counts[f"web-{i}"] for i in web_taken) == 1
    assert web_taken != list(range(20))  # a random half, not the first half
    books, web = record["sources"]["books"], record["sources"]["web"]
    assert (books["docs_taken"], books["unique_docs_taken"], books["epochs"],
            books["max_doc_repeats"]) == (20, 10, 2.0, 2)
    assert (web["docs_taken"], web["tokens_taken"], web["epochs"]) == (20, 2000, 0.5)
    assert record["sources"]["books"]["share_of_mix"] == pytest.approx(2000 / 4000)


def test_fractional_upsampling_adds_a_partial_epoch():
    mixed, record = mix_documents({"books": _docs("books", 10)}, MixConfig(weights={"books": 1.5}))
    counts = Counter(d["id"] for d in mixed)
    assert sorted(Counter(counts.values()).items()) == [(1, 5), (2, 5)]
    assert record["sources"]["books"]["epochs"] == 1.5


def test_selection_is_by_tokens_not_documents():
    sources = {"long": _docs("long", 4, nbytes=4000), "short": _docs("short", 40, nbytes=400)}
    _, record = mix_documents(sources, MixConfig(weights={"long": 0.5, "short": 0.5}))
    assert record["sources"]["long"]["docs_taken"] == 2
    assert record["sources"]["short"]["docs_taken"] == 20
    assert record["sources"]["long"]["tokens_taken"] == record["sources"]["short"]["tokens_taken"]


def test_zero_weight_drops_a_source():
    mixed, record = mix_documents(SOURCES, MixConfig(weights={"web": 0}))
    assert {d["source"] for d in mixed} == {"books"}
    assert record["sources"]["web"]["docs_taken"] == 0


def test_token_budget_caps_a_source():
    _, record = mix_documents(SOURCES, MixConfig(weights={"books": 3.0},
                                                 token_budgets={"web": 1500, "books": 2500}))
    assert record["sources"]["web"]["tokens_taken"] == 1500  # 15 whole documents
    assert record["sources"]["books"]["tokens_taken"] == 2500  # below weight x available = 3000
    assert record["sources"]["books"]["token_budget"] == 2500


def test_total_tokens_scales_sources_keeping_weight_ratios():
    _, record = mix_documents(SOURCES, MixConfig(weights={"books": 2.0}, total_tokens=3000))
    # targets before the cap: web 4000, books 2000 -> scaled by 3000/6000
    assert record["sources"]["web"]["tokens_taken"] == 2000
    assert record["sources"]["books"]["tokens_taken"] == 1000
    assert record["tokens"] == 3000


def test_mix_is_deterministic_interleaved_and_seed_dependent():
    cfg = MixConfig(weights={"web": 0.5, "books": 1.5}, seed=3)
    first, record = mix_documents(SOURCES, cfg)
    again, record_again = mix_documents(SOURCES, cfg)
    assert [d["id"] for d in first] == [d["id"] for d in again] and record == record_again
    other, _ = mix_documents(SOURCES, cfg.model_copy(update={"seed": 4}))
    assert [d["id"] for d in other] != [d["id"] for d in first]
    assert {d["source"] for d in first[:15]} == {"web", "books"}  # shuffled across sources


def test_adding_a_source_leaves_the_others_selection_alone():
    cfg = MixConfig(weights={"web": 0.5})
    alone, _ = mix_documents({"web": SOURCES["web"]}, cfg)
    together, _ = mix_documents(SOURCES, cfg)
    assert sorted(d["id"] for d in alone) == sorted(d["id"] for d in together
                                                    if d["source"] == "web")


def test_record_is_json_with_every_source_field():
    _, record = mix_documents(SOURCES, MixConfig(weights={"web": 0.5}, total_tokens=10_000))
    assert json.loads(json.dumps(record)) == record
    assert set(record["sources"]["web"]) == {
        "docs_available", "tokens_available", "weight", "token_budget", "tokens_target",
        "docs_taken", "tokens_taken", "unique_docs_taken", "epochs", "max_doc_repeats",
        "share_of_mix"}
    assert record["sources"]["books"]["weight"] == 1.0  # not named: weight 1
    assert (record["bytes_per_token"], record["total_tokens_cap"]) == (4.0, 10_000)


def test_unknown_sources_and_bad_values_are_named():
    with pytest.raises(ValueError, match=r"\['news', 'wiki'\]"):
        mix_documents(SOURCES, MixConfig(weights={"wiki": 2.0}, token_budgets={"news": 5}))
    with pytest.raises(ValidationError, match=r"weights\.web"):
        MixConfig(weights={"web": -1.0})
    with pytest.raises(ValidationError, match=r"token_budgets\.web"):
        MixConfig(token_budgets={"web": -5})
    with pytest.raises(ValueError, match="'web', document 1"):
        mix_documents({"web": [{"text": "ok"}, {"body": "no text"}]}, MixConfig())


def test_empty_source_takes_nothing():
    mixed, record = mix_documents({"web": [], "books": _docs("books", 2)}, MixConfig())
    assert len(mixed) == 2
    web = record["sources"]["web"]
    assert (web["docs_available"], web["docs_taken"], web["epochs"], web["max_doc_repeats"]) == (
        0, 0, 0.0, 0)
