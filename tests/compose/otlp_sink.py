"""A stand-in for the OpenTelemetry Collector in the compose test: an OTLP/HTTP receiver that keeps
every export it is sent, undecoded, for tests/compose/check.py to read.

    python3 otlp_sink.py --port 4318 --out DIR

POST /v1/traces, /v1/metrics, /v1/logs: the body (gunzipped when sent with Content-Encoding: gzip)
is written to DIR/<signal>-<n>.<pb|json> (protobuf or JSON, as its Content-Type says), then
answered 200 with an empty export response, which is what a collector that accepted everything
answers. GET /: 200 (the healthcheck). Standard library only: it runs on a bare Debian image. The
test also runs it, idle, in place of Jaeger and Prometheus.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SIGNALS = {"/v1/traces": "traces", "/v1/metrics": "metrics", "/v1/logs": "logs"}


class Sink(BaseHTTPRequestHandler):
    out: Path
    counter = itertools.count()
    lock = threading.Lock()

    def do_GET(self) -> None:
        self.answer(200, b"otlp sink\n", "text/plain")

    def do_POST(self) -> None:
        signal = SIGNALS.get(self.path.split("?")[0])
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if signal is None:
            self.answer(404, b"unknown path\n", "text/plain")
            return
        if self.headers.get("Content-Encoding", "").lower() == "gzip":
            body = gzip.decompress(body)
        json_body = "json" in self.headers.get("Content-Type", "")
        with self.lock:
            n = next(self.counter)
        # Written under a temporary name, then renamed: a reader never sees half a file.
        final = self.out / f"{signal}-{n:06d}.{'json' if json_body else 'pb'}"
        partial = final.with_name("." + final.name)
        partial.write_bytes(body)
        os.replace(partial, final)
        if json_body:
            self.answer(200, b"{}", "application/json")
        else:
            self.answer(200, b"", "application/x-protobuf")

    def answer(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:
        if self.command == "POST":  # one line per export; the healthchecks' GETs say nothing
            print(f"POST {self.path} {args[1] if len(args) > 1 else ''}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=4318)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    Sink.out = args.out
    server = ThreadingHTTPServer(("0.0.0.0", args.port), Sink)
    print(f"otlp sink: http://0.0.0.0:{args.port}, writing to {args.out}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
