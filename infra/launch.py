"""A training stage's launcher, started and supervised by the stage: Accelerate's (`launch.backend:
accelerate`), or the Ray Train driver (`ray`, infra/ray_train.py), which behaves alike.

The stage's Prefect task runs `accelerate launch ... -m gristmill.flows.launched ...` (every rank trains into
the stage's `.partial` directory) and stays its supervisor:

- every rank's output reaches the caller line by line with the rank in front (`[rank1]: ...`,
  torch elastic's `--tee` prefix), so it shows in the Prefect task log and on the console;
- Ctrl-C, SIGTERM or a cancel (any exception in the waiting caller) stops the launcher and every
  rank within GRACE_S: SIGTERM first, which torch elastic passes on to its workers, then SIGKILL
  to whatever is left; the `.partial` directory keeps the last checkpoint, so a re-run resumes;
- a rank that fails fails the launch with one line: that rank and its error (the last exception
  line it printed, or the signal that killed it), as torch elastic's root-cause report names it.

Ranks run in sessions of their own (torch elastic starts them so), so they are tracked as the
launcher's descendants (infra/processes.ProcessTree), not as a process group.
"""
from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from gristmill.core.launch import LaunchConfig
from gristmill.infra.processes import ProcessTree, alive

GRACE_S = 4.0  # SIGTERM to SIGKILL: torch elastic stops its workers well within this
PREFIX = re.compile(r"^\[rank(\d+)\]:(.*)$")  # torch elastic's --tee prefix with `--role rank`
EXCEPTION_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*)$")
ROOT_CAUSE = re.compile(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


FAILED_PREFIX = "gristmill-launch failed: "  # a launcher's last line naming the failed rank (infra/ray_train.py)


class LaunchFailed(RuntimeError):
    """A rank (or the launcher) failed; the message is one line naming it."""


def free_port() -> int:
    """A TCP port free on loopback now, for the ranks' rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def accelerate_argv(launch: LaunchConfig, worker: Sequence[str], *, cuda: bool, log_dir: Path | None = None,
                    num_machines: int = 1, machine_rank: int | str = 0, main_ip: str = "127.0.0.1",
                    port: int | None = None) -> list[str]:
    """`accelerate launch` of `worker` (`-m module args...`) with `launch.processes` processes on
    each of `num_machines` machines; the flags given here override the config file's values.
    `machine_rank` and `main_ip` may be placeholders (NODE_RANK, HEAD_IP) in a printed command;
    the ranks' log files go to `log_dir` (torch elastic picks a temporary one when None)."""
    argv = [sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", str(launch.accelerate_config_path(cuda)),
            "--num_processes", str(launch.processes * num_machines), "--num_machines", str(num_machines),
            "--machine_rank", str(machine_rank), "--main_process_ip", main_ip,
            "--main_process_port", str(port or free_port()),
            "--tee", "3", "--role", "rank", *(["--log_dir", str(log_dir)] if log_dir else [])]
    if launch.mixed_precision != "auto":
        argv += ["--mixed_precision", launch.mixed_precision]
    return [*argv, *worker]


def ray_argv(launch: LaunchConfig, worker: Sequence[str], *, cuda: bool, ship: Sequence[Path] = (),
             result: Path | None = None) -> list[str]:
    """The Ray Train driver (infra/ray_train.py) of `worker` (`-m module args...`) with
    `launch.processes` workers on each of `launch.nodes` nodes of the RAY_ADDRESS cluster. The
    nodes need no disk of this machine's: the `ship` files travel to the workers, and rank 0's
    `result` file comes back, through Ray."""
    flag, module, *args = worker
    assert flag == "-m", worker
    precision = [] if launch.mixed_precision == "auto" else ["--mixed-precision", launch.mixed_precision]
    return [sys.executable, "-m", "gristmill.infra.ray_train", "--processes", str(launch.processes),
            "--nodes", str(launch.nodes), "--max-failures", str(launch.max_failures),
            *(["--gpu"] if cuda else []), *precision,
            *(arg for path in ship for arg in ("--ship", str(path))),
            *(["--result", str(result)] if result else []), module, *args]


def _failure(lines: list[str], returncode: int) -> str:
    """One line for a failed launch: the failing rank and its error."""
    said = [line.removeprefix(FAILED_PREFIX) for line in lines if line.startswith(FAILED_PREFIX)]
    if said:
        return said[-1]
    text = "\n".join(lines)
    causes = ROOT_CAUSE.findall(text.rsplit("Root Cause", 1)[-1]) if "Root Cause" in text else []
    if not causes:
        errors = [m.group(1) for line in lines if (m := EXCEPTION_LINE.match(line))]
        return errors[-1] if errors else f"accelerate launch exited with {returncode}"
    rank, exitcode = int(causes[0][0]), int(causes[0][1])
    said = [m.group(2) for line in lines if (m := PREFIX.match(line)) and int(m.group(1)) == rank]
    errors = [m.group(1) for line in said if (m := EXCEPTION_LINE.match(line))]
    if errors:
        return f"rank {rank}: {errors[-1].strip()}"
    if exitcode < 0:
        return f"rank {rank}: killed by {signal.Signals(-exitcode).name}"
    return f"rank {rank}: exited with {exitcode}"


def run_launcher(argv: Sequence[str], *, on_line: Callable[[str], None], env: dict[str, str],
                 cwd: Path | None = None) -> None:
    """Run the launcher `argv` to the end, passing each output line to `on_line`; raise
    LaunchFailed (one line) when it fails. Whatever interrupts the wait (KeyboardInterrupt, a
    cancel) stops the launcher and every rank first, then propagates."""
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, env=env, cwd=cwd, start_new_session=True)
    tree = ProcessTree(proc.pid)
    lines: list[str] = []

    def relay() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            lines.append(line)
            on_line(line)

    reader = threading.Thread(target=relay, name="gristmill-launch-relay", daemon=True)
    reader.start()
    try:
        while proc.poll() is None:
            tree.refresh()  # ranks are started in sessions of their own: remember them
            try:
                proc.wait(0.5)
            except subprocess.TimeoutExpired:
                continue
    except BaseException:
        stop(proc, tree)
        raise
    reader.join(5)
    tree.kill()  # a rank its launcher left behind
    if proc.returncode != 0:
        raise LaunchFailed(_failure(lines, proc.returncode))


def stop(proc: subprocess.Popen, tree: ProcessTree) -> None:
    """SIGTERM the launcher (torch elastic stops its ranks), SIGKILL all that is left after GRACE_S."""
    tree.refresh()
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while alive(tree.known.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    tree.kill()
