"""The in-sandbox forwarder: the sandbox's own loopback port -> its session's gateway socket.

A harness speaks HTTP to a TCP address; a sandbox without a network has only its own loopback.
This file is copied into the sandbox and run there by the system's ``python3 -I`` (standard
library only, nothing of the service): it listens on ``127.0.0.1:PORT`` inside the sandbox and
pipes each connection to the unix socket bound in from the host. It knows no credential: the
harness sends the session's own.

    python3 -I forward.py PORT SOCKET READY_FILE
"""
import os
import socket
import sys
import threading


def pipe(src, dst):
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for sock, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                sock.shutdown(how)
            except OSError:
                pass


def serve(client, path):
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(path)
    except OSError:
        client.close()
        upstream.close()
        return
    back = threading.Thread(target=pipe, args=(upstream, client), daemon=True)
    back.start()
    pipe(client, upstream)
    back.join()
    client.close()
    upstream.close()


def main():
    port, path, ready = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:  # a socket this sandbox cannot reach fails here, said plainly, not as a reset connection later
        probe.connect(path)
    except OSError as exc:
        sys.exit(f"the session's gateway socket {path} cannot be reached: {exc}")
    finally:
        probe.close()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    with open(ready, "w") as out:
        out.write(str(listener.getsockname()[1]))
    os.set_inheritable(listener.fileno(), False)
    while True:
        client, _ = listener.accept()
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=serve, args=(client, path), daemon=True).start()


if __name__ == "__main__":
    main()
