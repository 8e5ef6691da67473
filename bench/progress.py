"""Cost of the progress display: the tiny preset's SFT stage with progress on and off.

    python -m bench progress [--steps N] [--repeats 3] [--threads 2] [--corpus DIR] [--smoke]

Inputs, built once: the tiny preset's model (configs/tiny.yaml `pretrain.model`, randomly
initialised: its weights do not change what a step costs), a byte-level BPE of the preset's
vocabulary size trained in-process on real text (`--corpus`, default ../shared/data/corpus), and
that text's token streams for `pretrain_mix`. The SFT stage (`gristmill.tasks.sft.stage.run` with the tiny
preset's `sft` section, `--steps` steps, by default the preset's) runs as the pipeline runs it: in a
Prefect task of a flow, against a real (temporary) Prefect server, inside the stage's progress
scope (flows/progress.py):

- on: stderr is a pseudo-terminal, so the console bar draws (and console log handlers write above
  it), and the stage's progress artifact is created and updated (every ARTIFACT_EVERY_S);
- off: GRISTMILL_PROGRESS=off: no bar, no artifact, the loop's log lines only.

Runs alternate (off, on, off, on, ...) so drift hits both; the stage's seconds (the scope
included: its last artifact update) are medians over `--repeats`. The difference of two medians
is within the noise of a shared machine, so the time spent inside the reporters' calls in the on
runs is measured as well (`progress_call_fraction`: seconds inside Reporter.start / advance /
close over the stage's seconds; the artifact's API calls run on a thread of their own and count
only through the first figure). The last line is one JSON object with `progress_overhead_fraction`
((on - off) / off of the medians).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from bench import smoke
from bench.harness.runs import SHARED_DATA

REPO = Path(__file__).resolve().parents[1]


def _inputs(root: Path, corpus: Path, vocab_size: int, model_config: dict) -> dict:
    """The pretrain and tokenize manifests the SFT stage reads, built under `root`."""
    import numpy as np
    import torch

    from gristmill.core.chat import DOC_SEPARATOR
    from gristmill.core.stage import Manifest
    from gristmill.model.export import export_model
    from gristmill.model.presets import ModelConfig, build_model
    from gristmill.tasks.tokenize.stage import train_tokenizer

    texts = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(corpus.rglob("*.txt"))]
    if not texts:
        raise SystemExit(f"no .txt files under {corpus}; pass --corpus or set GRISTMILL_SHARED_DATA")
    docs = [t[i : i + 4000] for t in texts for i in range(0, min(len(t), 400_000), 4000)]
    tokenizer = train_tokenizer(docs, vocab_size=vocab_size)
    torch.manual_seed(0)
    export_model(build_model(ModelConfig(**model_config), tokenizer), tokenizer, root / "pretrain" / "model")
    sep = tokenizer.convert_tokens_to_ids(DOC_SEPARATOR)
    ids = [t for doc in docs[:300] for t in [*tokenizer(doc).input_ids, sep]]
    tokens = root / "tokenize" / "tokens"
    tokens.mkdir(parents=True)
    cut = int(0.9 * len(ids))
    for split, part in (("train", ids[:cut]), ("val", ids[cut:])):
        np.asarray(part, dtype=np.uint16).tofile(tokens / f"{split}.bin")
    (tokens / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": len(tokenizer)}))
    return {stage: Manifest.of_directory(stage, root / stage) for stage in ("pretrain", "tokenize")}


@contextlib.contextmanager
def _pseudo_terminal() -> Iterator[None]:
    """stderr is a pseudo-terminal while inside (what a user's console is); its output is read
    and dropped by a thread, as a terminal would show it."""
    import fcntl
    import struct
    import termios

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # 40 rows, 120 columns
    stream = open(slave, "w", encoding="utf-8", buffering=1)  # noqa: SIM115  closed below
    stop = threading.Event()

    def drain() -> None:
        while not stop.is_set():
            try:
                os.read(master, 65536)
            except OSError:
                return

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    saved, sys.stderr = sys.stderr, stream
    try:
        yield
    finally:
        sys.stderr = saved
        stop.set()
        stream.close()
        os.close(master)


class _CallTimer:
    """Seconds spent inside Reporter.start / advance / close (wrapped while timing)."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0

    @contextlib.contextmanager
    def wrapping(self) -> Iterator[None]:
        from gristmill.core.progress import Reporter

        originals = {name: getattr(Reporter, name) for name in ("start", "advance", "close")}

        def timed(fn):
            def call(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - t0
                    self.calls += 1
            return call

        for name, fn in originals.items():
            setattr(Reporter, name, timed(fn))
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(Reporter, name, fn)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench progress", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, help="SFT steps per run (default: the tiny preset's)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    shared = SHARED_DATA
    parser.add_argument("--corpus", type=Path, default=shared / "corpus")
    args = smoke.parse(parser, argv, steps=2, repeats=1)

    scratch = Path(tempfile.mkdtemp(prefix="gristmill-bench-progress-"))
    os.environ["GRISTMILL_HOME"] = str(scratch / "home")  # before anything reads it
    from gristmill.infra import env

    env.configure()  # offline and quiet, as every entry point configures its process (flows/entry.py)
    import torch
    from prefect import flow, task
    from prefect.testing.utilities import prefect_test_harness

    import gristmill.tasks.sft.stage as sft
    from gristmill.core import progress
    from gristmill.core.stage import SerialEngine
    from gristmill.flows.config import load_config
    from gristmill.flows.progress import stage_progress

    torch.set_num_threads(args.threads)
    chosen = [f"sft.max_steps={args.steps}"] if args.steps else []
    preset = load_config(REPO / "configs" / "tiny.yaml", [*chosen, "sft.device=cpu"])
    steps = preset.sft.max_steps
    inputs = _inputs(scratch / "inputs", args.corpus, preset.tokenize.vocab_size,
                     preset.pretrain.model.model_dump())
    timer = _CallTimer()

    @task
    def stage(run: int) -> float:
        t0 = time.perf_counter()
        with stage_progress("sft"):
            sft.run(preset.sft, scratch / f"run-{run}", engine=SerialEngine(), store_mapping=None, **inputs)
        return time.perf_counter() - t0

    @flow
    def bench_flow(run: int) -> float:
        return stage(run)

    seconds: dict[str, list[float]] = {"off": [], "on": []}
    call_fractions = []
    with prefect_test_harness(server_startup_timeout=180):
        for run in range(2 * args.repeats):
            kind = "on" if run % 2 else "off"
            os.environ[progress.MODE_VAR] = kind if kind == "off" else "auto"
            timer.seconds, timer.calls = 0.0, 0
            with _pseudo_terminal() if kind == "on" else contextlib.nullcontext(), timer.wrapping():
                took = bench_flow(run)
            seconds[kind].append(took)
            if kind == "on":
                call_fractions.append(timer.seconds / took)
            calls = f"  {timer.calls} reporter calls: {timer.seconds * 1000:.1f} ms" if kind == "on" else ""
            print(f"run {run + 1}/{2 * args.repeats} progress {kind:<3}  {took:7.2f} s{calls}", flush=True)
    os.environ.pop(progress.MODE_VAR, None)

    off, on = statistics.median(seconds["off"]), statistics.median(seconds["on"])
    print(f"\ntiny SFT, {steps} steps, {args.threads} threads, median of {args.repeats}:")
    print(f"  progress off  {off:7.2f} s   {sorted(round(s, 2) for s in seconds['off'])}")
    print(f"  progress on   {on:7.2f} s   {sorted(round(s, 2) for s in seconds['on'])}")
    print(json.dumps({"steps": steps, "repeats": args.repeats, "threads": args.threads,
                      "sft_seconds_off": round(off, 3), "sft_seconds_on": round(on, 3),
                      "progress_overhead_fraction": round((on - off) / off, 4),
                      "progress_call_fraction": round(statistics.median(call_fractions), 5)}))
    return 0
