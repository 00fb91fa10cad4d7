"""What the gateway-framing attacks of tests/security/test_hostile_harness.py run inside a sandbox
(standard library only: a ``command`` harness's ``python3 -I``), and how the test looks at the
processes they aim at."""
from __future__ import annotations

import json
import os
import subprocess

import psutil

# Opens argv[1] connections to the socket argv[2] (the session's own, or a relay's) and sends
# nothing; once they are open, starts `sleep <argv[3] + 0.25>` (what the test waits to see: see
# :func:`opened`) and, if argv[5]
# is given, asks that socket's /v1/models with the credential argv[6] (another session's: it
# must be answered). Holds until the file argv[4] exists, then says how many of its connections
# the far side still held open (a closed one reads its end, or a refusal, at once).
HOLD = r'''
import json, os, resource, socket, subprocess, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
want, path, marker, gate = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
socks, failed = [], 0
for _ in range(want):
    s = socket.socket(socket.AF_UNIX)  # a blocking connect: it waits for room in the backlog
    try:
        s.connect(path)
        socks.append(s)
    except OSError:
        s.close()
        failed += 1
out = {"opened": len(socks), "failed": failed}
sleeper = subprocess.Popen(["sleep", str(float(marker) + 0.25)])  # not in any command line before
if len(sys.argv) > 6:
    t = socket.socket(socket.AF_UNIX); t.settimeout(30)
    try:
        t.connect(sys.argv[5])
        t.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer "
                  + sys.argv[6].encode() + b"\r\n\r\n")
        data = b""
        while chunk := t.recv(65536):
            data += chunk
        out["other"] = data.split(b" ", 2)[1].decode()
    except OSError as exc:
        out["other"] = type(exc).__name__
for _ in range(1800):
    if os.path.exists(gate):
        break
    time.sleep(0.1)
sleeper.kill()
time.sleep(1)
held = 0
for s in socks:
    s.setblocking(False)
    try:
        s.recv(1)
    except BlockingIOError:
        held += 1
    except OSError:
        pass
out["held"] = held
print("HOLD", json.dumps(out))
'''

# Three requests on the session's own socket, each pushing 256 MB of body in 1 MB pieces:
# chunked without a credential, chunked with it (one chunk announcing all 256 MB), and with a
# Content-Length of 256 MB. Prints how much each pushed before the gateway stopped it, and the
# status it answered ("none": the connection ended without one).
PUSH = r'''
import json, os, socket, sys
path, key = os.environ["PRORL_GATEWAY_SOCKET"], os.environ["OPENAI_API_KEY"]
TOTAL, piece = 256 << 20, b"x" * (1 << 20)
def push(head, tail=b""):
    s = socket.socket(socket.AF_UNIX); s.settimeout(30)
    s.connect(path)
    sent = 0
    try:
        s.sendall(head)
        while sent < TOTAL:
            s.sendall(piece)
            sent += len(piece)
        s.sendall(tail)
    except OSError:
        pass
    try:
        answer = s.recv(65536)
    except OSError:
        answer = b""
    s.close()
    return {"sent_mb": sent >> 20, "status": answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else "none"}
post = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
auth = b"Authorization: Bearer " + key.encode() + b"\r\n"
chunked = b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % TOTAL
out = {"anonymous": push(post + chunked, b"\r\n0\r\n\r\n"),
       "chunked": push(post + auth + chunked, b"\r\n0\r\n\r\n"),
       "length": push(post + auth + b"Content-Length: %d\r\n\r\n" % TOTAL)}
print("PUSH", json.dumps(out))
'''


def script(name: str, code: str, *args: str) -> str:
    """``code`` as a command line run by the sandbox's ``python3 -I`` with ``args``."""
    return f"python3 -I - {' '.join(args)} <<'{name}'\n{code}\n{name}"


def reported(output: str, tag: str) -> dict:
    line = next((x for x in output.splitlines() if x.startswith(tag + " ")), None)
    assert line is not None, output
    return json.loads(line.split(" ", 1)[1])


def threads_of(pids: list[int]) -> int:
    """Threads of these processes and their children (a Celery worker's pool is its children)."""
    total = 0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            total += proc.num_threads() + sum(c.num_threads() for c in proc.children(recursive=True)
                                              if c.name().startswith("python"))
        except psutil.NoSuchProcess:
            continue
    return total


def opened(marker: str) -> bool:
    """Whether :data:`HOLD`, given ``marker``, has its connections open."""
    return running(str(float(marker) + 0.25))


def running(marker: str) -> bool:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                return True
        except OSError:
            continue
    return False


def listen_backlog(path: str) -> int:
    """The listen backlog of the unix socket bound at ``path`` (``ss``'s Send-Q of a listener)."""
    out = subprocess.run(["ss", "-xlnH"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        fields = line.split()
        if path in fields:
            return int(fields[3])
    raise AssertionError(f"no listener at {path} in:\n{out}")
