"""A scripted OpenAI-compatible completions server (stdlib `http.server` in a thread) for fast tests.

It speaks the vLLM streaming wire format of `POST /v1/completions`: `data: {json}` events with
`choices[0].text`, a last event with `finish_reason` and `usage` (with
`prompt_tokens_details.cached_tokens`, the longest common prefix with the previous prompt of the
same `user`), then `data: [DONE]`. Its "tokenizer" is one id per character (`encode`/`decode`).

Knobs: `takes_ids` (else HTTP 400 for a list prompt, as transformers serve), `strict` (HTTP 400
for fields OpenAI does not define), `context` (HTTP 400 "maximum context length" past it),
`statuses` (the next requests' error statuses, e.g. [429, 429]), `cut_after` (close the
connection after that many text events, no [DONE]), `stall_s` (sleep before the first event),
`delay_s` (between events), `port` (0 = any free one), `sends_ids` (honour vLLM's
`return_token_ids`, with ids in this fake's own encoding: only for clients that use it),
`eos` (llama.cpp: the reply's end-of-sequence token goes as a text event of its own, then the
last event with the usage comes `last_delay_s` later), `llama_slots` (llama.cpp: `GET /props`
names `total_slots`, and `id_slot` in a request keeps its own prefix cache per slot), `replicas`
(a router's `GET /readiness`: (healthy, total) workers, as vLLM's router says it). Every
completion request's body and headers are kept in `requests` (probes included: `completions`
leaves them out).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

OPENAI_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "stream", "stream_options", "seed", "user"}


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def decode(ids) -> str:
    return "".join(chr(i) for i in ids)


class FakeOpenAI:
    def __init__(self, reply: str = "Hello there.", **knobs):
        self.reply = reply
        self.takes_ids = knobs.pop("takes_ids", True)
        self.strict = knobs.pop("strict", False)
        self.context = knobs.pop("context", 10_000)
        self.statuses: list[int] = list(knobs.pop("statuses", []))
        self.cut_after: int | None = knobs.pop("cut_after", None)
        self.stall_s = knobs.pop("stall_s", 0.0)
        self.delay_s = knobs.pop("delay_s", 0.0)
        self.report_cache = knobs.pop("report_cache", True)
        port = knobs.pop("port", 0)
        self.sends_ids = knobs.pop("sends_ids", False)  # answer return_token_ids (ids in this fake's encoding)
        self.eos = knobs.pop("eos", "")
        self.last_delay_s = knobs.pop("last_delay_s", 0.0)
        self.llama_slots = knobs.pop("llama_slots", 0)
        self.replicas: tuple[int, int] | None = knobs.pop("replicas", None)
        self.logprobs = knobs.pop(
            "logprobs", False
        )  # answer `logprobs: n` as llama.cpp does (ids in this fake's encoding)
        assert not knobs, f"unknown knobs {knobs}"
        self.requests: list[tuple[dict, dict]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.gone = 0  # streams whose client went away before the end
        self._last: dict[str, list] = {}
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path.endswith("/readiness"):
                    if fake.replicas is None:
                        return fake._json(self, 404, {"error": {"message": "File Not Found"}})
                    healthy, total = fake.replicas
                    status = {"status": "ready" if healthy else "not ready"}
                    ready = {"healthy_workers": healthy, "total_workers": total}
                    return fake._json(self, 200 if healthy else 503, status | ready)
                if self.path.endswith("/props"):
                    if not fake.llama_slots:
                        return fake._json(self, 404, {"error": {"message": "File Not Found"}})
                    settings = {"n_ctx": fake.context}
                    return fake._json(
                        self, 200, {"total_slots": fake.llama_slots, "default_generation_settings": settings}
                    )
                fake._json(self, 200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake._lock:
                    fake.requests.append((body, dict(self.headers)))
                fake._complete(self, body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    @property
    def completions(self) -> list[tuple[dict, dict]]:
        """The streamed requests (the capability probes left out)."""
        return [(b, h) for b, h in self.requests if b.get("stream")]

    # ---- the server side
    def _json(self, h, status: int, data) -> None:
        raw = json.dumps(data).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(raw)))
        h.end_headers()
        h.wfile.write(raw)

    def _complete(self, h, body: dict) -> None:
        prompt = body["prompt"]
        if self.strict and set(body) - OPENAI_FIELDS:
            return self._json(h, 400, {"detail": f"Unexpected fields in the request: {set(body) - OPENAI_FIELDS}"})
        if isinstance(prompt, list) and not self.takes_ids:
            return self._json(h, 400, {"detail": "prompt must be a string."})
        if body.get("stream") and self.statuses:
            return self._json(h, self.statuses.pop(0), {"error": {"message": "try later"}})
        ids = prompt if isinstance(prompt, list) else encode(prompt)
        if len(ids) > self.context:
            message = f"This model's maximum context length is {self.context} tokens. However, you requested more."
            return self._json(h, 400, {"error": {"message": message, "type": "BadRequestError"}})
        user = f"slot {body['id_slot']}" if self.llama_slots and "id_slot" in body else body.get("user", "")
        before = self._last.get(user, [])
        cached = next((i for i, (a, b) in enumerate(zip(before, ids)) if a != b), min(len(before), len(ids)))
        self._last[user] = list(ids)
        pieces = [self.reply[i : i + 3] for i in range(0, len(self.reply), 3)][: body["max_tokens"]]
        finish = "length" if len(pieces) * 3 >= body["max_tokens"] and body["max_tokens"] < len(self.reply) else "stop"
        if not body.get("stream"):
            first = {"text": pieces[0] if pieces else "", "finish_reason": finish}
            if self.logprobs and body.get("logprobs"):
                first["logprobs"] = self._logprobs(first["text"], body["logprobs"])
            return self._json(h, 200, {"choices": [first]})
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            h.send_response(200)
            h.send_header("Content-Type", "text/event-stream")
            h.end_headers()
            time.sleep(self.stall_s)
            for n, piece in enumerate(pieces):
                if self.cut_after is not None and n >= self.cut_after:
                    return  # the connection closes with no finish and no [DONE]
                choice = {"index": 0, "text": piece, "finish_reason": None}
                if body.get("return_token_ids") and self.sends_ids:
                    choice["token_ids"] = encode(piece)
                if self.logprobs and body.get("logprobs"):
                    choice["logprobs"] = self._logprobs(piece, body["logprobs"])
                self._event(h, {"choices": [choice]})
                time.sleep(self.delay_s)
            if self.eos and finish == "stop":
                self._event(h, {"choices": [{"index": 0, "text": self.eos, "finish_reason": None}]})
                time.sleep(self.last_delay_s)
            usage = {"prompt_tokens": len(ids), "completion_tokens": len(pieces)}
            if self.report_cache:
                usage["prompt_tokens_details"] = {"cached_tokens": cached}
            self._event(h, {"choices": [{"index": 0, "text": "", "finish_reason": finish}], "usage": usage})
            h.wfile.write(b"data: [DONE]\n\n")
            h.wfile.flush()
        except OSError:
            with self._lock:
                self.gone += 1
        finally:
            with self._lock:
                self.in_flight -= 1
            h.close_connection = True

    @staticmethod
    def _logprobs(text: str, n: int) -> dict:
        """llama.cpp's shape: a token per character here, its log-probability -0.25, and `n`
        alternatives (the token itself first, then the next characters)."""
        return {
            "content": [
                {
                    "id": ord(c),
                    "token": c,
                    "logprob": -0.25,
                    "top_logprobs": [
                        {"id": ord(c) + k, "token": chr(ord(c) + k), "logprob": -0.25 - k} for k in range(n)
                    ],
                }
                for c in text
            ]
        }

    def _event(self, h, data: dict) -> None:
        h.wfile.write(b"data: " + json.dumps(data).encode() + b"\n\n")
        h.wfile.flush()
