"""Progress of long work, shown where the user is looking: one small reporter for every loop.

    with Reporter("train", unit="step") as progress:
        progress.start(max_steps, done=resumed_step)
        for ...:
            progress.advance(1, loss=loss)

A reporter drives, throttled, whichever of these the process has (and nothing otherwise):

- a console bar (tqdm: done of total, rate, ETA, the latest values) when stderr is a terminal that
  shows this process (not a background job). Ray workers and launched ranks write into pipes and
  files, so they never draw one. While a bar is shown, console log handlers write above it, and
  records marked as progress lines (`extra={PROGRESS_LINE: True}`: the loop's line every
  `log_every` steps) are left out of the console only: the bar says the same; the Prefect task
  log still gets them, and metrics.jsonl / MLflow keep every step;
- the sinks of the enclosing `scope` (the flow layer's Prefect progress artifact of the stage,
  flows/progress.py), each given a `Snapshot` at most every `refresh_s`;
- relay lines on stdout (RELAY_PREFIX + JSON) in a launched rank whose parent asked for them
  (RELAY_VAR): the stage's task reads them from the relayed output and feeds its own reporter
  (`Relayed`), so a stage trained in N processes shows the same bar and artifact;
- given a logger, a plain progress line every LOG_EVERY_S and one at the end (for maps, which
  have no log line of their own).

GRISTMILL_PROGRESS=off (MODE_VAR) turns off bars, artifacts and relays; log lines stay.
Cost: `advance` is a counter and a clock read; drawing happens at most every `refresh_s`, so the
display stays far below 1% of a stage's time (`python -m bench progress`, docs/benchmarks.md).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, TextIO

MODE_VAR = "GRISTMILL_PROGRESS"  # auto (default): bars on a terminal, artifacts under Prefect; off
MODES = ("auto", "off")
RELAY_VAR = "GRISTMILL_PROGRESS_RELAY"  # "1": this process's output is relayed by a parent that reads progress
RELAY_PREFIX = "gristmill-progress: "  # a relay line: this prefix, then a Snapshot as JSON
PROGRESS_LINE = "gristmill_progress_line"  # LogRecord attribute: a periodic line a console bar replaces
PROGRESS_MARK = "~ "  # in front of a launched rank's progress lines, so its parent can mark them again
REFRESH_S = 0.25  # a console bar redraws at most this often
RELAY_EVERY_S = 1.0  # relay lines at most this often
LOG_EVERY_S = 30.0  # a reporter's own log line at most this often


def mode() -> str:
    """GRISTMILL_PROGRESS: `auto` or `off`."""
    value = os.environ.get(MODE_VAR, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{MODE_VAR}={value!r}: choose one of {', '.join(MODES)}")
    return value


@dataclass(frozen=True)
class Snapshot:
    """Where a reporter stands: `done` of `total` units (total None: unknown) after `elapsed_s`."""

    what: str
    unit: str
    done: int
    total: int | None
    elapsed_s: float
    rate: float  # units per second since start
    latest: Mapping[str, float] = field(default_factory=dict)
    final: bool = False

    @property
    def percent(self) -> float:
        """0-100 (0 while the total is unknown)."""
        return 100.0 * min(self.done / self.total, 1.0) if self.total else (100.0 if self.final else 0.0)

    @property
    def eta_s(self) -> float | None:
        if not self.total or self.rate <= 0:
            return None
        return max(self.total - self.done, 0) / self.rate

    def describe(self) -> str:
        """One line: `sft: train 300/1500 steps (20%), 29.8 step/s, ETA 40 s, loss 2.3100`."""
        count = f"{self.done}/{self.total}" if self.total else str(self.done)
        parts = [f"{self.what} {count} {self.unit}s" + (f" ({self.percent:.0f}%)" if self.total else ""),
                 f"{self.rate:.3g} {self.unit}/s"]
        if self.final:
            parts.append(f"in {self.elapsed_s:.1f} s")
        elif (eta := self.eta_s) is not None:
            parts.append(f"ETA {eta:.0f} s")
        return ", ".join(parts + [f"{k} {v:.4g}" for k, v in self.latest.items()])

    def to_json(self) -> str:
        return json.dumps(asdict(self) | {"latest": dict(self.latest)})


class Sink(Protocol):
    """Receives snapshots (at most every `refresh_s`, and the last one); must be cheap and never raise."""

    def update(self, snapshot: Snapshot) -> None: ...


@dataclass(frozen=True)
class _Scope:
    stage: str
    sinks: tuple[Sink, ...]


_scope: ContextVar[_Scope | None] = ContextVar("gristmill_progress_scope", default=None)


@contextlib.contextmanager
def scope(stage: str, *sinks: Sink) -> Iterator[None]:
    """Reporters created inside (in this thread or context) carry `stage` in their label and feed `sinks`."""
    token = _scope.set(_Scope(stage, sinks))
    try:
        yield
    finally:
        _scope.reset(token)


def terminal(stream: TextIO | None = None) -> TextIO | None:
    """`stream` (default stderr) when it is a terminal that shows this process, else None."""
    stream = sys.stderr if stream is None else stream
    try:
        if stream is None or not stream.isatty() or os.environ.get("TERM") == "dumb":
            return None
    except (AttributeError, ValueError):  # closed, or no isatty
        return None
    with contextlib.suppress(OSError, AttributeError, ValueError):
        # A background job (`... &`) keeps quiet; a process in a session of its own (a supervised
        # run) has no controlling terminal (OSError): the terminal it writes to is the run's console.
        if os.tcgetpgrp(stream.fileno()) != os.getpgrp():
            return None
    return stream


class Reporter:
    """Progress of one loop: `start(total)`, `advance(n, **latest)`, `close()` (or `with`).
    `enabled=False` (e.g. every rank but the main one) reports nothing, logs included."""

    def __init__(self, what: str, unit: str = "step", *, log: logging.Logger | None = None,
                 enabled: bool = True, clock: Callable[[], float] = time.monotonic, refresh_s: float | None = None,
                 log_every_s: float | None = None, stream: TextIO | None = None):
        current = _scope.get()
        self.what = f"{current.stage}: {what}" if current else what
        self.unit, self.total, self.done, self.latest = unit, None, 0, {}
        on = enabled and mode() != "off"
        self._stream = terminal(stream) if on else None
        self._sinks = list(current.sinks) if on and current else []
        self._relay = on and self._stream is None and os.environ.get(RELAY_VAR) == "1"
        self._log = log if enabled else None
        self._clock = clock
        self._refresh_s = REFRESH_S if refresh_s is None else refresh_s
        self._log_every_s = LOG_EVERY_S if log_every_s is None else log_every_s
        self._active = bool(self._stream or self._sinks or self._relay or self._log)
        self._bar: Any = None
        self._t0 = self._next = self._next_relay = self._next_log = 0.0
        self._done0 = 0
        self._started = self._closed = False

    def start(self, total: int | None, done: int = 0) -> Reporter:
        """Begin (or begin again) at `done` of `total` units."""
        self.total, self.done, self._done0 = total, done, done
        self._t0, self._started = self._clock(), True
        self._next_log = self._t0 + self._log_every_s
        if self._stream is not None and self._bar is None:
            self._bar = _Bar(self.what, self.unit, total, done, self._stream)
        self._emit(self._t0, force=True)
        return self

    def advance(self, n: int = 1, **latest: float) -> None:
        """`n` more units done (negative after a rollback); `latest`: values to show (loss=...)."""
        self.done += n
        if latest:
            self.latest = latest
        if self._active and self._started and (now := self._clock()) >= self._next:
            self._emit(now)

    def close(self) -> None:
        """The final snapshot to every output; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._active and self._started:
            self._emit(self._clock(), final=True, force=True)
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def snapshot(self, now: float, final: bool = False) -> Snapshot:
        elapsed = max(now - self._t0, 1e-9)
        return Snapshot(self.what, self.unit, self.done, self.total, elapsed,
                        (self.done - self._done0) / elapsed, dict(self.latest), final)

    def _emit(self, now: float, final: bool = False, force: bool = False) -> None:
        self._next = now + self._refresh_s
        snap = self.snapshot(now, final)
        if self._bar is not None:
            self._bar.show(snap)
        for sink in self._sinks:
            sink.update(snap)
        if self._relay and (force or now >= self._next_relay):
            self._next_relay = now + RELAY_EVERY_S
            print(RELAY_PREFIX + snap.to_json(), file=sys.stdout, flush=True)
        # Between the start and the end, a line every log_every_s (the end has its own line).
        if self._log is not None and (final or (not force and now >= self._next_log and self.done != self.total)):
            self._next_log = now + self._log_every_s
            self._log.info("%s", snap.describe(), extra={PROGRESS_LINE: True})


