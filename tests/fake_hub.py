"""A tiny in-memory Hugging Face Hub on a local HTTP port, for upload and download tests without a network.

It implements just the endpoints `huggingface_hub` calls to create a repo and a branch, list files,
validate a card, pre-upload (every file "regular", so the commit carries the bytes) and commit, and
to download (repo info, tree, resolve). Every request is recorded. Loaded by the `fake_hub` fixture
in tests/conftest.py.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import yaml

_REPO = r"(?P<repo>[^/]+/[^/]+)"
_API = re.compile(
    rf"^/api/models/{_REPO}/(?P<op>revision|tree|preupload|commit|branch)/(?P<rev>[^/?]+)(?P<rest>/.*)?$"
)
_RESOLVE = re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


@dataclass
class Repo:
    private: bool
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit sha
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> {path: bytes}

    def files(self, rev: str) -> dict[str, bytes] | None:
        return self.commits.get(self.branches.get(rev, rev))


class FakeHub:
    """`with FakeHub() as hub:` serves on hub.url; hub.repos, hub.requests, hub.commits for assertions."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, dict[str, str]]] = []  # (method, path, lower-case headers)
        self.commits: list[dict] = []  # {"repo", "revision", "header", "files": {path: bytes}, "deleted"}
        self.token: str | None = None  # set it to answer 401 to requests without this bearer token
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def commit(self, repo_id: str, rev: str, files: dict[str, bytes]) -> str:
        repo = self.repos[repo_id]
        sha = hashlib.sha1(json.dumps([repo_id, rev, len(repo.commits)]).encode()).hexdigest()
        repo.commits[sha] = files
        repo.branches[rev] = sha
        return sha


def _blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def _send(self, status: int, body: object = None, headers: dict | None = None, head: bool = False):
            if isinstance(body, str):  # an error message, shaped like the Hub's
                body = {"error": body}
            data = body if isinstance(body, bytes) else json.dumps(body if body is not None else {}).encode()
            self.send_response(status)
            for key, value in {"Content-Length": str(len(data)), **(headers or {})}.items():
                self.send_header(key, value)
            self.end_headers()
            if not head:
                self.wfile.write(data)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _record(self) -> str | None:
            """The request path (recorded), or None after answering 401 to a wrong token."""
            path = urlsplit(self.path).path
            hub.requests.append((self.command, path, {k.lower(): v for k, v in self.headers.items()}))
            if hub.token and self.headers.get("Authorization") != f"Bearer {hub.token}":
                self._send(401, "Invalid credentials in Authorization header", head=self.command == "HEAD")
                return None
            return path

        def do_POST(self) -> None:
            body = self._body()
            if (path := self._record()) is None:
                return None
            if path == "/api/repos/create":
                req = json.loads(body)
                repo_id = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
                if repo_id in hub.repos:
                    return self._send(409, {"error": "You already created this model repo", "url": repo_id})
                hub.repos[repo_id] = Repo(private=req.get("visibility") == "private")
                hub.commit(repo_id, "main", {".gitattributes": b"*.safetensors filter=lfs\n"})
                return self._send(200, {"url": f"{hub.url}/{repo_id}"})
            if path == "/api/validate-yaml":
                text = json.loads(body)["content"]
                try:
                    yaml.safe_load(text.split("---")[1])
                except (IndexError, yaml.YAMLError) as err:
                    return self._send(400, {"errors": [{"message": str(err)}]})
                return self._send(200, {"errors": [], "warnings": []})
            match = _API.match(path)
            if not match or match["repo"] not in hub.repos:
                return self._send(404, "repo not found", {"X-Error-Code": "RepoNotFound"})
            repo, rev = hub.repos[match["repo"]], unquote(match["rev"])
            if match["op"] == "branch":
                if rev in repo.branches:
                    return self._send(409, "branch exists")
                repo.branches[rev] = repo.branches["main"]
                return self._send(200, {})
            if match["op"] == "preupload":
                files = [
                    {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                    for f in json.loads(body)["files"]
                ]
                return self._send(200, {"files": files})
            if match["op"] == "commit":
                return self._commit(match["repo"], repo, rev, body)
            return self._send(404, "unknown endpoint")

        def _commit(self, repo_id: str, repo: Repo, rev: str, body: bytes) -> None:
            if repo.files(rev) is None:
                return self._send(404, "revision not found", {"X-Error-Code": "RevisionNotFound"})
            lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
            header = next(x["value"] for x in lines if x["key"] == "header")
            added = {
                x["value"]["path"]: base64.b64decode(x["value"]["content"])
                for x in lines
                if x["key"] == "file"
            }
            deleted = [x["value"]["path"] for x in lines if x["key"] == "deletedFile"]
            files = {p: b for p, b in repo.files(rev).items() if p not in deleted}
            files.update(added)
            sha = hub.commit(repo_id, rev, files)
            hub.commits.append(
                {"repo": repo_id, "revision": rev, "header": header, "files": added, "deleted": deleted}
            )
            return self._send(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/{sha}", "commitOid": sha})

        def do_GET(self) -> None:
            self._get(head=False)

        def do_HEAD(self) -> None:
            self._get(head=True)

        def _get(self, head: bool) -> None:
            if (path := self._record()) is None:
                return None
            match = _API.match(path) or _RESOLVE.match(path)
            if not match or match["repo"] not in hub.repos:
                return self._send(404, "repo not found", {"X-Error-Code": "RepoNotFound"}, head)
            repo, rev = hub.repos[match["repo"]], unquote(match["rev"])
            files = repo.files(rev)
            if files is None:
                return self._send(404, "revision not found", {"X-Error-Code": "RevisionNotFound"}, head)
            sha = repo.branches.get(rev, rev)
            if "path" in match.groupdict():  # resolve: the file itself
                name = unquote(match["path"])
                if name not in files:
                    return self._send(404, "entry not found", {"X-Error-Code": "EntryNotFound"}, head)
                data = files[name]
                return self._send(200, data, {"X-Repo-Commit": sha, "ETag": f'"{_blob_oid(data)}"'}, head)
            if match["op"] == "revision":
                info = {"id": match["repo"], "sha": sha, "private": repo.private,
                        "siblings": [{"rfilename": p} for p in sorted(files)]}  # fmt: skip
                return self._send(200, info, head=head)
            if match["op"] == "tree":
                prefix = unquote((match["rest"] or "/")[1:])
                entries = [{"type": "file", "path": p, "size": len(b), "oid": _blob_oid(b)}
                           for p, b in sorted(files.items()) if p.startswith(prefix)]  # fmt: skip
                return self._send(200, entries, head=head)
            return self._send(404, "unknown endpoint", head=head)

    return Handler
