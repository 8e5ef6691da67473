"""Data gates from the command line, where no one can be asked (the embedded Prefect has no UI): a
tripped gate stops `gristmill refresh` and `gristmill run` with one line naming it, exit 3;
`--approve-gates` goes on and is remembered for that collect artifact, so a later refresh publishes
it without asking. The decision logic is tests/tasks/collect/test_gates.py's; the Prefect UI's Resume is
tests/flows/test_serve_browser.py's. Data collect finds unusable only once it reads it stops the run
with one line too, exit 2."""
from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import pytest
from pipeline_helpers import REPO, cli_env

from gristmill.flows import history
from gristmill.infra.artifacts import ArtifactStore

TINY = "configs/tiny.yaml"


def _cli(home, *args: str, services: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gristmill", *args], cwd=REPO, env=cli_env(home, services),
                          capture_output=True, text=True, timeout=900)


def _own_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """gristmill's own lines on stderr (the rest is Prefect's log)."""
    return [line for line in proc.stderr.splitlines() if line.startswith("gristmill: ")]


def _tags(home, run_id: str) -> dict[str, str]:
    with sqlite3.connect(home / "mlflow.db") as db:
        return dict(db.execute("select key, value from tags where run_uuid = ? and key like 'gristmill.gates.%'",
                               (run_id,)))


def test_the_approve_gates_flags_reach_the_runs(monkeypatch):
    import gristmill.flows.cli as cli
    from gristmill.flows import supervised
    from gristmill.infra import supervisor

    called = []
    monkeypatch.setattr(supervisor, "supervise", lambda argv, **_: called.append(json.loads(argv[-1])) or 0)
    assert cli.main(["run", TINY, "--approve-gates"]) == 0 and cli.main(["refresh", TINY]) == 0
    assert cli.main(["refresh", TINY, "--approve-gates", "a.b=1"]) == 0
    assert [c["approve_gates"] for c in called] == [True, False, True] and called[2]["overrides"] == ["a.b=1"]
    assert supervised.GATE_EXIT == 3


@pytest.mark.slow
def test_a_tripped_gate_stops_the_cli_with_exit_3_until_approved(shared_data, tmp_path):
    """10 real web documents, 8 kept: collect.gates.max_removed_fraction=0.1 trips on the 20% removed."""
    source = shared_data / "jsonl" / "dolma_cc" / "cc_en_head-0091.jsonl"
    home = tmp_path / "home"
    config = [TINY, f"collect.sources={json.dumps([str(source)])}", "collect.gates.max_removed_fraction=0.1"]
    line = (f"gristmill: data gate tripped on collect-{{key}}: collect.gates.max_removed_fraction: source "
            f"'{source}': 20.0% > 10.0% (10 documents → 8 kept); to go on with this data: --approve-gates "
            "(or loosen collect.gates)")
    store = ArtifactStore(home / "artifacts")

    refresh = _cli(home, "refresh", *config)  # collects the new file, then stops before publishing it
    assert refresh.returncode == 3, refresh.stderr[-3000:]
    [(_, key, collected)] = list(store.committed("collect"))
    assert _own_lines(refresh) == [line.format(key=key)] and store.corpus_versions() == []

    stopped = _cli(home, "run", *config, "--until", "collect")  # the same collect artifact, reused
    assert stopped.returncode == 3 and _own_lines(stopped) == [line.format(key=key)], stopped.stderr[-3000:]
    assert f"plan: collect  {key}  reuse" in stopped.stderr

    approved = _cli(home, "run", *config, "--until", "collect", "--approve-gates")
    assert approved.returncode == 0, approved.stderr[-3000:]
    [decision] = store.gate_decisions("collect", key)
    assert (decision["outcome"], decision["by"]) == ("approved", "approve_gates (--approve-gates)")
    tags = _tags(home, decision["mlflow_run_id"])
    assert tags["gristmill.gates.outcome"] == "approved" and "20.0% > 10.0%" in tags["gristmill.gates.tripped"]
    [card] = (home / "reports" / decision["mlflow_run_id"]).glob("report_card.md")
    assert "## Data gates" in card.read_text() and "approved by approve_gates (--approve-gates)" in card.read_text()
    card.unlink()  # `gristmill report` rebuilds it, the gates' section from the run's tags
    rebuilt, _, _ = history.report(home, decision["mlflow_run_id"])
    assert rebuilt == card and "approved by approve_gates (--approve-gates)" in card.read_text()

    published = _cli(home, "refresh", *config)  # approved for that artifact: not asked again
    assert published.returncode == 0 and published.stdout.startswith(f"corpus v1: {collected}"), \
        published.stderr[-3000:]
    [version] = store.corpus_versions()
    assert version["collect_key"] == key and len(store.gate_decisions("collect", key)) == 1
    with sqlite3.connect(home / "mlflow.db") as db:
        [(refresh_run,)] = db.execute("select run_uuid from tags where key = 'gristmill.corpus.version'")
    assert _tags(home, refresh_run)["gristmill.gates.by"].startswith("an earlier approval (approve_gates")


@pytest.mark.slow
def test_data_found_unusable_when_read_stops_the_run_in_one_line_without_a_traceback(crawl_server, prefect_server,
                                                                                   tmp_path):
    """Not JSON at all, or a crawl the server has no listing of: exit 2, one line of gristmill's
    and no traceback in Prefect's log; the work units collect finished are kept for the next run.
    Both fail in collect, before any gate: the session's standing Prefect server saves each run
    starting its own."""
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(bytes(range(256)) * 40)
    unreadable = _cli(tmp_path / "a", "run", TINY, f"collect.sources=[{garbage}]", "--until", "collect",
                      services=prefect_server)
    assert unreadable.returncode == 2, unreadable.stderr[-3000:]
    assert _own_lines(unreadable) == [f"gristmill: no source yielded a document: '{garbage}' (error_bad_json 1, "
                                      "error_invalid_utf8 40)"]
    assert "Traceback" not in unreadable.stdout + unreadable.stderr
    [partial] = (tmp_path / "a" / "artifacts" / "collect").glob("collect-*.partial")
    assert list((partial / "units").iterdir())

    unknown = _cli(tmp_path / "b", "run", TINY, "collect.sources=[cc:CC-MAIN-2019-03]",
                   f"collect.cc_base_url={crawl_server.base_url}", "--until", "collect", services=prefect_server)
    assert unknown.returncode == 2, unknown.stderr[-3000:]
    assert _own_lines(unknown) == [f"gristmill: {crawl_server.base_url}/crawl-data/CC-MAIN-2019-03/warc.paths.gz: "
                                   "HTTP 404 Not Found: no warc listing for crawl 'CC-MAIN-2019-03'; is the crawl id "
                                   "right?"]
    assert "Traceback" not in unknown.stdout + unknown.stderr
