"""A fault-injecting HTTP proxy in front of the moto S3 server: real sockets, real retries.

Every ``fail_every``-th request is answered ``503 SlowDown`` (the S3 throttling error) without reaching
S3; every ``delay_every``-th one is held ``delay_s`` seconds before it is forwarded (a client read
timeout); after ``fail_after`` requests every request fails (an outage). Counters say what was injected.
"""
from __future__ import annotations

import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


class FlakyS3Proxy:
    def __init__(self, upstream: str, fail_every: int = 0, delay_every: int = 0, delay_s: float = 0.0,
                 fail_after: int | None = None):
        self.upstream = urlparse(upstream)
        self.fail_every, self.delay_every, self.delay_s, self.fail_after = fail_every, delay_every, delay_s, fail_after
        self.requests = self.failed = self.delayed = 0
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "FlakyS3Proxy":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _decide(self) -> str:
        with self.lock:
            self.requests += 1
            n = self.requests
            if (self.fail_after is not None and n > self.fail_after) or (self.fail_every and n % self.fail_every == 0):
                self.failed += 1
                return "fail"
            if self.delay_every and n % self.delay_every == 0:
                self.delayed += 1
                return "delay"
            return "forward"

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        chunk = self.rfile.read(size)
                        self.rfile.readline()
                        if not size:
                            break
                        chunks.append(chunk)
                    return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _any(self) -> None:
                body = self._body()
                action = proxy._decide()
                if action == "fail":
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    self.wfile.write(SLOW_DOWN)
                    return
                if action == "delay":
                    time.sleep(proxy.delay_s)
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body if body or self.command in ("PUT", "POST") else None,
                             headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP_BY_HOP and (k.lower() != "content-length" or self.command == "HEAD"):
                        self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        return Handler
