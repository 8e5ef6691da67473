"""The pipeline on a Ray cluster whose nodes share nothing but the object store: the `two_ray_nodes`
fixture's second node has an empty private disk (tests/ray_cluster.py) and the artifacts live on
the `s3_server` fixture's bucket (GRISTMILL_STORE=s3://...) or the `gcs_server` emulator's
(gs://...), reached through the fault proxy (tests/fault_proxy.py) by the whole pipeline. Whatever
the stages need travels through the bucket or through Ray; a path only the driver has fails the
worker given it in one line; a node lost mid-training is replaced and the stage resumes from the
bucket's checkpoint. The single-machine runs they are compared with are the shared `tiny_run`
and, for align, runs on this machine from its stages with as many ranks as the cluster's where the
curve depends on them."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import psutil
import pytest
from pipeline_helpers import REPO, STAGES, cli_env, committed_dir, gristmill, manifest_files

from gristmill.core import object_store
from gristmill.core.stage import read_metrics

BUCKET = "crawl"
# pretrain, SFT and align as Ray Train workers, one on each node; collect and tokenize's Ray
# workers and evaluate (no Ray backend) as they always run on RAY_ADDRESS's cluster
def _on_two_nodes(*stages: str) -> list[str]:
    return [f"{stage}.launch.{key}={value}" for stage in stages
            for key, value in (("backend", "ray"), ("processes", 1), ("nodes", 2))]


ON_TWO_NODES = _on_two_nodes("pretrain", "sft", "align")
CURVES = {"pretrain": ("loss", "val_loss"), "sft": ("loss", "heldout_loss"), "grpo": ("loss", "reward")}
# GRPO samples each rank's completions with its own seed (TRL: seed + process index): the same
# curve takes the same number of ranks, here two Accelerate processes on this machine
TWO_RANKS_HERE = ["align.launch.backend=accelerate", "align.launch.processes=2"]
UNTIL_SFT = ("collect", "tokenize", "pretrain", "sft")


def _objects(prefix: str, scheme: str = "s3") -> set[str]:
    """The objects under `prefix` of the bucket, relative to it."""
    return set(object_store.find(f"{scheme}://{BUCKET}/{prefix.rstrip('/')}"))


def _same_curves(ours: Path, theirs: Path, keys: tuple[str, ...], since: int = 0) -> None:
    """The committed metrics of two runs of a stage from step `since`: the same steps, each curve
    within 1e-4 (its largest difference printed)."""
    mine, reference = ([r for r in read_metrics(artifact / "metrics.jsonl") if r["step"] >= since]
                       for artifact in (ours, theirs))
    assert [r["step"] for r in mine] == [r["step"] for r in reference]
    for key in keys:
        expected, got = ([r[key] for r in rows if key in r] for rows in (reference, mine))
        assert expected and got == pytest.approx(expected, abs=1e-4), (ours, key)
        largest = max(abs(a - b) for a, b in zip(got, expected))
        print(f"{ours.name} {key}: {len(got)} steps, largest difference {largest:.2g}")


def _committed_on_the_bucket(home: Path, tiny_run, stages: tuple[str, ...] | list[str], on_bucket: set[str]) -> None:
    """Each of `stages` committed on the bucket (`on_bucket`: its objects under the store's prefix)
    under the shared run's key, its retries on the bucket counted in its stats, and nothing left
    behind: no partial output, no lease, no checkpoint (a rank beside the driver left some there)."""
    for stage in stages:
        name = tiny_run.committed[stage].name
        assert committed_dir(home, stage).name == name  # the launch is not part of the key
        assert f"{stage}/{name}/manifest.json" in on_bucket, stage
        assert "store_retries" in json.loads((committed_dir(home, stage) / "manifest.json").read_text())["stats"]
    assert not any(".partial/" in key or key.endswith(".lease") or "/checkpoints/" in key for key in on_bucket)


def _data_stages_on_both_nodes_made_the_shared_runs_bytes(home: Path, tiny_run, out: str) -> None:
    """Collect's and tokenize's units ran on both nodes (tokenize's one a docs shard: two in this
    preset), as the run's output `out` says too, and wrote the shared run's bytes."""
    for stage, unit in (("collect", "process_unit"), ("tokenize", "encode_shard")):
        assert manifest_files(committed_dir(home, stage)) == manifest_files(tiny_run.committed[stage]), stage
        per_node = json.loads((committed_dir(home, stage) / "manifest.json").read_text())["stats"]["units_per_node"]
        assert len(per_node[unit]) == 2 and min(per_node[unit].values()) > 0, (stage, per_node)
        assert re.search(rf"{unit}: \d+ units, per Ray node: \w+ [1-9]\d*, \w+ [1-9]\d*", out), out[-4000:]


def _ranks_on_nodes(out: str) -> list[str]:
    """The node of each Ray Train worker the run's output `out` announces, in order."""
    return [node for _, node in re.findall(r"\[rank(\d)\]:rank \1 of 2 on node (\w+)", out)]


def _checkpoint_steps(prefix: str) -> list[int]:
    """Steps of the complete training checkpoints on the bucket under `prefix` (step 0, the
    rollback anchor, is not progress)."""
    found = (re.search(r"/checkpoints/step-(\d+)/checkpoint\.json$", f"/{key}") for key in _objects(prefix))
    steps = {int(m[1]) for m in found if m}
    return sorted(step for step in steps if step > 0)


@pytest.mark.slow
def test_the_pipeline_on_two_nodes_sharing_only_the_bucket_survives_a_lost_node_and_commits_the_single_machine_run(
        tiny_run, two_ray_nodes, faulty_s3, prefect_server, tmp_path):
    """`gristmill run configs/tiny.yaml` with the store on the bucket, every connection to it
    through the fault proxy (some reset mid-transfer, some delayed), and pretrain, SFT and align
    (GRPO) on Ray Train across the two nodes. Once pretraining's first checkpoint is on the bucket,
    kill -9 of the second node's raylet (the machine is lost) and a fresh second node with an empty
    disk in its place, as Kubernetes replaces a pod: Ray Train starts the workers again
    (launch.max_failures 1), they resume from the bucket's checkpoint, and the run goes on. Every
    stage commits on the bucket under the single-machine run's key; collect's and tokenize's units
    ran on both nodes and wrote that run's bytes; each training stage had a rank on each node (their
    lines reach the run's output with the rank in front); pretraining's and SFT's curves are that
    run's within 1e-4, GRPO's (loss, reward) that of align on this machine with two Accelerate
    processes. (DPO's data-parallel loss is one process's: tests/tasks/align/test_align.py; its
    claims hold on two processes: tests/flows/test_pipeline_e2e.py.)"""
    home = tmp_path / "home"
    bucket, proxy = faulty_s3
    services = {**two_ray_nodes, **prefect_server, **bucket, "GRISTMILL_STORE": f"s3://{BUCKET}/cluster"}
    output = tmp_path / "run.log"
    started = time.monotonic()
    with output.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gristmill", "run", "configs/tiny.yaml", *tiny_run.overrides,
                                 *ON_TWO_NODES, "pretrain.checkpoint_every=20"], cwd=REPO, env=cli_env(home, services),
                                stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        while not _checkpoint_steps("cluster/pretrain/"):
            assert proc.poll() is None and time.monotonic() - started < 900, output.read_text()[-4000:]
            time.sleep(0.5)
        lost = two_ray_nodes.second_raylet()
        lost.kill()
        two_ray_nodes.replace_second()
        proc.wait(1500)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = output.read_text()
    assert proc.returncode == 0, out[-6000:]
    print(f"the pipeline on two nodes, one lost: {time.monotonic() - started:.0f} s; "
          f"the proxy reset {proxy.resets} and delayed {proxy.delays} of {proxy.connections} connections")
    assert proxy.resets > 0 and proxy.delays > 0  # the bucket did misbehave
    _committed_on_the_bucket(home, tiny_run, STAGES, _objects("cluster/"))
    _data_stages_on_both_nodes_made_the_shared_runs_bytes(home, tiny_run, out)

    # pretrain's first workers, then its workers again, SFT's and align's: each group on two nodes,
    # the head and the lost node first, the head and the lost node's replacement after
    placed = _ranks_on_nodes(out)
    first, *after = [set(placed[i:i + 2]) for i in range(0, len(placed), 2)]
    assert len(placed) == 8 and len(first) == 2 and all(group == after[0] for group in after), placed
    assert len(after[0]) == 2 and len(first & after[0]) == 1, placed
    resumed = re.search(r"resuming from step (\d+)", out)
    assert resumed and int(resumed[1]) >= 20, out[-4000:]
    # the whole of pretraining's curve: a rank 0 on a fresh disk gets the rows written before the
    # checkpoint (on the lost node's disk or the driver's) from the checkpoint's copy
    _same_curves(committed_dir(home, "pretrain"), tiny_run.committed["pretrain"], CURVES["pretrain"])
    _same_curves(committed_dir(home, "sft"), tiny_run.committed["sft"], CURVES["sft"])

    # align on this machine from the shared run's stages, with two ranks
    here = tiny_run.home_with(tmp_path / "here", UNTIL_SFT)
    gristmill(here, "run", "configs/tiny.yaml", *tiny_run.overrides, *TWO_RANKS_HERE, "--until", "align",
              services=prefect_server)
    assert committed_dir(here, "align").name == tiny_run.committed["align"].name  # the launch is not part of the key
    _same_curves(committed_dir(home, "align"), committed_dir(here, "align"), CURVES["grpo"])


