"""The GPU check: the training stages' own code on every visible GPU of a bare machine, in minutes.

    python -m bench gpu [--steps 30] [--work DIR] [--smoke]
    python -m bench gpu --fetch-wheels [--python-version 3.12]     # where pip can download

It needs only Python >= 3.11 with torch >= 2.11, accelerate, transformers >= 5.17, tokenizers,
numpy, safetensors, pyyaml and psutil (what a bare GPU image holds), plus pydantic and its three
small dependencies, which such an image lacks: they travel as wheels in `.whl/` (git ignores it;
`--fetch-wheels` downloads them; docs/development.md#the-gpu-check). Nothing of the pipeline's
services (Prefect, Ray, MLflow) is imported: the training path must not need them.

The parts, each reported as passed or failed:
  data            a byte-level BPE tokenizer (the tokenize stage's trainer) and token shards, from
                  this repository's sources and those of Python's standard library
  pretrain_adamw  `accelerate launch` (infra/launch.py, as a training stage launches it) of the
                  pretrain stage's `run` (`python -m gristmill.tasks.pretrain`), one process per GPU, with
                  configs/gpu.yaml's pretraining: the ~125M Llama, bf16, per-block compile, fused
                  AdamW, FSDP2, tokens_per_step split into micro-batches of its batch_size
  pretrain_muon   the same with Muon
  sft             a few steps of the SFT stage's `run` on the AdamW model
  evaluate        the evaluate stage's perplexity and arithmetic on the SFT model
Without CUDA the same parts run on the CPU at toy size (2 processes over gloo, no compile): how CI
checks this entry point in a venv that holds only the packages above.

The last line is one JSON object: device, world_size, params, tokens_per_s_per_gpu and mfu (median
of the step reports after the first, which holds the compilation), peak_memory_gib, compile_s (the
first step's time beyond a compiled step's), the same for Muon, and `parts`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import yaml

from bench import smoke
from gristmill.core.gpu_image import CARRIED

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / ".whl"
TEXT_MB = {"cuda": 24, "cpu": 2}  # standard-library source text tokenized for the check
# Toy sizes for a CPU: the same parts, in about a minute on 2 cores.
CPU_PRETRAIN = {"model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 256,
                          "max_seq_len": 128},
                "seq_len": 128, "batch_size": 4, "tokens_per_step": 2 * 4 * 128, "device": "cpu", "compile": False}


def _fetch_wheels(python_version: str) -> int:
    """Download the carried wheels for a manylinux x86-64 CPython `python_version` into .whl/."""
    WHEELS.mkdir(exist_ok=True)
    for requirement in CARRIED:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--python-version", python_version, "--implementation", "cp",
                        "--platform", "manylinux_2_17_x86_64", "-d", str(WHEELS), requirement], check=True)
    print(f"{len(list(WHEELS.glob('*.whl')))} wheels in {WHEELS}")
    return 0


def _library_text(megabytes: float) -> list[str]:
    """Documents up to `megabytes`: this repository's Python and Markdown files, then the standard
    library's sources, each in path order (some images ship a trimmed standard library)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = [*sorted(REPO.glob("[!.]*/**/*.py")), *sorted(REPO.glob("docs/*.md")), *sorted(stdlib.rglob("*.py"))]
    docs, total = [], 0
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        docs.append(text)
        total += len(text.encode())
        if total >= megabytes * 2**20:
            break
    return docs


