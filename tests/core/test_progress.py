"""Progress you can watch (core/progress.py, flows/progress.py): a bar on a terminal and plain log
lines without one, throttled; relayed from launched ranks; engine maps count units; the Prefect
progress artifact of a computing stage reaches 100% and never fails a stage."""
from __future__ import annotations

import io
import logging
import threading
import time

import pytest

from gristmill.core import progress
from gristmill.core.progress import PROGRESS_LINE, Relayed, Reporter, Snapshot
from gristmill.core.stage import SerialEngine

BAR_CHARACTERS = ("\r", "█", "|", "\x1b", "%|")


class FakeTerminal(io.StringIO):
    encoding = "utf-8"

    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    """A sink that keeps every snapshot."""

    def __init__(self) -> None:
        self.seen: list[Snapshot] = []

    def update(self, snapshot: Snapshot) -> None:
        self.seen.append(snapshot)


@pytest.fixture(autouse=True)
def _auto_mode(monkeypatch):
    monkeypatch.delenv(progress.MODE_VAR, raising=False)
    monkeypatch.delenv(progress.RELAY_VAR, raising=False)
    monkeypatch.setenv("TERM", "xterm")


def _logger(name: str, stream: io.StringIO) -> tuple[logging.Logger, logging.Handler, list[logging.LogRecord]]:
    """A logger with a console handler on `stream` and a second handler that keeps every record
    (as Prefect's API handler does)."""
    logger = logging.getLogger(f"gristmill.test.{name}")
    logger.handlers.clear()
    logger.propagate = False
    logger.setLevel(logging.INFO)
    console = logging.StreamHandler(stream)
    console.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    kept: list[logging.LogRecord] = []
    keeper = logging.Handler()
    keeper.emit = kept.append
    logger.addHandler(console)
    logger.addHandler(keeper)
    return logger, console, kept


def test_without_a_terminal_the_console_gets_plain_log_lines_only():
    out = io.StringIO()  # what CI or a deployment's process has: not a terminal
    logger, _, kept = _logger("plain", out)
    clock = Clock()
    with Reporter("process_unit", unit="unit", log=logger, stream=out, clock=clock, log_every_s=10) as p:
        p.start(40)
        for _ in range(40):
            clock.now += 1.0
            p.advance(1)
    text = out.getvalue()
    assert not any(c in text for c in BAR_CHARACTERS), text
    lines = text.splitlines()
    # one line every 10 s of a 40 s map, the last one at the end
    assert lines == ["INFO process_unit 10/40 units (25%), 1 unit/s, ETA 30 s",
                     "INFO process_unit 20/40 units (50%), 1 unit/s, ETA 20 s",
                     "INFO process_unit 30/40 units (75%), 1 unit/s, ETA 10 s",
                     "INFO process_unit 40/40 units (100%), 1 unit/s, in 40.0 s"], lines
    assert all(getattr(r, PROGRESS_LINE) for r in kept)


def test_on_a_terminal_a_bar_replaces_progress_lines_and_other_lines_go_above_it():
    tty = FakeTerminal()
    logger, console, kept = _logger("bar", tty)
    clock = Clock()
    with progress.scope("sft"), Reporter("train", stream=tty, clock=clock) as p:
        p.start(10)
        for step in range(1, 11):
            clock.now += 1.0
            p.advance(1, loss=1.0 / step)
            if step == 5:
                assert logger.handlers[0] is not console  # written through the bar while it shows
                logger.info("step 5/10 loss 0.2000", extra={PROGRESS_LINE: True})
                logger.warning("a checkpoint was slow")
    text = tty.getvalue()
    assert "sft: train: 100%|██████████| 10/10" in text and "loss=0.1" in text, text
    assert "5/10" in text and "\r" in text
    assert "\rWARNING a checkpoint was slow\n" in text  # the bar cleared, the line written, the bar redrawn
    assert "step 5/10" not in text  # the bar says it; the other handler keeps it
    assert [r.getMessage() for r in kept] == ["step 5/10 loss 0.2000", "a checkpoint was slow"]
    assert logger.handlers[0] is console  # given back when the bar closed


def test_updates_are_throttled_however_often_work_advances():
    tty, sink, clock = FakeTerminal(), Recorder(), Clock()
    with progress.scope("pretrain", sink), Reporter("train", stream=tty, clock=clock) as p:
        p.start(10_000)
        for _ in range(10_000):
            clock.now += 0.001  # 1000 steps a second for 10 s
            p.advance(1, loss=2.0)
    # at most one update every REFRESH_S (0.25 s), plus the first and the last
    assert 10 / progress.REFRESH_S <= len(sink.seen) <= 10 / progress.REFRESH_S + 3, len(sink.seen)
    assert tty.getvalue().count("\r") <= 10 / progress.REFRESH_S + 6
    first, last = sink.seen[0], sink.seen[-1]
    assert (first.done, first.percent, first.final) == (0, 0.0, False)
    assert (last.done, last.total, last.percent, last.final, last.what) == (10_000, 10_000, 100.0, True,
                                                                             "pretrain: train")
    assert last.rate == pytest.approx(1000, rel=0.01) and dict(last.latest) == {"loss": 2.0}


