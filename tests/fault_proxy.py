"""A TCP proxy on 127.0.0.1 that misbehaves like a bucket's network: in front of an emulator, it
resets a share of connections mid-transfer (an RST after part of the response, so the client sees
a reset or a short body) and delays others, reproducibly from its seed. It counts what it did.

    with FaultProxy(upstream_port, reset=0.1, delay=0.1) as proxy:
        ... point the client at proxy.url ...
    proxy.resets, proxy.delays, proxy.connections
"""
from __future__ import annotations

import contextlib
import random
import select
import socket
import struct
import threading
import time

CHUNK = 64 * 1024


class FaultProxy:
    def __init__(self, upstream_port: int, *, reset: float = 0.0, delay: float = 0.0, delay_s: float = 0.2,
                 seed: int = 0):
        self.upstream_port, self.reset, self.delay, self.delay_s = upstream_port, reset, delay, delay_s
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.connections = self.resets = self.delays = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._accept, name="fault-proxy", daemon=True)

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.listener.close()
        self.thread.join(timeout=5)

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
                draw = self.random.random()
                # a reset cuts the response after this many bytes: mid-transfer, or before any
                cut = self.random.randint(0, 4096) if draw < self.reset else None
                slow = self.reset <= draw < self.reset + self.delay
                self.resets += cut is not None
                self.delays += slow
            threading.Thread(target=self._serve, args=(client, cut, slow), daemon=True).start()

    def _serve(self, client: socket.socket, cut: int | None, slow: bool) -> None:
        """Both directions of one connection in one thread (a socket closed while another thread
        waits in recv on it would stay open until that recv returns: no reset would reach the
        client). After `cut` bytes of responses, an RST (SO_LINGER 0, then close)."""
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        except OSError:
            client.close()
            return
        if slow:
            time.sleep(self.delay_s)
        sent = 0
        try:
            while True:
                for ready in select.select([client, upstream], [], [])[0]:
                    if not (data := ready.recv(CHUNK)):
                        return
                    if ready is client:
                        upstream.sendall(data)
                        continue
                    if cut is not None and sent + len(data) > cut:
                        client.sendall(data[:cut - sent])
                        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        return
                    client.sendall(data)
                    sent += len(data)
        except OSError:
            pass  # either side went away
        finally:
            for end in (client, upstream):
                with contextlib.suppress(OSError):
                    end.close()