@pytest.mark.slow
def test_the_pipeline_on_two_nodes_sharing_only_a_gcs_bucket_commits_the_single_machine_run(
        tiny_run, two_ray_nodes, faulty_gcs, prefect_server, tmp_path):
    """The same cluster with the store on Google Cloud Storage (the `gcs_server` fixture's
    emulator; the nodes were started without its variables, which reach the workers from the
    driver), every connection to it through the fault proxy: `gristmill run configs/tiny.yaml` with
    pretraining and SFT on Ray Train across the two nodes, each rank checkpointing to the bucket,
    and align and evaluate on the driver. Every stage commits there under the single-machine run's
    key, with nothing left behind; collect's and tokenize's units ran on both nodes and wrote that
    run's bytes; pretraining's and SFT's curves are that run's within 1e-4."""
    home = tmp_path / "home"
    bucket, proxy = faulty_gcs
    services = {**two_ray_nodes, **prefect_server, **bucket, "GRISTMILL_STORE": f"gs://{BUCKET}/cluster"}
    started = time.monotonic()
    done = gristmill(home, "run", "configs/tiny.yaml", *tiny_run.overrides, *_on_two_nodes("pretrain", "sft"),
                     "pretrain.checkpoint_every=20", services=services)
    print(f"the pipeline on two nodes, on GCS: {time.monotonic() - started:.0f} s; "
          f"the proxy reset {proxy.resets} and delayed {proxy.delays} of {proxy.connections} connections")
    assert proxy.resets > 0 and proxy.delays > 0  # the bucket did misbehave
    out = done.stdout + done.stderr
    _committed_on_the_bucket(home, tiny_run, STAGES, _objects("cluster", "gs"))
    _data_stages_on_both_nodes_made_the_shared_runs_bytes(home, tiny_run, out)
    placed = _ranks_on_nodes(out)
    assert len(placed) == 4 and len(set(placed[:2])) == len(set(placed[2:])) == 2, placed
    for stage in ("pretrain", "sft"):
        _same_curves(committed_dir(home, stage), tiny_run.committed[stage], CURVES[stage])