def test_off_shows_nothing_and_a_wrong_setting_names_the_variable(monkeypatch):
    tty, sink = FakeTerminal(), Recorder()
    monkeypatch.setenv(progress.MODE_VAR, "off")
    with progress.scope("sft", sink), Reporter("train", stream=tty) as p:
        p.start(3)
        p.advance(3)
    assert tty.getvalue() == "" and sink.seen == []
    monkeypatch.setenv(progress.MODE_VAR, "loud")
    with pytest.raises(ValueError, match="GRISTMILL_PROGRESS='loud'"):
        Reporter("train")


def test_a_launched_ranks_progress_is_relayed_to_its_parent(monkeypatch, capsys):
    """Rank 0 prints relay lines (its output is a pipe, no terminal); the stage's task reads them
    and its reporter, in the stage's scope, feeds the artifact; a rollback moves progress back."""
    monkeypatch.setenv(progress.RELAY_VAR, "1")
    clock = Clock()
    with Reporter("train", stream=io.StringIO(), clock=clock, refresh_s=0) as rank0:
        rank0.start(50, done=10)  # resumed at step 10
        for step in range(11, 31):
            clock.now += 1.0
            rank0.advance(1, loss=3.0 - step / 100)
        rank0.advance(-5)  # rolled back 5 steps
    lines = capsys.readouterr().out.splitlines()
    # throttled to RELAY_EVERY_S (1 s): the start, one a step (1 s each), none for the rollback at
    # the same time, and the end
    assert len(lines) == 1 + 20 + 1 and all(line.startswith(progress.RELAY_PREFIX) for line in lines), lines
    sink = Recorder()
    monkeypatch.delenv(progress.RELAY_VAR)
    with progress.scope("sft", sink), Relayed() as relayed:
        assert not relayed.feed("2026-01-01 INFO gristmill.sft: step 20/50")
        assert not relayed.feed(progress.RELAY_PREFIX + "not json")
        assert all(relayed.feed(line) for line in lines)
    assert (sink.seen[0].done, sink.seen[-1].done) == (10, 25)
    assert (sink.seen[-1].what, sink.seen[-1].total, sink.seen[-1].final) == ("sft: train", 50, True)


def test_the_stage_task_takes_progress_out_of_its_ranks_output_and_marks_their_progress_lines():
    """What flows/launch.py does with each line a launcher relays (`[rankN]:` in front): relay
    lines feed the stage's reporter, a rank's progress lines (marked by flows/launched.py's log
    format) reach the task log marked again, everything else as it came."""
    from gristmill.flows.launch import _relay

    rank_output = io.StringIO()
    handler = logging.StreamHandler(rank_output)
    handler.addFilter(progress.mark_progress_lines)
    handler.setFormatter(logging.Formatter("%(progress_mark)s%(levelname)s %(name)s: %(message)s"))
    rank_log = logging.getLogger("gristmill.test.rank")
    rank_log.handlers, rank_log.propagate = [handler], False
    rank_log.warning("step 20/50 loss 2.8000", extra={PROGRESS_LINE: True})
    rank_log.warning("saved a checkpoint")
    snapshot = Snapshot("train", "step", 20, 50, 4.0, 5.0, {"loss": 2.8})
    lines = [f"[rank0]:{progress.RELAY_PREFIX}{snapshot.to_json()}",
             *(f"[rank0]:{line}" for line in rank_output.getvalue().splitlines()), "[rank1]:rank 1 of 2 on node n"]
    task_log, _, kept = _logger("task", io.StringIO())
    sink = Recorder()
    with progress.scope("sft", sink), Relayed() as relayed:
        for line in lines:
            _relay(line, relayed, task_log)
    assert [(r.getMessage(), getattr(r, PROGRESS_LINE, False)) for r in kept] == [
        ("[rank0]:WARNING gristmill.test.rank: step 20/50 loss 2.8000", True),
        ("[rank0]:WARNING gristmill.test.rank: saved a checkpoint", False),
        ("[rank1]:rank 1 of 2 on node n", False)]
    first = sink.seen[0]
    assert (first.what, first.done, first.total, dict(first.latest)) == ("sft: train", 20, 50, {"loss": 2.8})


def test_the_serial_engine_counts_the_units_of_a_map(monkeypatch, caplog):
    def shout(word: str) -> str:
        return word.upper()

    sink = Recorder()
    monkeypatch.setattr(progress, "REFRESH_S", 0.0)
    with caplog.at_level(logging.INFO, "gristmill.map"), progress.scope("collect", sink):
        assert SerialEngine().map(shout, ["a", "b", "c"]) == ["A", "B", "C"]
    assert [(s.done, s.total) for s in sink.seen] == [(0, 3), (1, 3), (2, 3), (3, 3), (3, 3)]
    assert sink.seen[-1].final and sink.seen[-1].what == "collect: shout"
    assert [r.getMessage().split(",")[0] for r in caplog.records] == ["collect: shout 3/3 units (100%)"]


