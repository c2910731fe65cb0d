"""A stand-in for the Hugging Face Hub (stdlib `http.server` in a thread) for the download tests: the
calls huggingface_hub 2.4.0 makes for `HfApi.model_info(files_metadata=True)`, `get_hf_file_metadata`
(HEAD) and `file_download.http_get` (GET, with Range to resume), answered as the Hub answers them.

- `GET /api/models/<owner>/<name>[/revision/<rev>]`: the repo (`id`, `sha`, `siblings` with `size`,
  `blobId` and, for weights, `lfs` {`size`, `sha256`, `pointerSize`}).
- `HEAD|GET /<owner>/<name>/resolve/<rev>/<path>`: a small file answers itself (`ETag` = its git blob
  id, `X-Repo-Commit`, `Content-Length`); a weights file (.gguf, .safetensors, .bin) answers 302 to
  `http://localhost:<port>/cdn/<sha256>` with `X-Linked-Etag`, `X-Linked-Size`, `X-Repo-Commit`, as the
  Hub does for LFS files (another host than 127.0.0.1: huggingface_hub takes the metadata from the 302).
- `HEAD|GET /cdn/<sha256>`: the bytes; `Range: bytes=N-` gets 206 with `Content-Range`.
- Errors with the Hub's `X-Error-Code`: RepoNotFound (401 without a token, 404 with one),
  RevisionNotFound, EntryNotFound, GatedRepo (401 without a token, 403 with a token but not the repo's).

Knobs: `cut_after` (the next /cdn GET sends that many body bytes, then drops the connection), `then_down`
(after that cut, every request gets 503 until `down` is set False), `not_a_hub` (HTML for every request,
as a captive portal answers). Counters: `served` (body bytes sent by /cdn GETs), `requests` ((method,
path, headers) of each request).
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".gguf", ".safetensors", ".bin")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    files: dict[str, bytes]
    gated_token: str = ""  # set: the repo is gated and only this token may fetch its files
    commit: str = ""

    def is_lfs(self, name: str) -> bool:
        return name.endswith(LFS_SUFFIXES)

    def sibling(self, name: str) -> dict:
        data = self.files[name]
        size = len(data)
        if not self.is_lfs(name):
            return {"rfilename": name, "size": size, "blobId": git_blob_id(data)}
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\n"
        lfs = {"size": size, "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": len(pointer)}
        return {"rfilename": name, "size": size, "blobId": git_blob_id(pointer.encode()), "lfs": lfs}


class FakeHub:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.blobs: dict[str, bytes] = {}
        self.cut_after: int | None = None
        self.then_down = False
        self.down = False
        self.not_a_hub = False
        self.served = 0
        self.requests: list[tuple[str, str, dict]] = []
        self._lock = threading.Lock()
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add(self, repo_id: str, files: dict[str, bytes], *, gated_token: str = "") -> Repo:
        commit = hashlib.sha1(repo_id.encode() + b"".join(sorted(files.values()))).hexdigest()
        repo = Repo(dict(files), gated_token, commit)
        self.repos[repo_id] = repo
        for data in files.values():
            self.blobs[hashlib.sha256(data).hexdigest()] = data
        return repo

    def count(self, method: str, prefix: str) -> int:
        return sum(1 for m, p, _ in self.requests if m == method and p.startswith(prefix))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: FakeHub

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._route(body=False)

    def do_GET(self) -> None:
        self._route(body=True)

    # -- routing ---------------------------------------------------------------------------------

    def _route(self, body: bool) -> None:
        hub = self.hub
        path = urlsplit(self.path).path
        with hub._lock:
            hub.requests.append((self.command, path, dict(self.headers)))
        if hub.down:
            return self._error(503, "", "Service unavailable", body)
        if hub.not_a_hub:
            return self._send(200, b"<html>a captive portal</html>", {"Content-Type": "text/html"}, body)
        parts = [unquote(p) for p in path.split("/")[1:]]
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            return self._api(parts[2] + "/" + parts[3], parts[5] if len(parts) == 6 else "main", body)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(parts[0] + "/" + parts[1], parts[3], "/".join(parts[4:]), body)
        if len(parts) == 2 and parts[0] == "cdn" and parts[1] in hub.blobs:
            return self._cdn(hub.blobs[parts[1]], body)
        self._error(404, "", "Not found", body)

    def _token(self) -> str:
        auth = self.headers.get("authorization", "")
        return auth[len("Bearer ") :] if auth.startswith("Bearer ") else ""

    def _repo(self, repo_id: str, revision: str, body: bool) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404 if self._token() else 401, "RepoNotFound", "Repository not found", body)
            return None
        if revision not in ("main", repo.commit):
            self._error(404, "RevisionNotFound", "Invalid rev id", body)
            return None
        return repo

    def _api(self, repo_id: str, revision: str, body: bool) -> None:
        repo = self._repo(repo_id, revision, body)
        if repo is not None:
            info = {
                "id": repo_id,
                "sha": repo.commit,
                "private": False,
                "gated": "manual" if repo.gated_token else False,
                "siblings": [repo.sibling(n) for n in repo.files],
            }
            self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)

    def _resolve(self, repo_id: str, revision: str, name: str, body: bool) -> None:
        repo = self._repo(repo_id, revision, body)
        if repo is None:
            return
        if repo.gated_token and self._token() != repo.gated_token:
            code = 403 if self._token() else 401
            return self._error(code, "GatedRepo", "Access to this model is restricted", body)
        if name not in repo.files:
            return self._error(404, "EntryNotFound", "Entry not found", body)
        data = repo.files[name]
        headers = {"X-Repo-Commit": repo.commit}
        if not repo.is_lfs(name):
            headers["ETag"] = f'"{git_blob_id(data)}"'
            return self._send(200, data, headers, body)
        sha = hashlib.sha256(data).hexdigest()
        headers |= {
            "ETag": f'"{repo.sibling(name)["blobId"]}"',
            "X-Linked-Etag": f'"{sha}"',
            "X-Linked-Size": str(len(data)),
            "Location": f"http://localhost:{self.hub.port}/cdn/{sha}",
        }
        self._send(302, b"", headers, body)

    def _cdn(self, data: bytes, body: bool) -> None:
        start = 0
        rng = self.headers.get("Range", "")
        if rng.startswith("bytes=") and rng.endswith("-"):
            start = int(rng[len("bytes=") : -1])
        part = data[start:]
        headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "Accept-Ranges": "bytes"}
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        hub = self.hub
        if body and hub.cut_after is not None:
            part, cut = part[: hub.cut_after], True
            hub.cut_after = None
        else:
            cut = False
        self._send(206 if start else 200, part, headers, body, length=len(data) - start)
        if body:
            with hub._lock:
                hub.served += len(part)
        if cut:  # the connection drops mid-body
            hub.down = hub.then_down
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)

    # -- answers -----------------------------------------------------------------------------------

    def _send(self, code: int, data: bytes, headers: dict, body: bool, length: int | None = None) -> None:
        self.send_response(code)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data) if length is None else length))
        self.end_headers()
        if body and data:
            self.wfile.write(data)
            self.wfile.flush()

    def _error(self, code: int, error_code: str, message: str, body: bool) -> None:
        headers = {"X-Error-Message": message, "Content-Type": "application/json"}
        if error_code:
            headers["X-Error-Code"] = error_code
        self._send(code, json.dumps({"error": message}).encode(), headers, body)