def test_a_worker_given_a_path_only_the_driver_has_fails_in_one_line_naming_it(two_ray_nodes, tmp_path):
    """Ray Train on the two nodes, a zip file on the driver's disk listed by each worker: the one on
    the second node (which has no such file) fails, in one line naming the path."""
    listed = tmp_path / "driver-only.zip"
    with zipfile.ZipFile(listed, "w") as archive:
        archive.write(REPO / "configs" / "tiny.yaml", arcname="tiny.yaml")
    proc = subprocess.run([sys.executable, "-m", "gristmill.infra.ray_train", "--processes", "1", "--nodes", "2",
                           "--max-failures", "0", "zipfile", "-l", str(listed)], cwd=REPO,
                          env=cli_env(tmp_path / "home", two_ray_nodes), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"gristmill-launch failed: rank [01]: NotOnThisNode: {re.escape(str(listed))} is not on "
                        r"node \w{8}: only the driver has it .*", last), last
    assert re.search(r"\[rank[01]\]:tiny\.yaml", proc.stdout), proc.stdout[-3000:]  # the head's worker listed it


def test_sigterm_to_the_driver_stops_the_workers_on_both_nodes_within_10_s(two_ray_nodes, tmp_path):
    """A cancel (SIGTERM) to the Ray Train driver ends its Ray job: the driver and the workers on
    both nodes, each sleeping in `timeit` as a stand-in for training, are gone within 10 s."""
    log = tmp_path / "driver.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gristmill.infra.ray_train", "--processes", "1", "--nodes", "2",
                                 "--max-failures", "0", "timeit", "-n", "1", "import time; time.sleep(600)"],
                                cwd=REPO, env=cli_env(tmp_path / "home", two_ray_nodes), stdout=out,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        started = time.monotonic()
        while len(pids := re.findall(r"\[rank\d\]:rank \d of 2 on node \w+ \(pid (\d+)\)", log.read_text())) < 2:
            assert proc.poll() is None and time.monotonic() - started < 240, log.read_text()[-3000:]
            time.sleep(0.5)
        workers = [psutil.Process(int(pid)) for pid in pids]
        proc.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        proc.wait(30)
        assert time.monotonic() - stopped < 10, log.read_text()[-3000:]
        while any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers):
            assert time.monotonic() - stopped < 10, [w.pid for w in workers if w.is_running()]
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