# ---------------------------------------------------------------- the Prefect progress artifact

def test_the_artifact_never_fails_or_stalls_a_stage(monkeypatch, caplog):
    """A Prefect API that refuses or hangs: the stage runs on, one warning says so, and the end
    of the stage waits at most FINISH_WAIT_S."""
    import prefect.artifacts

    from gristmill.flows import progress as flow_progress

    def refused(*args, **kwargs):
        raise ConnectionError("all connection attempts failed")

    monkeypatch.setattr(prefect.artifacts, "create_progress_artifact", refused)
    with caplog.at_level(logging.WARNING, "gristmill.progress"):
        artifact = flow_progress.StageArtifact("sft", every_s=0.01)
        with progress.scope("sft", artifact), Reporter("train", refresh_s=0) as p:
            p.start(100)
            for _ in range(100):
                p.advance(1)
                time.sleep(0.001)
        artifact.finish(ok=True)
    assert artifact.pushed == 0
    assert [r.getMessage() for r in caplog.records] == [
        "progress artifact progress-sft not updated (ConnectionError: all connection attempts failed); "
        "the stage carries on"]

    answer = threading.Event()

    def hanging_api(*args, **kwargs):
        answer.wait(60)
        raise ConnectionError("timed out")

    monkeypatch.setattr(prefect.artifacts, "create_progress_artifact", hanging_api)
    monkeypatch.setattr(flow_progress, "FINISH_WAIT_S", 0.5)
    hanging = flow_progress.StageArtifact("align")
    started = time.monotonic()
    hanging.finish(ok=True)
    assert time.monotonic() - started < 2
    answer.set()  # the API gives up: the thread ends (with the API still this test's)
    hanging._thread.join(10)
    assert not hanging._thread.is_alive() and hanging.pushed == 0


@pytest.mark.slow  # starts a Prefect server
def test_a_computing_stage_leaves_a_progress_artifact_at_100_percent(tmp_path, monkeypatch, shared_data,
                                                                     tiny_tokenizer_dir, one_torch_thread):
    """The pretrain stage computed by the pipeline's own task (flows/pipeline.run_stage) under a real
    Prefect server: its artifact `progress-pretrain` belongs to that task run, ends at 100% and
    names the loop's last step."""
    from types import SimpleNamespace

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.testing.utilities import prefect_test_harness
    from train_helpers import pretrain_config
    from transformers import AutoTokenizer

    from gristmill.flows import progress as flow_progress
    from gristmill.flows.dag import PlannedStage
    from gristmill.flows.pipeline import Runtime, run_stage
    from gristmill.flows.stages import STAGES
    from gristmill.infra.artifacts import ArtifactStore

    manifest = _tokenize_manifest(tmp_path, tiny_tokenizer_dir, shared_data, AutoTokenizer)
    monkeypatch.setattr(flow_progress, "ARTIFACT_EVERY_S", 0.5)
    spec = next(s for s in STAGES if s.name == "pretrain")
    stage = PlannedStage(spec=spec, config=pretrain_config(max_steps=20), key="progress0test", complete=False)
    tracker = SimpleNamespace(start_stage=lambda *a: "run", finish_stage=lambda *a: None, end=lambda *a, **k: None,
                              follow_metrics=lambda *a: _nothing())
    runtime = Runtime(ArtifactStore(tmp_path / "store"), tracker, "parent", config=None)

    @flow
    def one_stage():
        run_stage(stage, {"tokenize": manifest}, runtime)

    with prefect_test_harness(server_startup_timeout=180):
        state = one_stage(return_state=True)
        assert state.is_completed(), state
        with get_client(sync_client=True) as client:
            [artifact] = client.read_artifacts(artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=["progress-pretrain"])))
            [task_run] = client.read_task_runs()
    assert (artifact.type, artifact.data) == ("progress", 100.0)
    assert artifact.task_run_id == task_run.id and task_run.name.startswith("run_stage")
    assert artifact.description.startswith("pretrain: done in ")
    assert "pretrain: train 20/20 steps (100%)" in artifact.description, artifact.description


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def _tokenize_manifest(tmp_path, tiny_tokenizer_dir, shared_data, auto_tokenizer):
    from train_helpers import write_tokens

    from gristmill.core.stage import Manifest

    root = tmp_path / "tokenize"
    tokenizer = auto_tokenizer.from_pretrained(tiny_tokenizer_dir)
    tokenizer.save_pretrained(root / "tokenizer")
    texts = [p.read_text(encoding="utf-8", errors="replace")
             for p in sorted((shared_data / "corpus" / "nltk_inaugural").glob("17*.txt"))]
    write_tokens(tokenizer, {"train": texts[1:], "val": texts[:1]}, root / "tokens")
    return Manifest(stage="tokenize", key="test", path=root, config={}, upstream={}, files={}, stats={})
