"""The sharded path is the tested path: FSDP2 over gloo on CPU, the code GPUs run over NCCL.

2 processes (torchrun) of `python -m gristmill.tasks.pretrain` with `fsdp: true` against the same with
replicas (DDP): the same curve, the same exported model; each rank holds only its shard; a rank
killed after a checkpoint resumes to the uninterrupted curve, also on another number of
processes; the optimizer's step count is the loop's.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from train_helpers import CONFIG, REPO
from transformers import AutoModelForCausalLM

from gristmill.core.stage import read_metrics

STEPS = 20
# 8 sequences of 32 tokens a step, whatever the process count: 2 processes run one micro-batch of
# 4 each, 1 process two.
FSDP_CONFIG = {**CONFIG, "max_steps": STEPS, "checkpoint_every": 5, "eval_every": 10, "log_every": 5,
               "batch_size": 4, "tokens_per_step": 8 * 32}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
SINGLE = [sys.executable]
# Muon orthogonalises each whole matrix: from a replica's all-reduced gradient, or from a shard
# gathered after a reduce-scatter. Reduction order is the only difference between the two; with
# two ranks a sum of two gradients has one order, and the curves came out identical (relative
# difference 0.0 in every loss and val loss, AdamW and Muon, the `runs` below at seeds 0, 1 and 2;
# docs/benchmarks.md#fsdp-on-cpu). The bound leaves room for the orders more ranks would take.
MUON_REL = 1e-5


def _run(launcher: list[str], tokenize_dir: Path, out_dir: Path, fault: str | None = None,
         **overrides) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("GRISTMILL_FAULT", None)
    if fault:
        env["GRISTMILL_FAULT"] = fault
    cmd = [*launcher, "-m", "gristmill.tasks.pretrain", str(tokenize_dir), str(out_dir),
           "--config", json.dumps({**FSDP_CONFIG, **overrides})]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _train(launcher: list[str], tokenize_dir: Path, out_dir: Path, **overrides) -> list[dict]:
    done = _run(launcher, tokenize_dir, out_dir, **overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    return read_metrics(out_dir / "metrics.jsonl")


def _losses(rows: list[dict], key: str = "loss") -> list[float]:
    return [r[key] for r in rows if key in r]


@pytest.fixture(scope="module")
def runs(tokenize_dir, tmp_path_factory) -> dict[str, Path]:
    """Uninterrupted 2-process runs, shared by the tests below: replicated and sharded, AdamW and Muon."""
    root = tmp_path_factory.mktemp("fsdp-runs")
    for name, overrides in {"ddp": {}, "fsdp": {"fsdp": True}, "ddp-muon": {"optimizer": "muon"},
                            "fsdp-muon": {"fsdp": True, "optimizer": "muon"}}.items():
        _train(TORCHRUN, tokenize_dir, root / name, **overrides)
    return {name: root / name for name in ("ddp", "fsdp", "ddp-muon", "fsdp-muon")}


SHARD_PROBE = textwrap.dedent('''
    import json, os, sys
    import torch, torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM
    from gristmill.core.launch import PRECISION_VAR
    from gristmill.model.config import LoopConfig
    from gristmill.model.loop import _prepare
    from gristmill.model.parallel import decoder_blocks

    # Record the dtypes FSDP's collectives move (their names differ between torch releases).
    reduced, gathered = [], []
    def recording(name, seen):
        real = getattr(dist, name)
        def collective(output, input, *args, **kwargs):
            seen.append(str(input.dtype))
            return real(output, input, *args, **kwargs)
        setattr(dist, name, collective)
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        if hasattr(dist, name):
            recording(name, reduced)
    for name in ("all_gather_single", "all_gather_into_tensor"):
        if hasattr(dist, name):
            recording(name, gathered)

    def probe(precision):
        # a launcher hands the ranks its precision in this variable, read when the model is prepared
        os.environ[PRECISION_VAR] = precision
        reduced.clear()
        gathered.clear()
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                             tie_word_embeddings=True))
        full = {n: p.numel() for n, p in model.named_parameters() if p.dim() == 2 and ".layers." in n}
        parts = _prepare(model, LoopConfig(fsdp=True, device="cpu"))
        local = {n: p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                 for n, p in parts.model.named_parameters() if n in full}
        ids = torch.randint(0, 64, (2, 8))
        parts.model(input_ids=ids, labels=ids).loss.backward()
        return {"rank": dist.get_rank(), "full": full, "local": local, "reduced": sorted(set(reduced)),
                "gathered": sorted(set(gathered)), "blocks": len(decoder_blocks(parts.model))}

    reports = {precision: probe(precision) for precision in sys.argv[2:]}
    with open(f"{sys.argv[1]}/rank{dist.get_rank()}.json", "w") as out:
        json.dump(reports, out)
    dist.destroy_process_group()
''')


def _probe(tmp_path: Path, *precisions: str) -> dict[str, list[dict]]:
    """Each rank's report of a sharded model prepared with each of `precisions` in turn (one
    launch: most of its time is the ranks' start), by precision."""
    script, reports = tmp_path / "probe.py", tmp_path / "reports"
    script.write_text(SHARD_PROBE)
    reports.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*TORCHRUN, str(script), str(reports), *precisions], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads(path.read_text()) for path in sorted(reports.glob("rank*.json"))]
    return {precision: [rank[precision] for rank in ranks] for precision in precisions}


