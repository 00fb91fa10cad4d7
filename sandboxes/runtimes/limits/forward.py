"""TCP ports of one sandbox's network namespace reached from another's: the helper the sandbox
host runs per forward (:mod:`sandboxes.host.forward`). Standard library only; run as
``python3 -I forward.py SPEC`` by the host, never inside a sandbox.

It opens a listener on 127.0.0.1:PORT for each port in the *listening* namespace (a short-lived
child enters it, binds, and passes the sockets back over a socketpair), then enters the *target*
namespace itself and splices each accepted connection to 127.0.0.1:PORT there. The listening
sandbox gets a socket it can connect to and nothing else: no interface, no route, no address of
the target's (whose own network, if it has one, stays its own). A root host enters a namespace
directly and then drops to ``nobody`` (connecting to a loopback port needs no privilege); a
rootless host enters the namespace's user namespace first, as its owner.

It exits when the host closes the write end of its exit pipe (the forward is closed, or the host
died, a kill -9 included). At most :data:`MAX_CONNECTIONS` connections at once.

SPEC is JSON: ``{"listen_fd": N, "target_fd": M, "ports": [...], "ready_fd": R, "exit_fd": E}``;
``ready_fd`` gets ``1`` once every listener is bound, or the error's text.
"""
import ctypes
import encodings.idna  # noqa: F401 - socket addresses are encoded with it, lazily: loaded while this Python's library is readable
import fcntl
import json
import os
import socket
import sys
import threading

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
NS_GET_USERNS = 0xB701
PR_SET_NO_NEW_PRIVS = 38
NOBODY = 65534
MAX_CONNECTIONS = 256
CONNECT_TIMEOUT_S = 10.0
CHUNK = 65536

_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int, kind: int) -> None:
    if _libc.setns(fd, kind) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def enter(netns_fd: int) -> None:
    """Join the network namespace ``netns_fd`` (as its user namespace's owner when not root)."""
    if os.geteuid() != 0:
        userns = fcntl.ioctl(netns_fd, NS_GET_USERNS)
        try:
            _setns(userns, CLONE_NEWUSER)
        finally:
            os.close(userns)
    _setns(netns_fd, CLONE_NEWNET)


def listeners(netns_fd: int, ports: list[int]) -> list[socket.socket]:
    """Listening sockets on 127.0.0.1 at ``ports``, made inside ``netns_fd`` by a child."""
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the child: enter, bind, hand the sockets over, exit
        code = 1
        try:
            ours.close()
            enter(netns_fd)
            made = []
            for port in ports:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("127.0.0.1", port))
                sock.listen(128)
                made.append(sock)
            socket.send_fds(theirs, [b"ok"], [s.fileno() for s in made])
            code = 0
        except BaseException as exc:  # noqa: BLE001 - said to the parent, whatever it is
            try:
                theirs.sendall(f"{type(exc).__name__}: {exc}".encode()[:1000])
            except OSError:
                pass
        finally:
            os._exit(code)
    theirs.close()
    try:
        message, fds, _flags, _addr = socket.recv_fds(ours, 4096, len(ports))
    finally:
        ours.close()
        os.waitpid(pid, 0)
    if message != b"ok" or len(fds) != len(ports):
        for fd in fds:
            os.close(fd)
        raise OSError(f"listening in the sandbox's namespace failed: {message.decode(errors='replace') or 'no answer'}")
    return [socket.socket(fileno=fd) for fd in fds]


def drop_privileges() -> None:
    if os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
    _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(CHUNK)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _splice(client: socket.socket, port: int, slots: threading.BoundedSemaphore) -> None:
    try:
        try:
            upstream = socket.create_connection(("127.0.0.1", port), timeout=CONNECT_TIMEOUT_S)
        except OSError:
            return  # nothing listens there (yet): the client sees its connection closed
        upstream.settimeout(None)
        with upstream:
            back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
            back.start()
            _pump(client, upstream)
            back.join()
    finally:
        client.close()
        slots.release()


def _serve(listener: socket.socket, port: int, slots: threading.BoundedSemaphore) -> None:
    while True:
        client, _ = listener.accept()
        if not slots.acquire(blocking=False):
            client.close()
            continue
        threading.Thread(target=_splice, args=(client, port, slots), daemon=True).start()


def main(spec: dict) -> None:
    ready = spec["ready_fd"]
    try:
        socks = listeners(spec["listen_fd"], spec["ports"])
        enter(spec["target_fd"])
        os.close(spec["listen_fd"])
        os.close(spec["target_fd"])
        drop_privileges()
    except BaseException as exc:  # noqa: BLE001 - the host reads it from the ready pipe
        os.write(ready, f"{type(exc).__name__}: {exc}".encode()[:1000])
        sys.exit(1)
    slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
    for sock, port in zip(socks, spec["ports"]):
        threading.Thread(target=_serve, args=(sock, port, slots), daemon=True).start()
    os.write(ready, b"1")
    os.close(ready)
    while os.read(spec["exit_fd"], 1):  # end of file: the host closed the forward, or died
        pass


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
