"""Training stages launched as several processes from the DAG (`<stage>.launch`, core/launch.py):
Accelerate's launcher started and supervised by the stage (2 ranks over gloo), a rank killed and
the stage resumed, from a folder whose own `model.py` and `tasks/` no process may import; the
per-node command of a cluster without Ray (two machine ranks on this machine), no checkpoint left
in the folder a launched stage commits, and launches that cannot start refused at plan time."""
from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from pipeline_helpers import (
    REPO,
    TinyRun,
    checkpoint_steps,
    cli_env,
    committed_dir,
    committed_files,
    gristmill,
    manifest_files,
)
from pydantic import ValidationError

from gristmill.core.launch import LaunchConfig, launch_problems
from gristmill.core.stage import read_metrics
from gristmill.infra.launch import free_port
from gristmill.infra.processes import alive

TWO = ["pretrain.launch.backend=accelerate", "pretrain.launch.processes=2",
       "sft.launch.backend=accelerate", "sft.launch.processes=2"]


def _same_training(home: Path, reference: TinyRun, stage: str, held_out: str = "val_loss") -> None:
    """The stage's loss curve and held-out loss equal the shared run's up to reduction order.
    The preset pretrains with Muon, whose Newton-Schulz iteration amplifies the last bits of the
    all-reduced gradient: when it ran in bfloat16 that moved the 60-step curve by up to 8.7e-4
    (1.3e-4 relative, measured), and every later stage starts from that model; ranks that saw the
    wrong data would differ by far more. With AdamW pretraining the curves agree within 1e-4."""
    ours, theirs = (read_metrics(artifact / "metrics.jsonl")
                    for artifact in (committed_dir(home, stage), reference.committed[stage]))
    assert [r["step"] for r in ours] == [r["step"] for r in theirs]
    pretrain = json.loads((reference.committed["pretrain"] / "manifest.json").read_text())
    muon = pretrain["config"].get("optimizer") == "muon"
    for key in ("loss", held_out):
        expected = [r[key] for r in theirs if key in r]
        close = pytest.approx(expected, rel=1e-3) if muon else pytest.approx(expected, abs=1e-4)
        assert expected and [r[key] for r in ours if key in r] == close, key


def _resumed_to_the_shared_result(text: str, home: Path, shared: TinyRun, killed_at: int,
                                  launch: dict[str, object]) -> None:
    """The re-run's output `text` says it resumed from a checkpoint at least as new as the one the
    kill left; its committed pretrain artifact records `launch`, has the shared run's key, and
    trained the shared run's curve."""
    assert "resuming from step" in text, text[-3000:]
    step = int(text.split("resuming from step", 1)[1].split()[0].strip(".,:"))
    pretrain = json.loads((committed_dir(home, "pretrain") / "manifest.json").read_text())
    assert step >= killed_at and pretrain["stats"]["resumed_from_step"] == step
    assert pretrain["meta"]["launch"] == launch
    assert pretrain["key"] == shared.committed["pretrain"].name.split("-", 1)[1]
    _same_training(home, shared, "pretrain")


def _ranks(pid: int) -> dict[int, psutil.Process]:
    """RANK -> process of the Accelerate-launched ranks under `pid`."""
    ranks = {}
    for proc in psutil.Process(pid).children(recursive=True):
        try:
            if "gristmill.flows.launched" in proc.cmdline():
                ranks[int(proc.environ()["RANK"])] = proc
        except (psutil.Error, KeyError):
            continue
    return ranks


# The names our packages had before they lived under gristmill.* (the repository's top-level
# folders): a run's processes start with their working directory first on sys.path (`python -m`),
# and Ray's workers put the driver's there too, so any import of these names would find the decoys.
DECOYS = ("model.py", "tasks/__init__.py", "core/__init__.py", "flows/__init__.py", "infra/__init__.py")
DECOY = """import os, pathlib, sys
pathlib.Path({marker!r}, f"{name}-{{os.getpid()}}").write_text(" ".join(sys.argv))
raise ImportError("the decoy {name} of " + {folder!r} + " was imported")
"""


