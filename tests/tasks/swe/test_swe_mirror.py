"""The per-host mirror of an https repository against a real git server: ``git http-backend``
(git's own smart-HTTP server) behind TLS on loopback. Concurrent inits clone once; a commit the
mirror lacks refreshes it; the clone runs as ``repo_clone_uid`` when the worker is root.

The only change to the worker is the CA it trusts (``GIT_SSL_CAINFO`` beside the cleared
environment): the server's certificate is made here.
"""
from __future__ import annotations

import http.server
import os
import shutil
import ssl
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from tasks.swe import repo

GIT_ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid",
           "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1"}
pytestmark = pytest.mark.skipif(shutil.which("openssl") is None or shutil.which("git") is None,
                                reason="needs openssl and git")


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, env=GIT_ENV, check=True, capture_output=True,
                          text=True).stdout.strip()


class GitBackend(http.server.BaseHTTPRequestHandler):
    """CGI glue for ``git http-backend``; counts the clones and fetches it serves."""

    root: Path
    served: list[str]

    def log_message(self, *args) -> None:
        pass

    def _cgi(self) -> None:
        path, _, query = self.path.partition("?")
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        env = {"PATH": os.environ["PATH"], "GIT_PROJECT_ROOT": str(self.root), "GIT_HTTP_EXPORT_ALL": "1",
               "PATH_INFO": path, "QUERY_STRING": query, "REQUEST_METHOD": self.command,
               "CONTENT_TYPE": self.headers.get("Content-Type", ""), "CONTENT_LENGTH": str(len(body)),
               "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
               "HTTP_GIT_PROTOCOL": self.headers.get("Git-Protocol", "")}
        if self.headers.get("Content-Encoding"):
            env["HTTP_CONTENT_ENCODING"] = self.headers["Content-Encoding"]
        done = subprocess.run(["git", "http-backend"], input=body, env=env, capture_output=True, timeout=60)
        head, _, payload = done.stdout.partition(b"\r\n\r\n")
        headers = [line.split(":", 1) for line in head.decode().split("\r\n") if ":" in line]
        status = next((int(v.split()[0]) for k, v in headers if k.lower() == "status"), 200)
        if path.endswith("/info/refs"):  # once per clone or fetch (v2 then POSTs ls-refs and fetch)
            self.served.append(path)
        self.send_response(status)
        for key, value in headers:
            if key.lower() != "status":
                self.send_header(key, value.strip())
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = _cgi


@pytest.fixture
def https_repo(tmp_path, monkeypatch):
    """A repository served over https on loopback, the worker trusting its certificate, and
    the worker's cache in tmp_path. Yields (url, work tree, commits served)."""
    from config.settings import get_settings

    public = Path(tempfile.mkdtemp(prefix="prorl-https-git-"))  # readable by repo_clone_uid
    public.chmod(0o755)
    cert, key = public / "cert.pem", public / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    cert.chmod(0o644)
    work = tmp_path / "work"
    work.mkdir()
    _git(work, "init", "-q", "-b", "main")
    (work / "a.txt").write_text("one\n")
    _git(work, "add", "-A")
    _git(work, "commit", "-q", "-m", "one")
    served = tmp_path / "served"
    served.mkdir()
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(served / "r.git")], check=True, env=GIT_ENV)
    handler = type("Handler", (GitBackend,), {"root": served, "served": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    real_env = repo._env
    monkeypatch.setattr(repo, "_env", lambda home: {**real_env(home), "GIT_SSL_CAINFO": str(cert)})
    monkeypatch.setenv("PRORL_REPO_CACHE", str(tmp_path / "cache"))
    get_settings.cache_clear()
    yield f"https://127.0.0.1:{server.server_address[1]}/r.git", work, served, handler.served
    server.shutdown()
    get_settings.cache_clear()
    shutil.rmtree(public, ignore_errors=True)


def test_concurrent_inits_clone_once_and_a_missing_commit_refreshes(https_repo):
    url, work, served, requests_served = https_repo
    first = _git(work, "rev-parse", "HEAD")
    instance = {"repo": "t/r", "repo_source": url, "base_commit": first}
    paths: list[Path] = []
    threads = [threading.Thread(target=lambda: paths.append(repo.commit_pack(instance))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(paths) == 3 and len(set(paths)) == 1 and len(requests_served) == 1, requests_served
    mirror = next((Path(os.environ["PRORL_REPO_CACHE"])).glob("*.git"))
    assert (mirror / "HEAD").exists() and not (mirror / "a.txt").exists()  # bare
    if os.geteuid() == 0:
        assert mirror.stat().st_uid == repo.clone_uid()  # cloned as the unprivileged uid
    # the served repository moves on: the mirror lacks the new commit and is refreshed once
    (work / "a.txt").write_text("two\n")
    _git(work, "commit", "-q", "-am", "two")
    _git(work, "push", "-q", str(served / "r.git"), "main")
    second = _git(work, "rev-parse", "HEAD")
    repo.commit_pack({**instance, "base_commit": second})
    repo.commit_pack({**instance, "base_commit": first})  # cached: no request
    assert len(requests_served) == 2
    objects = subprocess.run(["git", "verify-pack", "-v", str(repo.commit_pack({**instance, "base_commit": second}))],
                             capture_output=True, text=True, check=True).stdout
    assert second in objects and first not in objects  # the commit alone, not its parent
    with pytest.raises(Exception, match="not in"):
        repo.commit_pack({**instance, "base_commit": "2" * 40})
