"""The Prefect UI in a real browser, against the served `pipeline` deployment (the `served` fixture):
a Custom run with a field changed completes and records the value in MLflow, and its flow run page
shows the stage task runs, the `pipeline-summary` and `report-card` artifacts and the link to the
MLflow run; a run that fails in pretrain after a checkpoint, retried with the UI's Retry, completes
as the same flow run with the finished stages reused and pretrain resumed from its checkpoint; a
run whose data gate trips pauses, and Resume with approve lets it complete, without, fails it.

Headless Chromium is Debian's `chromium-headless-shell` (`.ci/run` installs it), driven by
Playwright; every request to a host other than 127.0.0.1 is aborted. The screenshots of each step
are kept when the test fails (`$GRISTMILL_TEST_ARTIFACTS`, default tests/artifacts/).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

import pytest
from pipeline_helpers import REPO, committed_dir
from serve_helpers import (
    DIRECT,
    TERMINAL,
    api,
    mlflow_params,
    mlflow_parents,
    wait,
    wait_finished,
)

from gristmill.infra.artifacts import ArtifactStore

pytestmark = pytest.mark.slow
# The browser itself: /usr/bin/chromium-headless-shell is a shell script around it.
CHROMIUM = Path("/usr/lib/chromium/chromium-headless-shell")
LOCAL = "127.0.0.1"


@pytest.fixture
def browser_page():
    if not CHROMIUM.is_file():
        pytest.fail(f"{CHROMIUM} not found: install Debian's chromium-headless-shell "
                    "(apt-get install chromium-headless-shell; .ci/run does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM))
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)  # the UI on a loaded 2-core machine
        # Nothing leaves this machine: the UI's fonts, analytics and anything else are refused.
        page.route("**/*", lambda route: route.continue_() if urlparse(route.request.url).hostname == LOCAL
                   else route.abort())
        yield page
        browser.close()


@contextmanager
def screenshots(page, folder: Path, name: str):
    """`shot(step)` saves a screenshot of the page into `folder`; if the block fails, the folder
    (with a last screenshot) is copied where it is kept and its path printed."""
    folder.mkdir(parents=True, exist_ok=True)
    count = iter(range(1, 100))

    def shot(step: str) -> None:
        page.screenshot(path=folder / f"{next(count):02d}-{step}.png", full_page=True)

    try:
        yield shot
    except BaseException:
        try:
            shot("failure")
        finally:
            kept = Path(os.environ.get("GRISTMILL_TEST_ARTIFACTS", REPO / "tests" / "artifacts")) / name
            shutil.rmtree(kept, ignore_errors=True)
            shutil.copytree(folder, kept)
            print(f"screenshots of {name}: {kept}")
        raise


def _property(page, label: str):
    """One field of the parameter form, by its label (`until (Optional)`): the innermost property
    holding that label (the sections around it hold it too, and come first in the page)."""
    return page.locator(".schema-form-property").filter(
        has=page.locator(".schema-form-property__label", has_text=re.compile(f"^{re.escape(label)}"))).last


def _task_runs(served, flow_run_id: str) -> list[str]:
    return sorted(t["name"] for t in api(served.api, "/task_runs/filter", {
        "flow_runs": {"id": {"any_": [flow_run_id]}}}))


def _open_flow_run(page, served, flow_run_id: str, state: str) -> None:
    page.goto(f"{served.ui}/runs/flow-run/{flow_run_id}")
    page.get_by_text(state, exact=True).first.wait_for()


def test_a_custom_run_from_the_ui_completes_and_records_the_changed_field(served, browser_page, tmp_path):
    page = browser_page
    with screenshots(page, tmp_path / "screenshots", "custom-run") as shot:
        page.goto(f"{served.ui}/deployments/deployment/{served.deployment['id']}")
        page.get_by_role("button", name="Run", exact=True).click()
        page.get_by_text("Custom run").click()
        _property(page, "until").get_by_role("button", name="str", exact=True).click()
        _property(page, "until").locator("input, textarea").fill("tokenize")
        _property(page, "Vocab Size").locator("input").fill("2048")
        shot("custom-run-form")
        with page.expect_response(re.compile(r"/create_flow_run$")) as created:
            page.get_by_role("button", name="Submit").click()
        flow_run_id = created.value.json()["id"]  # the run the UI created
        shot("submitted")

        run = wait_finished(served, flow_run_id)
        assert run["state"]["type"] == "COMPLETED", served.log.read_text()[-3000:]
        assert run["parameters"]["until"] == "tokenize"
        [parent] = mlflow_parents(served.home, flow_run_id)
        params = mlflow_params(served.home, parent)
        assert params["tokenize.vocab_size"] == "2048" and params["pretrain.max_steps"] == "60"

        _open_flow_run(page, served, flow_run_id, "Completed")
        page.get_by_text("Task Runs", exact=True).click()
        names = _task_runs(served, flow_run_id)  # `<stage> [run]` or `<stage> [reuse]`
        assert [name.split()[0] for name in names] == ["collect", "tokenize"], names
        for name in names:
            page.get_by_text(name).first.wait_for()
        shot("task-runs")
        page.get_by_text("Artifacts", exact=True).click()
        for key in ("pipeline-summary", "report-card", "mlflow-run"):
            page.get_by_text(key).first.wait_for()
        shot("artifacts")
        [link] = api(served.api, "/artifacts/filter", {
            "artifacts": {"key": {"any_": ["mlflow-run"]}, "flow_run_id": {"any_": [flow_run_id]}}})
        # A link artifact is stored as Markdown, [text](url); the url is the MLflow UI's run page.
        url = re.fullmatch(r"\[.*\]\((.*)\)", link["data"]).group(1)
        assert re.fullmatch(rf"http://127\.0\.0\.1:\d+/#/experiments/\d+/runs/{parent}", url), url
        with DIRECT.open(url.split("#")[0], timeout=30) as mlflow_ui:
            assert mlflow_ui.status == 200


def test_a_run_failed_in_pretrain_is_retried_from_the_ui_reusing_what_finished(served, browser_page, tmp_path):
    page = browser_page
    with screenshots(page, tmp_path / "screenshots", "retry") as shot:
        served.fault_armed.touch()  # pretrain fails once, right after its step-10 checkpoint
        # A tokenizer of its own, so that the first attempt computes tokenize; 20 steps of pretrain.
        overrides = ["tokenize.vocab_size=1536", "pretrain.max_steps=20", "pretrain.checkpoint_every=10"]
        run = api(served.api, f"/deployments/{served.deployment['id']}/create_flow_run",
                  {"parameters": {"until": "pretrain", "overrides": overrides}})
        failed = wait_finished(served, run["id"])
        assert failed["state"]["type"] == "FAILED", served.log.read_text()[-3000:]
        assert not served.fault_armed.exists() and failed["run_count"] == 1
        first = _task_runs(served, run["id"])
        assert {"tokenize [run]", "pretrain [run]"} <= set(first), first

        _open_flow_run(page, served, run["id"], "Failed")
        shot("failed")
        page.get_by_role("button", name="Retry", exact=True).click()
        page.get_by_role("dialog").get_by_role("button", name="Retry", exact=True).click()  # confirm
        wait(lambda: api(served.api, f"/flow_runs/{run['id']}")["state"]["type"] != "FAILED", 60,
             "the Retry to leave the Failed state")
        shot("retried")

        done = wait_finished(served, run["id"])
        assert done["state"]["type"] == "COMPLETED", served.log.read_text()[-3000:]
        assert done["run_count"] == 2 and len(mlflow_parents(served.home, run["id"])) == 2
        _open_flow_run(page, served, run["id"], "Completed")
        page.get_by_text("Task Runs", exact=True).click()
        for name in ("tokenize [run]", "tokenize [reuse]", "pretrain [run]"):  # both attempts'
            page.get_by_text(name, exact=True).first.wait_for()
        shot("completed")

        # The retry ran the stages again as `[reuse]` but pretrain, which continued from step 10.
        second = _task_runs(served, run["id"])
        assert {"collect [reuse]", "tokenize [reuse]"} <= set(second), second
        assert second.count("tokenize [run]") == 1 and second.count("pretrain [run]") == 2, second
        pretrain = json.loads((committed_dir(served.home, "pretrain") / "manifest.json").read_text())
        assert pretrain["stats"]["resumed_from_step"] == 10 and pretrain["stats"]["steps"] == 20
        [summary] = api(served.api, "/artifacts/filter", {
            "artifacts": {"key": {"any_": ["pipeline-summary"]}, "flow_run_id": {"any_": [run["id"]]}}})
        rows = {r.split("|")[1].strip(): r.split("|")[3].strip() for r in summary["data"].splitlines()[2:]
                if r.startswith("|")}
        assert rows == {"collect": "reused", "tokenize": "reused", "pretrain": "computed"}, summary["data"]


def _paused(served, overrides: list[str]) -> str:
    """A run of the deployment through tokenize whose data gates trip on the served collect
    artifact (the custom run's, reused; its tokenizer too), once it waits paused for a person."""
    run = api(served.api, f"/deployments/{served.deployment['id']}/create_flow_run", {
        "parameters": {"until": "tokenize", "overrides": ["tokenize.vocab_size=2048", *overrides]}})
    wait(lambda: (state := api(served.api, f"/flow_runs/{run['id']}")["state"]["type"]) == "PAUSED"
         or (state in TERMINAL and pytest.fail(f"{state}: {served.log.read_text()[-3000:]}")), 600,
         "the run to pause at the data gates")
    return run["id"]


def _resume(page, approve: bool, comment: str, gate: str) -> None:
    """On the paused run's page: Resume, the gate shown, approve on or off, a comment, Submit."""
    page.get_by_role("button", name="Resume", exact=True).click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_text(f"collect.gates.{gate}").first.wait_for()  # the tripped gate, with its numbers
    if approve:
        dialog.get_by_role("switch").click()
    dialog.locator("textarea").fill(comment)
    with page.expect_response(re.compile(r"/flow_runs/[^/]+/resume$")) as resumed:
        dialog.get_by_role("button", name="Submit").click()
    response = resumed.value
    assert response.ok and response.json()["status"] == "ACCEPT", (response.status, response.text())


def _gate_record(served, flow_run_id: str) -> dict:
    [collect] = {p.parent for p in (served.home / "artifacts" / "collect").glob("*/manifest.json")}
    records = ArtifactStore(served.home / "artifacts").gate_decisions("collect", collect.name.rsplit("-", 1)[1])
    [record] = [r for r in records if r["prefect_flow_run_id"] == flow_run_id]
    return record


def test_a_tripped_data_gate_approved_in_the_ui_lets_the_run_complete(served, browser_page, tmp_path):
    page = browser_page
    with screenshots(page, tmp_path / "screenshots", "gate-approved") as shot:
        flow_run_id = _paused(served, ["collect.gates.max_removed_fraction=0.1"])
        # collect ran (or was reused from an earlier test's run); tokenize waits for the decision
        assert [name.split()[0] for name in _task_runs(served, flow_run_id)] == ["collect"]
        [artifact] = api(served.api, "/artifacts/filter", {
            "artifacts": {"key": {"any_": ["collect-gates"]}, "flow_run_id": {"any_": [flow_run_id]}}})
        assert "collect.gates.max_removed_fraction" in artifact["data"] and "### Samples of what was removed" \
            in artifact["data"] and "~~~text" in artifact["data"]
        _open_flow_run(page, served, flow_run_id, "Paused")
        shot("paused")
        _resume(page, approve=True, comment="the demo docs lose their tables, as expected",
                gate="max_removed_fraction")
        shot("resumed")

        run = wait_finished(served, flow_run_id)
        assert run["state"]["type"] == "COMPLETED", served.log.read_text()[-3000:]
        assert [name.split()[0] for name in _task_runs(served, flow_run_id)] == ["collect", "tokenize"]
        record = _gate_record(served, flow_run_id)
        assert (record["outcome"], record["by"], record["comment"]) == (
            "approved", "a person in the Prefect UI", "the demo docs lose their tables, as expected")
        [parent] = mlflow_parents(served.home, flow_run_id)
        with sqlite3.connect(served.home / "mlflow.db") as db:
            tags = dict(db.execute("select key, value from tags where run_uuid = ?", (parent,)))
        assert (tags["gristmill.gates.outcome"], tags["gristmill.gates.by"]) == ("approved", record["by"])
        card = (served.home / "reports" / parent / "report_card.md").read_text()
        assert "## Data gates" in card and '"the demo docs lose their tables, as expected"' in card
        _open_flow_run(page, served, flow_run_id, "Completed")
        page.get_by_text("Artifacts", exact=True).click()
        page.get_by_text("collect-gates").first.wait_for()
        shot("completed")


def test_a_tripped_data_gate_rejected_in_the_ui_fails_the_run_with_the_reason(served, browser_page, tmp_path):
    page = browser_page
    with screenshots(page, tmp_path / "screenshots", "gate-rejected") as shot:
        flow_run_id = _paused(served, ["collect.gates.max_reason_fraction=0.01"])
        _open_flow_run(page, served, flow_run_id, "Paused")
        _resume(page, approve=False, comment="too much removed for one reason", gate="max_reason_fraction")
        run = wait_finished(served, flow_run_id)
        assert run["state"]["type"] == "FAILED", served.log.read_text()[-3000:]
        assert run["state"]["message"].startswith(
            'data gate rejected by a person in the Prefect UI: "too much removed for one reason"; '
            "collect.gates.max_reason_fraction: source 'demo:python-docs', "), run["state"]["message"]
        assert _task_runs(served, flow_run_id) == ["collect [reuse]"]  # nothing trained on it
        assert _gate_record(served, flow_run_id)["outcome"] == "rejected"
        [parent] = mlflow_parents(served.home, flow_run_id)
        with sqlite3.connect(served.home / "mlflow.db") as db:
            tags = dict(db.execute("select key, value from tags where run_uuid = ?", (parent,)))
            status = db.execute("select status from runs where run_uuid = ?", (parent,)).fetchone()[0]
        assert (tags["gristmill.gates.outcome"], status) == ("rejected", "FAILED")
        assert "rejected by a person in the Prefect UI" in \
            (served.home / "reports" / parent / "report_card.md").read_text()
        _open_flow_run(page, served, flow_run_id, "Failed")
        page.get_by_text("too much removed for one reason").first.wait_for()  # the state's message
        shot("failed")