def _decoy_folder(folder: Path) -> tuple[Path, Path]:
    """`folder` holding the DECOYS, each of which, imported, records the importing process's command
    line in a file of the returned marker folder (empty while none was) and raises."""
    marker = folder.parent / f"{folder.name}-imported"
    marker.mkdir(parents=True)
    for decoy in DECOYS:
        path = folder / decoy
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(DECOY.format(marker=str(marker), name=decoy.split("/")[0].removesuffix(".py"),
                                     folder=str(folder)))
    return folder, marker


def _start_and_await_a_checkpoint(args: list[str], home: Path, env: dict[str, str],
                                  ranks: Callable[[subprocess.Popen], dict[int, psutil.Process]],
                                  cwd: Path = REPO) -> tuple[subprocess.Popen, dict[int, psutil.Process]]:
    """`args` started in `cwd`, once a checkpoint newer than those in `home` is written: the run and its ranks."""
    before = max(checkpoint_steps(home), default=0)
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while max(checkpoint_steps(home), default=0) <= before and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.5)
    found = ranks(proc)
    assert sorted(found) == [0, 1]
    return proc, found


def _stops_on(signum: signal.Signals, proc: subprocess.Popen, ranks: dict[int, psutil.Process]) -> None:
    """Ctrl-C (SIGINT) or SIGTERM: the run, its launcher and every rank are gone within 10 s."""
    proc.send_signal(signum)
    stopped = time.monotonic()
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum and time.monotonic() - stopped < 10
    while alive(ranks.values()) and time.monotonic() - stopped < 10:
        time.sleep(0.2)
    assert alive(ranks.values()) == []


