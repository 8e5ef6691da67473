"""The warm runner `gristmill up` starts (`python -m flows.runner HOME`): imports what a run
needs once, then forks each `gristmill run` of the home's supervisors; the protocol, and what it
refuses, are described in infra/warm.py."""
from __future__ import annotations

import os
import selectors
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from infra import env
from infra.warm import (
    CODE_ROOT,
    TERMINAL,
    code_state,
    import_view,
    receive_line,
    send,
    socket_path,
)


class Runner:
    def __init__(self, home: Path):
        self.home = Path(home).resolve()
        self.view = import_view(os.environ, self.home)
        env.configure(self.home)
        import flows.cli  # noqa: F401  the warm part: everything a run imports before its stages
        import flows.pipeline  # noqa: F401
        import infra.services  # noqa: F401
        import infra.tracking  # noqa: F401

        self.code = code_state()
        self.stale = False
        self.runs: dict[int, socket.socket] = {}  # pid of a forked run -> its supervisor's socket

    def refusal(self, request: dict[str, Any]) -> str:
        if request.get("executable") != sys.executable or request.get("code") != str(CODE_ROOT):
            return "another Python or gristmill checkout"
        if import_view(request["env"], self.home) != self.view:
            return "other settings in the environment"
        if self.stale or code_state() != self.code:
            self.stale = True
            return "gristmill's code or the installed packages changed since the runner started"
        return ""

    def serve(self) -> None:
        path = socket_path(self.home)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(path))
        os.chmod(path, 0o600)  # only this user may hand the runner a command
        server.listen(16)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        # A run that ends wakes the loop at once (SIGCHLD through a wakeup socket), so its
        # supervisor hears of it without waiting for the next poll.
        self.wake, self.wake_writer = socket.socketpair()
        wake = self.wake
        self.wake_writer.setblocking(False)
        signal.set_wakeup_fd(self.wake_writer.fileno())
        signal.signal(signal.SIGCHLD, lambda *_: None)
        selector = selectors.DefaultSelector()
        selector.register(server, selectors.EVENT_READ)
        selector.register(wake, selectors.EVENT_READ)
        try:
            while True:
                for key, _ in selector.select(timeout=5):
                    if key.fileobj is server:
                        conn, _ = server.accept()
                        self.handle(conn, server)
                    else:
                        wake.recv(4096)
                self.reap()
                if self.stale and not self.runs:  # start again with the new code
                    server.close()
                    os.execv(sys.executable, [sys.executable, "-m", "flows.runner", str(self.home)])
        finally:
            path.unlink(missing_ok=True)

    def handle(self, conn: socket.socket, server: socket.socket) -> None:
        fds: list[int] = []
        try:
            conn.settimeout(10)
            data, fds, _, _ = socket.recv_fds(conn, 1 << 16, len(TERMINAL))
            request = receive_line(conn, data) if data else {}
            if request.get("ping"):
                send(conn, {"ok": True})
                conn.close()
                return
            refused = self.refusal(request) if len(fds) == len(TERMINAL) else "no terminal passed"
            if refused:
                print(f"runner: refused a run ({refused}); it starts in a fresh process", flush=True)
                send(conn, {"refused": refused})
                conn.close()
                return
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                server.close()
                for other in [conn, self.wake, self.wake_writer, *self.runs.values()]:
                    other.close()
                _run_forked(request, fds)  # never returns
            print(f"runner: forked pid {pid}: gristmill {' '.join(request['argv'])}", flush=True)
            send(conn, {"pid": pid})
            self.runs[pid] = conn
        except (OSError, ValueError, KeyError, TypeError) as error:  # a client gone, or garbage
            print(f"runner: dropped a request: {error}", file=sys.stderr, flush=True)
            conn.close()
        finally:
            for fd in fds:
                os.close(fd)

    def reap(self) -> None:
        while self.runs:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.runs.pop(pid, None)
            if conn is not None:
                try:
                    send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                except OSError:  # the supervisor is gone; nobody to tell
                    pass
                conn.close()


def _run_forked(request: dict[str, Any], fds: list[int]) -> None:
    """In the fork: become the pipeline child the supervisor would have started, then exit."""
    code = 1
    try:
        os.setsid()
        for target, fd in zip(TERMINAL, fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if os.isatty(1):
            sys.stdout.reconfigure(line_buffering=True)
        sys.argv = [sys.argv[0], *request["argv"]]
        from flows.cli import main

        code = main(request["argv"])
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # noqa: BLE001  the run's own error, reported like any child's
        import traceback

        traceback.print_exc()
    finally:
        import atexit

        atexit._run_exitfuncs()  # what an exiting interpreter would run (Prefect's, Ray's)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


if __name__ == "__main__":
    Runner(Path(sys.argv[1])).serve()
