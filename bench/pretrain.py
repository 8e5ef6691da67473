"""Training-loop throughput: our `gristmill.model.loop.train` against a minimal plain-PyTorch loop.

    python -m bench pretrain [--preset tiny] [--seq-len 256] [--batch-size 8] [--steps 30] [--repeats 3]
                             [--threads 2] [--device cpu|cuda] [--compile] [--optimizer adamw|muon] [--smoke]

Both train the same freshly seeded model on the same random-token batches with the same AdamW
(same parameter groups, fused on CUDA), LR schedule, gradient clipping, precision (bf16 autocast
on CUDA) and thread count, and read the loss every step. Runs alternate (plain, ours, plain, ...)
so drift hits both; tokens/s are medians over `--repeats`, timed from the batch of step
`--warmup-steps` to the last batch (so start-up, compilation and the final checkpoint are
excluded, per-step overhead included). `--optimizer muon` trains both with Muon; each loop's
`optimizer_step_share` is the share of its timed steps spent in the optimizer's step (timed with
torch's global optimizer hooks, the device synchronised around it): what the optimizer costs on
the machine it runs on. MFU uses 6*N + attention FLOPs per token and the GPU's
bf16 peak. Where no peak is known (a CPU), the loops' model FLOP/s are set against the best
rate a lone matrix product reaches on the same device and threads (`matmul_gflops`: products
shaped like the model's projections, and a 2048-cube), the most any training step could get.
The last line is one JSON object with `ratio_vs_plain_torch`.

    python -m bench pretrain --processes 2 [the options above]

Data parallelism: the pipeline's launch (`accelerate launch` as a training stage starts it,
infra/launch.py, of our loop) against `torchrun` of the plain loop wrapped in DistributedDataParallel,
each with 1 and with `--processes` processes (gloo on a CPU, NCCL on GPUs), one thread per process,
the same model and the same global batch (`--batch-size` sequences a step, split across the
processes). Each run is a fresh launch; tokens/s are counted over the whole global batch, timed in
rank 0 as above. The last line is one JSON object with `ratio_vs_torchrun` (ours over torchrun's at
`--processes`) and `scaling_1_to_N_processes` (ours at N over ours at 1; `torchrun_scaling_1_to_N`
for the plain loop).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench import smoke
from gristmill.core.stage import MetricsLog
from gristmill.model.checkpoint import checkpoint_place
from gristmill.model.loop import (
    LoopConfig,
    causal_lm_loss,
    make_optimizer,
    resolve_device,
    train,
)
from gristmill.model.plan import flops_per_token
from gristmill.model.presets import PRESETS, build_model
from gristmill.model.schedule import lr_multiplier
from gristmill.model.throughput import device_peak_tflops


class _Vocab:
    """What build_model needs of a tokenizer: its size and special ids."""

    def __init__(self, size: int):
        self.size, self.bos_token_id, self.eos_token_id, self.pad_token_id = size, 0, 1, 2

    def __len__(self) -> int:
        return self.size


class _OptimizerTimer:
    """(start, seconds) of each optimizer step (the outermost only: MuonAdamW steps its parts)."""

    def __init__(self, device: torch.device):
        self.device, self.depth, self.started, self.hooks = device, 0, 0.0, []
        self.steps: list[tuple[float, float]] = []

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _pre(self, *_: object) -> None:
        if self.depth == 0:
            self._sync()
            self.started = time.perf_counter()
        self.depth += 1

    def _post(self, *_: object) -> None:
        self.depth -= 1
        if self.depth == 0:
            self._sync()
            self.steps.append((self.started, time.perf_counter() - self.started))

    def share(self, start: float, end: float) -> float:
        """Share of the wall time from `start` to `end` spent in optimizer steps."""
        return sum(seconds for at, seconds in self.steps if start <= at < end) / (end - start)

    def __enter__(self) -> _OptimizerTimer:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.hooks = [register_optimizer_step_pre_hook(self._pre), register_optimizer_step_post_hook(self._post)]
        return self

    def __exit__(self, *_: object) -> None:
        for hook in self.hooks:
            hook.remove()


class _Clock:
    """get_batch wrapper that stamps when each step's batch is requested."""

    def __init__(self, batches: list[dict[str, torch.Tensor]]):
        self.batches, self.stamps = batches, {}

    def __call__(self, index: int) -> dict[str, torch.Tensor]:
        self.stamps[index] = time.perf_counter()
        return self.batches[index]

    def tokens_per_s(self, first: int, last: int, tokens_per_step: int) -> float:
        return (last - first) * tokens_per_step / (self.stamps[last] - self.stamps[first])


def _plain(model: torch.nn.Module, get_batch: Callable, cfg: LoopConfig, device: torch.device) -> None:
    """The minimal loop: forward, backward, clip, optimizer step, schedule step, read the loss."""
    # the model's own parameter groups (Muon asks the model for its embeddings), not DDP's wrapper
    optimizer = make_optimizer(model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel)
                               else model, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(
        s, cfg.max_steps, cfg.schedule, cfg.warmup_frac, cfg.decay_frac, cfg.min_lr_ratio))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    for step in range(cfg.max_steps):
        batch = {k: v.to(device, non_blocking=True) for k, v in get_batch(step).items()}
        with autocast:
            loss = causal_lm_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss.detach().item()  # a real loop logs it; our loop reads it every step too


