"""A fault-injecting HTTP proxy between boto3 and the loopback S3 server.

Each request is forwarded unchanged, except that a seeded fraction gets a 503 SlowDown, a 500,
a reset connection, or added latency. Counters say what was injected.

A reduced server: ``unsupported`` names operations answered with 501 NotImplemented, as
S3-compatible servers without them answer (every time, before any fault roll):

* ``list_multipart_uploads``: ``GET /bucket?uploads``;
* ``batch_delete``: ``POST /bucket?delete`` (DeleteObjects);
* ``conditional_put``: a PUT with ``If-None-Match``;
* ``crc32c``: any request asking for a CRC32C checksum.

``deny_delete`` answers 403 AccessDenied to every delete (a bucket policy without delete).
``cut_bodies = n``: the next ``n`` responses with a body of more than 1 KiB announce their full
length, send half of it and reset the connection (a transfer cut mid-stream).
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
            b"<Message>Please reduce your request rate.</Message></Error>")
INTERNAL = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
            b"<Message>We encountered an internal error. Please try again.</Message></Error>")

NOT_IMPLEMENTED = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NotImplemented</Code>'
                   b"<Message>A header you provided implies functionality that is not implemented"
                   b"</Message></Error>")
ACCESS_DENIED = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
                 b"<Message>Access Denied</Message></Error>")
OPERATIONS = ("list_multipart_uploads", "batch_delete", "conditional_put", "crc32c")


def operation(method: str, path: str, headers: dict[str, str]) -> set[str]:
    """The optional operations a request uses (names of OPERATIONS, plus "delete")."""
    url = urlparse(path)
    query = parse_qs(url.query, keep_blank_values=True)
    bucket_only = url.path.strip("/").count("/") == 0
    h = {k.lower(): v for k, v in headers.items()}
    ops = set()
    if method == "GET" and "uploads" in query and bucket_only:
        ops.add("list_multipart_uploads")
    if method == "POST" and "delete" in query:
        ops.update(("batch_delete", "delete"))
    if method == "DELETE" and "uploadId" not in query:
        ops.add("delete")
    if method == "PUT" and "if-none-match" in h:
        ops.add("conditional_put")
    if ("x-amz-checksum-crc32c" in h or "crc32c" in h.get("x-amz-trailer", "").lower()
            or h.get("x-amz-sdk-checksum-algorithm", "").upper() == "CRC32C"
            or h.get("x-amz-checksum-algorithm", "").upper() == "CRC32C"):
        ops.add("crc32c")
    return ops


class FaultProxy:
    def __init__(self, upstream: str, *, rate: float = 0.2, seed: int = 0, latency_s: float = 0.2,
                 unsupported: tuple[str, ...] | frozenset[str] = (), deny_delete: bool = False) -> None:
        unknown = set(unsupported) - set(OPERATIONS)
        if unknown:
            raise ValueError(f"unsupported={sorted(unknown)}: choose from {OPERATIONS}")
        self.upstream = urlparse(upstream)
        self.rate = rate
        self.latency_s = latency_s
        self.unsupported = frozenset(unsupported)
        self.deny_delete = deny_delete
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.counts = {"forwarded": 0, "slowdown": 0, "internal": 0, "reset": 0, "latency": 0,
                       "not_implemented": 0, "denied": 0, "cut": 0}
        self.cut_bodies = 0
        self.refused: dict[str, int] = {}  # operation -> 501s answered
        self.body_hashes: list[str] = []  # each forwarded PUT's x-amz-content-sha256, in order
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                ops = operation(self.command, self.path, dict(self.headers.items()))
                refused = sorted(ops & proxy.unsupported)
                denied = proxy.deny_delete and "delete" in ops
                if refused or denied:
                    with proxy.lock:
                        if refused:
                            proxy.counts["not_implemented"] += 1
                            proxy.refused[refused[0]] = proxy.refused.get(refused[0], 0) + 1
                        else:
                            proxy.counts["denied"] += 1
                    payload = NOT_IMPLEMENTED if refused else ACCESS_DENIED
                    self.send_response(501 if refused else 403)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                    return
                with proxy.lock:
                    roll = proxy.rng.random()
                    fault = None
                    if roll < proxy.rate:
                        fault = ("slowdown", "internal", "reset", "latency")[int(roll / proxy.rate * 4)]
                        proxy.counts[fault] += 1
                    proxy.counts["forwarded"] += fault in (None, "latency")
                    if self.command == "PUT" and fault in (None, "latency"):
                        proxy.body_hashes.append(self.headers.get("x-amz-content-sha256", ""))
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
                with proxy.lock:
                    cut = self.command != "HEAD" and len(data) > 1024 and proxy.cut_bodies > 0
                    if cut:
                        proxy.cut_bodies -= 1
                        proxy.counts["cut"] += 1
                if cut:
                    self.wfile.write(data[:len(data) // 2])
                    self.wfile.flush()
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()
                    self.close_connection = True
                elif self.command != "HEAD":
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