def make_tokenize_dir(out: Path, vocab_size: int, megabytes: float) -> Path:
    """A tokenize-stage output (tokenizer/ and tokens/ with meta.json) from library text; every
    20th document is val."""
    from gristmill.core.chat import DOC_SEPARATOR
    from gristmill.tasks.tokenize.stage import pack_documents, save_tokenizer, token_dtype, train_tokenizer

    docs = _library_text(megabytes)
    splits = {"train": [d for i, d in enumerate(docs) if i % 20], "val": docs[::20]}
    tokenizer = train_tokenizer(splits["train"], vocab_size=vocab_size)
    save_tokenizer(tokenizer, out / "tokenizer")
    (out / "tokens").mkdir(parents=True)
    dtype = token_dtype(len(tokenizer))
    meta: dict = {"dtype": dtype, "vocab_size": len(tokenizer)}
    separator = tokenizer.convert_tokens_to_ids(DOC_SEPARATOR)
    for split, texts in splits.items():
        ids = [encoding.ids for encoding in tokenizer.backend_tokenizer.encode_batch(texts)]
        pack_documents(ids, separator, dtype).tofile(out / "tokens" / f"{split}.bin")
        meta.update({f"{split}_tokens": sum(len(i) + 1 for i in ids), f"{split}_docs": len(texts),
                     f"{split}_bytes": sum(len(t.encode()) for t in texts)})
    (out / "tokens" / "meta.json").write_text(json.dumps(meta))
    return out


def pretrain_config(cuda: bool, steps: int, optimizer: str) -> dict:
    """configs/gpu.yaml's pretraining (toy sized on a CPU) for `steps` steps."""
    preset = yaml.safe_load((REPO / "configs" / "gpu.yaml").read_text())["pretrain"]
    keep = ("model", "seq_len", "batch_size", "tokens_per_step", "lr", "warmup_frac", "schedule", "device",
            "compile", "fsdp")
    config = {key: preset[key] for key in keep if key in preset}
    if not cuda:
        config.update(CPU_PRETRAIN)
    return {**config, "optimizer": optimizer, "max_steps": steps, "log_every": max(1, steps // 6),
            "eval_every": 0, "checkpoint_every": 10**9, "max_rollbacks": 0, "val_windows": 8}


def launch_pretrain(tokenize_dir: Path, out: Path, config: dict, processes: int, cuda: bool) -> dict:
    """The pretrain stage's ranks under `accelerate launch`, as the pipeline launches a stage; returns
    the stage's stats (summary.json) with the step reports' median tokens/s and MFU after the first."""
    from gristmill.core.launch import LaunchConfig
    from gristmill.infra.launch import accelerate_argv, run_launcher

    worker = ["-m", "gristmill.tasks.pretrain", str(tokenize_dir), str(out), "--config", json.dumps(config)]
    argv = accelerate_argv(LaunchConfig(backend="accelerate", processes=processes), worker, cuda=cuda)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if not cuda:
        env["OMP_NUM_THREADS"] = "1"
    run_launcher(argv, on_line=lambda line: print(line, file=sys.stderr), env=env, cwd=REPO)
    stats = json.loads((out / "summary.json").read_text())
    reports = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in reports if "tokens_per_s" in r][1:] or [r for r in reports if "tokens_per_s" in r]
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in timed)
    step_s = config["tokens_per_step"] / tokens_per_s
    return {**stats, "tokens_per_s": tokens_per_s, "compile_s": max(0.0, stats["first_step_s"] - step_s),
            "mfu": statistics.median(r["mfu"] for r in timed) if all("mfu" in r for r in timed) else None}


def run_sft(pretrain_dir: Path, tokenize_dir: Path, out: Path, cuda: bool) -> dict:
    """A few steps of the SFT stage (its bundled arithmetic conversations) on the pretrained model."""
    from gristmill.core.stage import Manifest, SerialEngine
    from gristmill.tasks.sft.config import Config
    from gristmill.tasks.sft.stage import run

    config = Config(max_steps=10, batch_size=8, max_seq_len=128, eval_every=0, checkpoint_every=10**9,
                    device="cuda" if cuda else "cpu", max_examples=400)
    return run(config, out, engine=SerialEngine(), store_mapping=None,
               pretrain=Manifest.of_directory("pretrain", pretrain_dir),
               tokenize=Manifest.of_directory("tokenize", tokenize_dir)).stats