def test_each_rank_holds_only_its_shard_and_bf16_reduces_gradients_in_fp32(tmp_path):
    probed = _probe(tmp_path, "bf16", "no")
    reports = probed["bf16"]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for report in reports:
        assert report["full"] and report["local"].keys() == report["full"].keys()
        # A replica (a silent fall-back to DDP) would hold every matrix whole.
        assert all(report["local"][n] * 2 == report["full"][n] for n in report["full"]), report
        assert report["gathered"] == ["torch.bfloat16"]  # weights gathered for bf16 compute
        assert report["reduced"] == ["torch.float32"]  # gradients reduced in fp32
    assert all(r["gathered"] == ["torch.float32"] == r["reduced"] for r in probed["no"])


def test_fsdp_trains_ddps_curve_and_exports_the_same_model(runs, tokenize_dir):
    ddp, fsdp = (read_metrics(runs[name] / "metrics.jsonl") for name in ("ddp", "fsdp"))
    assert [r["step"] for r in fsdp] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "val_loss"):
        assert _losses(fsdp, key) == pytest.approx(_losses(ddp, key), rel=1e-4), key
    assert _losses(ddp) != pytest.approx(_losses(ddp)[:1] * STEPS, rel=1e-3)  # the curve moves
    models = [AutoModelForCausalLM.from_pretrained(runs[name] / "model") for name in ("ddp", "fsdp")]
    ids = torch.arange(40).reshape(2, 20) % models[0].config.vocab_size
    with torch.no_grad():
        logits = [m(input_ids=ids).logits for m in models]
    assert torch.allclose(logits[0], logits[1], atol=1e-4, rtol=0)


def test_muon_under_fsdp_stays_within_reduction_order_of_ddp(runs):
    ddp, fsdp = (read_metrics(runs[name] / "metrics.jsonl") for name in ("ddp-muon", "fsdp-muon"))
    assert _losses(fsdp) == pytest.approx(_losses(ddp), rel=MUON_REL)
    assert _losses(fsdp, "val_loss") == pytest.approx(_losses(ddp, "val_loss"), rel=MUON_REL)


@pytest.fixture(scope="module")
def killed_at_10(tokenize_dir, tmp_path_factory) -> Callable[[list[str], str, Path], Path]:
    """`killed_at_10(launcher, optimizer, into)`: `into`, a copy of the folder of an FSDP run on
    `launcher`'s processes with `optimizer`, killed (-9) right after its step-10 checkpoint. Each
    kind of killed run is made once: the tests below resume copies of the same ones."""
    made: dict[tuple[str, str], Path] = {}

    def killed(launcher: list[str], optimizer: str, into: Path) -> Path:
        kind = (" ".join(launcher), optimizer)
        if kind not in made:
            out = tmp_path_factory.mktemp("killed") / "out"
            done = _run(launcher, tokenize_dir, out, fault="checkpoint:10", fsdp=True, optimizer=optimizer)
            assert done.returncode != 0 and (launcher is SINGLE or "SIGKILL" in done.stderr), done.stderr[-3000:]
            made[kind] = out
        shutil.copytree(made[kind], into)
        return into

    return killed


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_rank_killed_after_a_checkpoint_resumes_to_the_uninterrupted_curve(runs, killed_at_10, tokenize_dir,
                                                                          tmp_path, optimizer):
    out = killed_at_10(TORCHRUN, optimizer, tmp_path / "killed")
    saved = torch.load(out / "checkpoints" / "step-0000010" / "optimizer.pt", weights_only=True)
    steps = {float(s["step"]) for s in saved["state"].values() if "step" in s}
    assert steps == {10.0}  # AdamW's count is the loop's: no extra step at the step-0 checkpoint
    resumed = _train(TORCHRUN, tokenize_dir, out, fsdp=True, optimizer=optimizer)
    reference = read_metrics(runs["fsdp" if optimizer == "adamw" else "fsdp-muon"] / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert _losses(resumed) == pytest.approx(_losses(reference), rel=1e-4)
    assert _losses(resumed, "val_loss") == pytest.approx(_losses(reference, "val_loss"), rel=1e-4)


@pytest.mark.parametrize(("first", "then"), [(TORCHRUN, SINGLE), (SINGLE, TORCHRUN)], ids=["2-to-1", "1-to-2"])
def test_a_run_resumes_on_another_number_of_processes(runs, killed_at_10, tokenize_dir, tmp_path, first, then):
    out = killed_at_10(first, "adamw", tmp_path / "moved")
    resumed = _train(then, tokenize_dir, out, fsdp=True, optimizer="adamw")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == 10 and summary["world_size"] == (1 if then is SINGLE else 2)
    reference = read_metrics(runs["fsdp"] / "metrics.jsonl")
    assert _losses(resumed) == pytest.approx(_losses(reference), rel=1e-4)


def test_another_global_batch_is_refused_at_resume(tokenize_dir, tmp_path):
    out = tmp_path / "batch"
    assert _run(SINGLE, tokenize_dir, out, fault="checkpoint:5").returncode != 0
    refused = _run(SINGLE, tokenize_dir, out, tokens_per_step=16 * 32)
    assert refused.returncode != 0
    assert "trained 8 sequences per step and this run 16: keep tokens_per_step" in refused.stderr
    assert (out / "checkpoints" / "step-0000005").is_dir()  # nothing computed is lost