def _run(mode: str, args: argparse.Namespace, batches: list, cfg: LoopConfig) -> tuple[float, float]:
    """One run of `mode`'s loop in this process (one rank of a launch: the plain loop wrapped in
    DistributedDataParallel on its rows of each global batch; ours shards the batch itself):
    (tokens/s, share of the whole run's wall time in optimizer steps)."""
    torch.manual_seed(0)
    model = build_model(PRESETS[args.preset], _Vocab(args.vocab_size))
    clock = _Clock(batches)
    device = resolve_device(cfg.device)
    timer = _OptimizerTimer(device).__enter__()
    if mode == "plain":
        model.to(device).train()
        if args.compile:
            model.compile()
        if torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
            clock = _Clock([{k: v[rank::world] for k, v in b.items()} for b in batches])
            model = torch.nn.parallel.DistributedDataParallel(model)
        _plain(model, clock, cfg, device)
    elif args.work:  # one rank of a launch: every rank writes its share of a checkpoint where rank 0 does
        train(model, clock, cfg, checkpoint_place(args.work, None), MetricsLog(args.work))
    else:
        with tempfile.TemporaryDirectory() as work:
            train(model, clock, cfg, checkpoint_place(Path(work), None), MetricsLog(Path(work)))
    if device.type == "cuda":
        torch.cuda.synchronize()
    timer.__exit__()
    window = clock.stamps[args.warmup_steps], clock.stamps[args.steps - 1]
    return clock.tokens_per_s(args.warmup_steps, args.steps - 1, args.batch_size * args.seq_len), timer.share(*window)


def _launched(mode: str, processes: int, argv: list[str], args: argparse.Namespace) -> float:
    """Global tokens/s of `mode` launched as `processes` processes: ours as a training stage
    launches it, the plain loop under torchrun."""
    from gristmill.core.launch import LaunchConfig
    from gristmill.infra.launch import accelerate_argv

    with tempfile.TemporaryDirectory() as work:  # one folder for all ranks, as a stage's launch shares its own
        worker = ["-m", "bench", "pretrain", *argv, "--rank-of", mode, "--work", work]
        if mode == "ours":
            command = accelerate_argv(LaunchConfig(backend="accelerate", processes=processes), worker,
                                      cuda=args.device == "cuda")
        else:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                       str(processes), *worker]
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    said = [line.split('{"rank_tokens_per_s"', 1)[1] for line in done.stdout.splitlines()
            if '{"rank_tokens_per_s"' in line]
    if done.returncode or not said:
        raise SystemExit(f"{mode} with {processes} processes failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads('{"rank_tokens_per_s"' + said[0])["rank_tokens_per_s"]


def _data_parallel(args: argparse.Namespace, argv: list[str]) -> int:
    """`--processes N`: ours and torchrun's plain loop at 1 and N processes, alternating."""
    n = args.processes
    runs = {(mode, p): [] for p in (1, n) for mode in ("plain", "ours")}
    for _ in range(args.repeats):
        for mode, processes in runs:
            runs[mode, processes].append(_launched(mode, processes, argv, args))
    tok_s = {key: statistics.median(values) for key, values in runs.items()}
    print(f"{'loop':<10}{'processes':>10}{'tokens/s (median)':>20}{'runs':>40}")
    for (mode, processes), values in runs.items():
        name = "torchrun" if mode == "plain" else "ours"
        print(f"{name:<10}{processes:>10}{tok_s[mode, processes]:>20,.0f}{' '.join(f'{v:,.0f}' for v in values):>40}")
    print(json.dumps({"bench": "pretrain", "processes": n, "preset": args.preset, "device": args.device,
                      "batch_size": args.batch_size, "seq_len": args.seq_len, "steps": args.steps,
                      "repeats": args.repeats, "tokens_per_s_ours": round(tok_s["ours", n], 1),
                      "tokens_per_s_torchrun": round(tok_s["plain", n], 1),
                      "ratio_vs_torchrun": round(tok_s["ours", n] / tok_s["plain", n], 4),
                      f"scaling_1_to_{n}_processes": round(tok_s["ours", n] / tok_s["ours", 1], 4),
                      f"torchrun_scaling_1_to_{n}": round(tok_s["plain", n] / tok_s["plain", 1], 4)}))
    return 0


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench pretrain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=list(PRESETS))
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup-steps", type=int, default=5, help="steps not timed (allocator, compile)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--compile", action="store_true", help="torch.compile the model in both loops")
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"], help="both loops' optimizer")
    parser.add_argument("--processes", type=int, default=1, help="data-parallel: ours launched as a stage "
                                                                  "launches it against torchrun, 1 and N processes")
    parser.add_argument("--rank-of", choices=["ours", "plain"], help=argparse.SUPPRESS)  # one rank of a launch
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)  # the launch's folder, shared by its ranks
    args = smoke.parse(parser, argv, steps=3, warmup_steps=0, repeats=1, seq_len=16, batch_size=2, vocab_size=256)
    if not 0 <= args.warmup_steps < args.steps - 1:
        parser.error("--warmup-steps must be below --steps - 1")
    return args