class Relayed:
    """A reporter in the parent of launched ranks, fed by their relay lines (`feed`)."""

    def __init__(self) -> None:
        self.reporter: Reporter | None = None
        # Lines arrive on the relaying thread: the reporter is made in the creator's scope.
        self._context = contextvars.copy_context()

    def feed(self, text: str) -> bool:
        """Take `text` (one relayed line, rank prefix removed) if it is a relay line; whether it was."""
        if not text.startswith(RELAY_PREFIX):
            return False
        try:
            snap = json.loads(text[len(RELAY_PREFIX):])
            what, unit, done, total, latest = (snap["what"], snap["unit"], int(snap["done"]), snap["total"],
                                               {k: float(v) for k, v in snap["latest"].items()})
        except (ValueError, KeyError, TypeError, AttributeError):
            return False  # not ours after all: an ordinary line
        current = self.reporter
        if current is None or (current.what.rpartition(": ")[2], current.unit, current.total) != (what, unit, total):
            if current is not None:  # the ranks moved on to another loop (a reward model, then PPO)
                current.close()
            self.reporter = current = self._context.run(Reporter, what, unit)
            current.latest = latest
            current.start(total, done)
        current.advance(done - current.done, **latest)
        return True

    def __enter__(self) -> Relayed:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.reporter is not None:
            self.reporter.close()


