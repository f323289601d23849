"""A tiny fake OpenAI streaming server (http.server in a thread) for the bench tests.

Paths:
- /v1/completions streams `max_tokens` one-token chunks with fixed delays, an `x-bucket` header, a usage
  chunk and [DONE]; /tokenize answers one token per whitespace-separated word; /metrics looks like
  bucketserve's.
- /strict/... behaves like transformers serve: rejects `ignore_eos` (422) and token-id prompts (400),
  accepts `generation_config`, sends no x-bucket header, no usage and no [DONE].
- /fail/... answers 503 to every completion; /slow/... streams with SLOW_DELAY between tokens.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

FIRST_DELAY = 0.02  # seconds before the first token
TOKEN_DELAY = 0.005  # seconds between tokens
SLOW_DELAY = 0.04  # seconds between tokens under /slow/
MODEL = "fake-model"


def words(text: str) -> list[int]:
    return [sum(map(ord, w)) % 1000 for w in text.split()]


def header_bucket(n: int) -> int:
    """Deliberately not the bench's next-power-of-two fallback, so tests can tell which was used."""
    return ((n + 99) // 100) * 100


@dataclass
class FakeState:
    requests: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Handler(BaseHTTPRequestHandler):
    state: FakeState  # set on the subclass per server

    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        pass

    def _json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        elif self.path in ("/health", "/ready"):
            self._json(200, {"status": "ok"})
        elif self.path == "/metrics":
            body = (
                b"# HELP bucketserve_warmup_seconds warm-up\n# TYPE bucketserve_warmup_seconds gauge\n"
                b"bucketserve_warmup_seconds 1.5\n"
                b'bucketserve_recompilations_total{reason="unwarmed_shape"} 0.0\n'
                b'bucketserve_graph_compilations_total{graph="decode",bucket="b1_kv2048",phase="warmup"} 3.0\n'
            )
            self.send_response(200)
            self.send_header("content-type", "text/plain; version=0.0.4")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self._json(404, {"error": "not found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))) or b"{}")
        if self.path == "/tokenize":
            tokens = words(body["prompt"])
            self._json(200, {"tokens": tokens, "count": len(tokens)})
            return
        with self.state.lock:
            self.state.requests.append({"path": self.path, **body})
        if self.path.startswith("/fail/"):
            self._json(503, {"error": {"message": "overloaded"}}, {"retry-after": "1"})
            return
        strict = self.path.startswith("/strict/")
        if strict and "ignore_eos" in body:
            self._json(422, {"detail": "Unexpected fields in the request: {'ignore_eos'}"})
            return
        if strict and not isinstance(body.get("prompt"), str):
            self._json(400, {"detail": "prompt must be a string."})
            return
        if body.get("model") != MODEL:
            self._json(404, {"error": {"message": f"unknown model {body.get('model')!r}"}})
            return
        if self.path.endswith("/chat/completions"):
            self._stream_chat(int(body["max_tokens"]))
            return
        prompt = body["prompt"]
        n_prompt = len(prompt) if isinstance(prompt, list) else len(words(prompt))
        delay = SLOW_DELAY if self.path.startswith("/slow/") else TOKEN_DELAY
        self._stream(n_prompt, int(body["max_tokens"]), strict, delay)

    def _stream(self, n_prompt: int, n_out: int, strict: bool, delay: float) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        if not strict:
            self.send_header("x-bucket", str(header_bucket(n_prompt)))
        self.end_headers()  # HTTP/1.0: the body ends when the connection closes

        def send(obj: Any) -> None:
            self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
            self.wfile.flush()

        time.sleep(FIRST_DELAY)
        for i in range(n_out):
            last = i == n_out - 1
            send({"choices": [{"index": 0, "text": f" w{i}", "finish_reason": "length" if last else None}]})
            if not last:
                time.sleep(delay)
        if not strict:
            usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
            send({"choices": [], "usage": usage})
            self.wfile.write(b"data: [DONE]\n\n")

    def _stream_chat(self, n_out: int) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        chunks: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
        chunks += [{"content": f" c{i}"} for i in range(n_out)]
        for i, delta in enumerate(chunks):
            finish = "length" if i == len(chunks) - 1 else None
            payload = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


@dataclass
class FakeServer:
    url: str
    state: FakeState


@contextmanager
def running_fake_server() -> Iterator[FakeServer]:
    state = FakeState()
    handler = type("BoundHandler", (Handler,), {"state": state})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield FakeServer(f"http://127.0.0.1:{httpd.server_address[1]}", state)
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def serve_forever(port: int) -> None:
    """Run the fake as a separate process (for the tests of servers the bench starts itself)."""
    handler = type("BoundHandler", (Handler,), {"state": FakeState()})
    httpd = ThreadingHTTPServer(("127.0.0.1", port), handler)
    httpd.daemon_threads = True
    httpd.serve_forever()