def run_evaluate(model_dir: Path, tokenize_dir: Path, work: Path, cuda: bool) -> dict:
    """The evaluate stage's perplexity and arithmetic accuracy of one model."""
    from transformers import AutoTokenizer

    from gristmill.tasks.evaluate.config import Config
    from gristmill.tasks.evaluate.stage import evaluate_model, scored_text

    config = Config(seq_len=128, max_eval_tokens=32_768 if cuda else 8_192, arith_problems=20 if cuda else 5)
    scored = len(scored_text(tokenize_dir, config, AutoTokenizer.from_pretrained(tokenize_dir / "tokenizer")))
    work.mkdir(parents=True, exist_ok=True)
    return evaluate_model(model_dir, tokenize_dir, config, "cuda" if cuda else "cpu", work, {}, scored)


def _part(parts: dict[str, str], name: str, step: Callable[[], dict]) -> dict | None:
    """Run one part; record "pass", or "fail: <its last error line>"."""
    started = time.perf_counter()
    try:
        result = step()
    except Exception as error:  # a failed part is reported, and the parts that need it are skipped
        traceback.print_exc()
        parts[name] = f"fail: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        return None
    parts[name] = "pass"
    print(f"{name}: passed in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return result


def _device() -> tuple[bool, int, str]:
    import torch

    if torch.cuda.is_available():
        return True, torch.cuda.device_count(), torch.cuda.get_device_name()
    return False, 2, f"cpu ({os.cpu_count()} cores)"


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="pretraining steps per optimizer")
    parser.add_argument("--work", type=Path, help="where the parts write (default: a temporary directory)")
    parser.add_argument("--fetch-wheels", action="store_true", help="download the carried wheels into .whl/")
    parser.add_argument("--python-version", default="3.12", help="with --fetch-wheels: the GPU image's Python")
    args = smoke.parse(parser, argv, steps=2)
    if args.fetch_wheels:
        return _fetch_wheels(args.python_version)
    cuda, processes, device = _device()
    work = args.work or Path(tempfile.mkdtemp(prefix="gristmill-gpu-check-"))
    parts: dict[str, str] = {}
    tokenize_dir = _part(parts, "data", lambda: {"dir": make_tokenize_dir(
        work / "tokenize", 32000 if cuda else 1024, TEXT_MB["cuda" if cuda else "cpu"])})
    runs = {}
    for optimizer in ("adamw", "muon"):
        if tokenize_dir:
            runs[optimizer] = _part(parts, f"pretrain_{optimizer}", lambda o=optimizer: launch_pretrain(
                tokenize_dir["dir"], work / f"pretrain-{o}", pretrain_config(cuda, args.steps, o), processes, cuda))
    sft = runs.get("adamw") and _part(parts, "sft", lambda: run_sft(work / "pretrain-adamw", tokenize_dir["dir"],
                                                                    work / "sft", cuda))
    if sft:
        _part(parts, "evaluate", lambda: run_evaluate(work / "sft" / "model", tokenize_dir["dir"],
                                                     work / "evaluate", cuda))
    adamw, muon = runs.get("adamw") or {}, runs.get("muon") or {}
    world = adamw.get("world_size") or processes
    print(json.dumps({
        "bench": "gpu", "device": device, "world_size": world, "params": adamw.get("params"),
        "tokens_per_s_per_gpu": _round(adamw.get("tokens_per_s", 0) / world, 1) if adamw else None,
        "mfu": _round(adamw.get("mfu"), 4), "peak_memory_gib": _round(adamw.get("peak_memory_gib"), 2),
        "compile_s": _round(adamw.get("compile_s"), 1),
        "muon_tokens_per_s_per_gpu": _round(muon.get("tokens_per_s", 0) / world, 1) if muon else None,
        "muon_mfu": _round(muon.get("mfu"), 4), "muon_compile_s": _round(muon.get("compile_s"), 1),
        "final_train_loss": adamw.get("final_train_loss"), "parts": parts}))
    return 0 if all(verdict == "pass" for verdict in parts.values()) and len(parts) == 5 else 1
