"""A fault-injecting HTTP proxy between boto3 and the loopback S3 server.

Each request is forwarded unchanged, except that a seeded fraction gets a 503 SlowDown, a 500,
a reset connection, or added latency. Counters say what was injected.
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
            b"<Message>Please reduce your request rate.</Message></Error>")
INTERNAL = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
            b"<Message>We encountered an internal error. Please try again.</Message></Error>")


class FaultProxy:
    def __init__(self, upstream: str, *, rate: float = 0.2, seed: int = 0, latency_s: float = 0.2) -> None:
        self.upstream = urlparse(upstream)
        self.rate = rate
        self.latency_s = latency_s
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.counts = {"forwarded": 0, "slowdown": 0, "internal": 0, "reset": 0, "latency": 0}
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy.lock:
                    roll = proxy.rng.random()
                    fault = None
                    if roll < proxy.rate:
                        fault = ("slowdown", "internal", "reset", "latency")[int(roll / proxy.rate * 4)]
                        proxy.counts[fault] += 1
                    proxy.counts["forwarded"] += fault in (None, "latency")
                if fault == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()
                    self.close_connection = True
                    return
                if fault in ("slowdown", "internal"):
                    payload = SLOWDOWN if fault == "slowdown" else INTERNAL
                    self.send_response(503 if fault == "slowdown" else 500)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                if fault == "latency":
                    time.sleep(proxy.latency_s)
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body if length else None, headers=headers)
                r = conn.getresponse()
                data = r.read()
                self.send_response(r.status, r.reason)
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle  # noqa: N815

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