@pytest.mark.slow
def test_ranks_train_as_one_process_does_resume_after_a_kill_and_commit_by_hand(tiny_run, prefect_server, tmp_path):
    """Against the shared (inline, one-process) run, in a home holding its collect:

    1. tokenize (on Ray), then pretrain with 2 Accelerate processes from the DAG: Ctrl-C after a
       checkpoint stops the run, the launcher and both ranks within 10 s; the next run resumes,
       and rank 1 is killed (-9) after a newer checkpoint: the stage fails with one line naming
       the rank;
    2. the re-run resumes from the checkpoint; the loss curve and validation loss are the shared
       run's within 1e-4, under the same key, and the manifest records the launch. These runs
       start in a folder holding its own `model.py` and `tasks/` (DECOYS): no process of theirs,
       the CLI's, its pipeline child, a Ray worker or a rank, imports one;
    3. SFT by hand on a cluster without Ray, sharded: the per-node command `--dry-run` prints, as
       two machine ranks on this machine (gloo, one process each) with `sft.fsdp=true`, trains the
       shared run's SFT curve, exports the gathered model and commits what the pipeline then reuses."""
    home = tiny_run.home_with(tmp_path / "home", ("collect",))
    elsewhere, imported = _decoy_folder(tmp_path / "elsewhere")
    two = ["pretrain.launch.backend=accelerate", "pretrain.launch.processes=2"]
    run = [sys.executable, "-m", "gristmill", "run", str(REPO / "configs" / "tiny.yaml"), *tiny_run.overrides, *two]
    args = [*run, "pretrain.checkpoint_every=20", "--until", "pretrain"]

    def start_and_await_a_checkpoint() -> tuple[subprocess.Popen, dict[int, psutil.Process]]:
        return _start_and_await_a_checkpoint(args, home, cli_env(home, prefect_server), lambda proc: _ranks(proc.pid),
                                             cwd=elsewhere)

    _stops_on(signal.SIGINT, *start_and_await_a_checkpoint())
    assert committed_files(home, "tokenize") == manifest_files(tiny_run.committed["tokenize"])
    tokenized = json.loads((committed_dir(home, "tokenize") / "manifest.json").read_text())
    assert tokenized["stats"]["units_per_node"]  # its shards were encoded by Ray's workers, here
    proc, ranks = start_and_await_a_checkpoint()  # a rank killed: the stage fails in one line
    killed_at = max(checkpoint_steps(home))
    ranks[1].kill()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "gristmill: rank 1: killed by SIGKILL" in err.splitlines(), err[-3000:]
    assert "[rank0]:" in out + err and "[rank1]:" in out + err  # every rank's lines, prefixed
    assert "resuming from step" in out + err  # from the checkpoint the Ctrl-C left
    assert not list((home / "artifacts" / "pretrain").glob("*/manifest.json"))

    rerun = subprocess.run([*run, "--until", "pretrain"], cwd=elsewhere, env=cli_env(home, prefect_server),
                           capture_output=True, text=True, timeout=1200)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-5000:]
    _resumed_to_the_shared_result(rerun.stdout + rerun.stderr, home, tiny_run, killed_at,
                                  {"backend": "accelerate", "processes": 2, "nodes": 1, "world_size": 2})
    assert {path.name: path.read_text() for path in imported.iterdir()} == {}

    # SFT from the shared run's own pretrained weights, so its curve can be compared step by step.
    home = tiny_run.home_with(tmp_path / "sft-home", ("collect", "tokenize", "pretrain"))
    by_hand = ["sft.launch.backend=accelerate", "sft.launch.processes=1", "sft.launch.nodes=2", "sft.fsdp=true"]
    planned = subprocess.run([sys.executable, "-m", "gristmill", "run", "configs/tiny.yaml", *tiny_run.overrides,
                              *by_hand, "--until", "sft", "--dry-run"], cwd=REPO, env=cli_env(home),
                             capture_output=True, text=True, timeout=300)
    assert planned.returncode == 2 and "sft.launch.nodes: 2 with backend accelerate" in planned.stderr
    key = next(line.split()[1] for line in planned.stdout.splitlines() if line.startswith("sft "))
    command = planned.stdout.split(f"# sft-{key} without Ray", 1)[1].splitlines()[1]
    port = str(free_port())
    nodes = []
    for rank in ("0", "1"):
        argv = [a.replace("NODE_RANK", rank).replace("HEAD_IP", "127.0.0.1").replace("29500", port)
                for a in shlex.split(command)]
        assert argv[:2] == ["accelerate", "launch"]
        nodes.append(subprocess.Popen([sys.executable, "-m", "accelerate.commands.launch", *argv[2:]], cwd=REPO,
                                      env=cli_env(home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    sft = json.loads((home / "artifacts" / "sft" / f"sft-{key}" / "manifest.json").read_text())
    assert sft["meta"]["launch"] == {"backend": "accelerate", "processes": 1, "nodes": 2, "world_size": 2}
    assert sft["stats"]["world_size"] == 2 and sft["stats"]["steps"] == 30
    # Ranks hold different numbers of assistant tokens; each one's loss is its share of the global
    # batch's mean, so the curve is the one-process run's.
    _same_training(home, tiny_run, "sft", held_out="heldout_loss")
    exported = home / "artifacts" / "sft" / f"sft-{key}" / "model" / "model.safetensors"
    assert exported.stat().st_size == (tiny_run.committed["sft"] / "model" / "model.safetensors").stat().st_size
    log = gristmill(home, "run", "configs/tiny.yaml", *tiny_run.overrides, "--until", "sft", services=prefect_server)
    assert "sft: reused" in log.stdout + log.stderr


def test_a_launched_stage_keeps_no_checkpoint_a_rank_beside_the_driver_left(tmp_path, monkeypatch):
    """Ray Train across nodes that share only the bucket (its launcher a stand-in here): rank 0
    removes the checkpoints once the stage's outputs are exported, and a rank that ran on the
    driver's node has left what it wrote of them in the stage's partial folder there (its share of
    a Trainer checkpoint, a view of the bucket's). Once the launch has succeeded the folder the
    stage commits holds none of it."""
    import gristmill.flows.launch as launch_flow
    from gristmill.flows.config import load_config
    from gristmill.flows.dag import open_store, plan

    config = load_config(REPO / "configs" / "tiny.yaml", ["align.launch.backend=accelerate",
                                                          "align.launch.processes=2"])
    stage = plan(config, open_store(config, tmp_path / "home"), until="align")[-1]
    partial = tmp_path / "align.partial"
    left = [partial / "checkpoints" / "checkpoint-10" / "rng_state_1.pth",
            partial / "checkpoints" / "step-0000020.view-4242" / "model.safetensors"]

    def ranks(argv, *, on_line, env, cwd=None) -> None:
        for path in [*left, partial / "model" / "model.safetensors"]:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"weights")
        result = Path(argv[argv.index("--result") + 1])
        result.write_text(json.dumps({"stats": {"steps": 10}, "artifacts": [], "measured": {}, "uploaded": []}))

    monkeypatch.setattr(launch_flow, "run_launcher", ranks)
    result = launch_flow.launched(stage, config, partial, logging.getLogger("test"))
    assert result.stats == {"steps": 10}
    kept = [path.relative_to(partial).as_posix() for path in partial.rglob("*") if path.is_file()]
    assert kept == ["model/model.safetensors"]


def test_launches_that_cannot_start_are_refused_with_the_key_to_change():
    cores = os.cpu_count() or 1
    many = LaunchConfig(backend="accelerate", processes=cores + 1)
    assert launch_problems("pretrain.launch", many, "cpu") == [
        f"pretrain.launch.processes: {cores + 1} is more than this machine's {cores} CPU cores; set "
        f"pretrain.launch.processes to at most {cores}"]
    (nodes,) = launch_problems("sft.launch", LaunchConfig(backend="accelerate", nodes=2), "cpu")
    assert nodes.startswith("sft.launch.nodes: 2 with backend accelerate") and "--dry-run" in nodes
    (missing,) = launch_problems("align.launch", LaunchConfig(backend="accelerate",
                                                              accelerate_config="no/such.yaml"), "cpu")
    assert missing.startswith("align.launch.accelerate_config: no such file 'no/such.yaml'")
    assert launch_problems("pretrain.launch", LaunchConfig(backend="accelerate", processes=1,
                                                           accelerate_config="infra/accelerate/ddp_cpu.yaml"),
                           "cpu") == []
    (inline,) = launch_problems("pretrain.launch", LaunchConfig(processes=2), "cpu")
    assert "backend inline" in inline
    closed = free_port()
    for address, says in [(None, "RAY_ADDRESS names no Ray cluster"),
                          (f"127.0.0.1:{closed}", f"no Ray cluster answers at RAY_ADDRESS=127.0.0.1:{closed}")]:
        with pytest.MonkeyPatch.context() as patch:
            patch.delenv("RAY_ADDRESS", raising=False)
            if address:
                patch.setenv("RAY_ADDRESS", address)
            (ray,) = launch_problems("pretrain.launch", LaunchConfig(backend="ray", nodes=2), "cpu")
        assert ray.startswith(f"pretrain.launch.backend: ray, and {says}; start one"), ray
    (precision,) = launch_problems("sft.launch", LaunchConfig(mixed_precision="bf16"), "cpu")
    assert precision.startswith("sft.launch.mixed_precision: bf16 applies to a launched stage")


def test_sharding_that_cannot_happen_is_refused_naming_the_key():
    from gristmill.core.launch import sharding_problems

    (inline,) = sharding_problems("pretrain.launch", LaunchConfig(), "cpu", fsdp=True)
    assert inline.startswith("pretrain.fsdp: true shards over a launch's processes, and backend inline")
    plugin = LaunchConfig(backend="accelerate", accelerate_config="infra/accelerate/fsdp_gpu.yaml")
    (twice,) = sharding_problems("sft.launch", plugin, "cpu", fsdp=False)
    assert twice.startswith("sft.launch.accelerate_config: infra/accelerate/fsdp_gpu.yaml asks Accelerate for FSDP")
    two = LaunchConfig(backend="accelerate", processes=2)
    assert sharding_problems("pretrain.launch", two, "cpu", fsdp=True) == []
    with pytest.raises(ValidationError, match="fsdp: true with lora"):
        from gristmill.tasks.sft.config import Config as SFTConfig

        SFTConfig(fsdp=True, lora={})
    from gristmill.tasks.pretrain.config import Config as PretrainConfig

    with pytest.raises(ValidationError, match=r"processes \* batch_size \* seq_len = 3 \* 4 \* 32"):
        PretrainConfig(seq_len=32, batch_size=4, tokens_per_step=8 * 32,
                       launch={"backend": "accelerate", "processes": 3})


def test_the_launchs_mixed_precision_reaches_the_training_loop(monkeypatch):
    """`launch.mixed_precision` is a flag of the launcher, which hands it to every rank's Accelerator."""
    from gristmill.core.launch import PRECISION_VAR
    from gristmill.infra.launch import accelerate_argv
    from gristmill.model.config import LoopConfig
    from gristmill.model.loop import make_accelerator

    argv = accelerate_argv(LaunchConfig(backend="accelerate", mixed_precision="bf16"), ["-m", "x"], cuda=False)
    assert argv[argv.index("--mixed_precision") + 1] == "bf16"
    monkeypatch.setenv(PRECISION_VAR, "bf16")
    assert make_accelerator(LoopConfig(device="cpu"))[0].mixed_precision == "bf16"
    monkeypatch.delenv(PRECISION_VAR)
    assert make_accelerator(LoopConfig(device="cpu"))[0].mixed_precision == "no"


def test_the_cli_refuses_a_bad_launch_before_anything_starts(tmp_path):
    """One line naming the key, exit 2, before any service starts."""
    for override, says in [("pretrain.launch.accelerate_config=missing.yaml", "pretrain.launch.accelerate_config"),
                           ("align.launch.backend=ray", "align.launch.backend: ray, and RAY_ADDRESS names no")]:
        done = subprocess.run([sys.executable, "-m", "gristmill", "run", "configs/tiny.yaml", "align.method=ppo",
                               "pretrain.launch.backend=accelerate", override],
                              cwd=REPO, env=cli_env(tmp_path / "home"), capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and says in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "home" / "prefect").exists() and not (tmp_path / "home" / "mlflow.db").exists()


def test_the_launch_is_not_part_of_the_artifact_key():
    from gristmill.flows.config import load_config
    from gristmill.flows.dag import plan
    from gristmill.infra.artifacts import ArtifactStore

    store = ArtifactStore(Path("/nonexistent"))
    keys = [{p.spec.name: p.key for p in plan(load_config(REPO / "configs" / "tiny.yaml", overrides), store)}
            for overrides in ([], [*TWO, "align.launch.backend=accelerate", "align.launch.processes=2"])]
    assert keys[0] == keys[1]


def test_a_failing_rank_is_reported_in_one_line():
    from gristmill.infra.launch import _failure

    lines = ["[rank0]:step 1", "[rank1]:Traceback (most recent call last):", "[rank1]:  File x",
             "[rank1]:ValueError: boom", "Root Cause (first observed failure):", "[0]:",
             "  rank      : 1 (local_rank: 1)", "  exitcode  : 1 (pid: 7)"]
    assert _failure(lines, 1) == "rank 1: ValueError: boom"
    killed = ["[rank0]:step 1", "Root Cause (first observed failure):", "  rank      : 0 (local_rank: 0)",
              f"  exitcode  : -{signal.SIGKILL.value} (pid: 7)"]
    assert _failure(killed, 1) == "rank 0: killed by SIGKILL"
    assert _failure(["[rank1]:ValueError: boom", "gristmill-launch failed: rank 1: ValueError: boom"], 1) == \
        "rank 1: ValueError: boom"  # the Ray Train driver names the rank itself


def test_a_ray_worker_that_died_is_named_not_the_ranks_it_took_down():
    from ray.exceptions import RayActorError
    from ray.train import WorkerGroupError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    from gristmill.infra.ray_train import failure_line

    collateral = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:29853.\nmore")
    died = WorkerHealthCheckFailedError("A worker health check failed.", RayActorError())
    assert failure_line(WorkerGroupError("x", {0: collateral, 1: died})) == \
        "rank 1: its process died (killed, or out of memory)"
    assert failure_line(WorkerGroupError("x", {0: collateral})) == \
        "rank 0: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:29853."