def matmul_gflops(preset: str, tokens: int, vocab_size: int, device: torch.device, repeats: int = 7) -> float:
    """GFLOP/s of the fastest fp32 product among the model's projection shapes and a 2048-cube
    (median of `repeats` after warm-up)."""
    cfg = PRESETS[preset]
    h, ffn = cfg.hidden_size, cfg.intermediate_size
    best = 0.0
    for m, k, n in ((tokens, h, vocab_size), (tokens, h, ffn), (tokens, ffn, h), (2048, 2048, 2048)):
        a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
        seconds = []
        for i in range(repeats + 2):
            started = time.perf_counter()
            a @ b
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 2:
                seconds.append(time.perf_counter() - started)
        best = max(best, 2 * m * k * n / statistics.median(seconds) / 1e9)
    return best


def main(argv: list[str]) -> int:
    args = _parse(argv)
    if args.processes > 1 and args.rank_of is None:
        return _data_parallel(args, argv)  # each rank is told --rank-of, so it ignores --processes
    torch.set_num_threads(1 if args.rank_of else args.threads)
    logging.getLogger("gristmill").setLevel(logging.WARNING)
    # No periodic checkpoints, logs or evals inside the timed window; no rollback target at step 0.
    cfg = LoopConfig(max_steps=args.steps, batch_size=args.batch_size, device=args.device, compile=args.compile,
                     optimizer=args.optimizer,
                     checkpoint_every=10**9, log_every=10**9, eval_every=0, max_rollbacks=0)
    gen = torch.Generator().manual_seed(0)
    windows = [torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen)
               for _ in range(args.steps)]
    batches = [{"input_ids": w[:, :-1], "labels": w[:, 1:]} for w in windows]
    if args.rank_of:
        if args.rank_of == "plain" and "RANK" in os.environ:
            if args.device == "cuda":
                torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            torch.distributed.init_process_group("nccl" if args.device == "cuda" else "gloo")
        tokens_per_s, _ = _run(args.rank_of, args, batches, cfg)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps({"rank_tokens_per_s": tokens_per_s}), flush=True)
        return 0
    results: dict[str, list[float]] = {"plain": [], "ours": []}
    shares: dict[str, list[float]] = {"plain": [], "ours": []}
    for _ in range(args.repeats):
        for mode in results:
            tokens_per_s, share = _run(mode, args, batches, cfg)
            results[mode].append(tokens_per_s)
            shares[mode].append(share)
    tok_s = {mode: statistics.median(values) for mode, values in results.items()}
    share = {mode: statistics.median(values) for mode, values in shares.items()}
    fpt = flops_per_token(PRESETS[args.preset], args.vocab_size, args.seq_len)
    peak = device_peak_tflops(cfg.peak_tflops, resolve_device(args.device))
    mfus = {mode: tok_s[mode] * fpt / (peak * 1e12) if peak else None for mode in tok_s}
    matmul = None if peak else matmul_gflops(args.preset, args.batch_size * args.seq_len, args.vocab_size,
                                             resolve_device(args.device))
    print(f"{'loop':<8}{'tokens/s (median)':>20}{'runs':>40}{'MFU':>8}{'optimizer':>11}")
    for mode, values in results.items():
        runs = " ".join(f"{v:,.0f}" for v in values)
        print(f"{mode:<8}{tok_s[mode]:>20,.0f}{runs:>40}{'' if mfus[mode] is None else f'{mfus[mode]:.1%}':>8}"
              f"{share[mode]:>11.1%}")
    if matmul:
        print(f"model GFLOP/s, ours {tok_s['ours'] * fpt / 1e9:.1f}, plain {tok_s['plain'] * fpt / 1e9:.1f}; "
              f"fastest lone matrix product {matmul:.1f} GFLOP/s")
    print(json.dumps({"bench": "pretrain", "preset": args.preset, "device": args.device, "compile": args.compile,
                      "threads": args.threads, "batch_size": args.batch_size, "seq_len": args.seq_len,
                      "steps": args.steps, "repeats": args.repeats, "optimizer": args.optimizer,
                      "tokens_per_s_ours": round(tok_s["ours"], 1), "tokens_per_s_plain": round(tok_s["plain"], 1),
                      "optimizer_step_share": round(share["ours"], 4),
                      "optimizer_step_share_plain": round(share["plain"], 4),
                      "ratio_vs_plain_torch": round(tok_s["ours"] / tok_s["plain"], 4),
                      "mfu_ours": mfus["ours"], "mfu_plain": mfus["plain"], "flops_per_token": fpt,
                      "gflops_ours": round(tok_s["ours"] * fpt / 1e9, 1),
                      "matmul_gflops": None if matmul is None else round(matmul, 1)}))
    return 0