def mark_progress_lines(record: logging.LogRecord) -> bool:
    """A logging filter for a launched rank's output handler: progress lines get PROGRESS_MARK in
    front (their formatter shows %(progress_mark)s first), so the parent can tell them apart."""
    record.progress_mark = PROGRESS_MARK if getattr(record, PROGRESS_LINE, False) else ""
    return True


class _Bar:
    """A tqdm bar on a terminal; while any is open, console log handlers write above the bars."""

    def __init__(self, what: str, unit: str, total: int | None, done: int, stream: TextIO):
        self.bar = _tqdm()(desc=what, unit=unit, total=total, initial=done, file=stream, mininterval=0,
                           dynamic_ncols=True, leave=True)
        with _bars.lock:
            if _bars.open == 0:
                _bars.swapped = _redirect_console_logging()
            _bars.open += 1

    def show(self, snap: Snapshot) -> None:
        self.bar.total = snap.total
        self.bar.set_postfix({k: f"{v:.4g}" for k, v in snap.latest.items()}, refresh=False)
        self.bar.update(snap.done - self.bar.n)  # draws (mininterval 0)

    def close(self) -> None:
        self.bar.close()
        with _bars.lock:
            _bars.open -= 1
            if _bars.open == 0:
                for logger, wrapper, handler in _bars.swapped:
                    if wrapper in logger.handlers:
                        logger.handlers[logger.handlers.index(wrapper)] = handler
                _bars.swapped = []


class _OpenBars:
    """How many bars this process shows, and the console handlers swapped while it shows any."""

    def __init__(self) -> None:
        self.open = 0
        self.lock = threading.Lock()
        self.swapped: list[tuple[logging.Logger, logging.Handler, logging.Handler]] = []


_bars = _OpenBars()


@functools.cache
def _tqdm() -> type:
    """tqdm, drawn only when a reporter says (`show`, throttled): without its monitor thread."""
    from tqdm import tqdm

    class Bar(tqdm):
        monitor_interval = 0

    return Bar


class _AboveTheBars(logging.Handler):
    """Stands in for a console handler while bars are shown: writes its lines through tqdm (bars
    cleared, line written, bars redrawn) and leaves out progress lines."""

    def __init__(self, inner: logging.StreamHandler):
        super().__init__(inner.level)
        self.inner = inner

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, PROGRESS_LINE, False) and bool(self.inner.filter(record))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            _tqdm().write(self.inner.format(record), file=self.inner.stream)
        except Exception:
            self.handleError(record)


def _redirect_console_logging() -> list[tuple[logging.Logger, logging.Handler, logging.Handler]]:
    """Wrap every handler that writes to a terminal (Prefect's console handler on the root logger,
    a basicConfig one) in _AboveTheBars; returns (logger, wrapper, original) to undo it."""
    loggers = [logging.getLogger(), *(lg for lg in list(logging.Logger.manager.loggerDict.values())
                                      if isinstance(lg, logging.Logger) and lg.handlers)]
    swapped = []
    for logger in loggers:
        for i, handler in enumerate(list(logger.handlers)):
            stream = getattr(handler, "stream", None)
            if isinstance(handler, logging.StreamHandler) and stream is not None and terminal(stream):
                wrapper = _AboveTheBars(handler)
                logger.handlers[i] = wrapper
                swapped.append((logger, wrapper, handler))
    return swapped
