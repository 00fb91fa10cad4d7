"""A network sandbox's own network: its namespace, user-mode networking, an outbound policy.

``"network": true`` never means the host's network. bwrap gives every sandbox a fresh network
namespace (``--unshare-all``); for a network sandbox the host then, before the sandbox is handed
out (its shell has answered one ``:`` and reads nothing else until the host returns):

1. writes an nftables table into that namespace (``nsenter --net=<fd> nft -f -``, as root or as
   the owner of the sandbox's user namespace) that rejects every packet to the host's loopback,
   the private, shared, link-local, multicast and reserved IPv4 ranges, the host's own addresses
   and on-link subnets, the operator's ``sandbox_network_deny`` and all of IPv6, except DNS to
   slirp's resolver at 10.0.2.3. The rules go in before there is any interface to send on.
2. starts ``slirp4netns --configure --disable-host-loopback`` on a tap device in that namespace,
   with ``--ready-fd`` (the sandbox is not returned before the network is up) and ``--exit-fd``
   (the read end of a pipe whose only write end the host holds, so slirp4netns exits when the
   sandbox is closed and when the host dies, a kill -9 included; no pid-file, no reaper).
3. binds a ``resolv.conf`` naming 10.0.2.3 over the sandbox's ``/etc/resolv.conf``: slirp's
   resolver forwards to the host's own resolvers, so names resolve where the outside is reachable.

Why rules inside the sandbox's namespace rather than slirp4netns as a dedicated uid filtered by
``-m owner`` on the host: the table lives and dies with the sandbox's namespace, touches no global
firewall state (no conflict with Docker's or the operator's rules, nothing to clean up after a
crash) and needs no extra uid range. The sandbox cannot remove it: bwrap drops every capability
(``--cap-drop ALL``, no nested user namespaces), and ``CAP_NET_ADMIN`` over its namespace is
needed even to list the rules. Measured on the 2-core test machine (shared with other test runs):
the table and slirp4netns's readiness together take 9-20 ms; a cold create through the sandbox
host, p50 of 20, is 12 ms plain and 21-24 ms with the network (``bench/action_latency.py``:
11.8 vs 23.8 ms; with the per-sandbox cgroups and workspace filesystem being added beside this,
67-78 vs 88-109 ms). What is not
covered: a host address added after the sandbox started, destinations beyond the host's own
subnets that only the host may reach (list them in ``PRORL_SANDBOX_NETWORK_DENY``), and the CPU
slirp4netns spends for the sandbox's traffic (it is not in the sandbox's cgroup).

slirp4netns runs as the host's user with ``--enable-sandbox`` (its own empty mount namespace, all
capabilities dropped but ``CAP_NET_BIND_SERVICE``) and ``--enable-seccomp``. It is not run as the
sandbox's uid because ``/dev/net/tun`` is root-only on some hosts (here: mode 0600). As root it
starts in a private mount namespace (``unshare --mount``): its sandbox makes only ``/`` private and
``/run`` a slave, so where ``/run`` is not a mount point of its own a shared mount beneath it
(``/run/netns``, where ``ip netns`` keeps its namespaces) stayed shared, and detaching its old
root unmounted every ``ip netns`` namespace's mount on the host (seen: each network sandbox's
start took the names of the host's namespaces away).
"""
from __future__ import annotations

import atexit
import fcntl
import functools
import ipaddress
import os
import shutil
import subprocess
import tempfile
import time
from typing import Any

from prorl_celery.errors import PolicyDenied, SandboxError
from prorl_celery.spawn import spawn
from sandboxes.policy import NETWORK_OFF
from sandboxes.runtimes.procs import readable

HELPER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HELPER_ENV = {"PATH": HELPER_PATH, "LANG": "C.UTF-8"}  # what host-side helpers start with
SLIRP_DNS = "10.0.2.3"
TAP = "tap0"
READY_TIMEOUT_S = 10.0
_NS_GET_USERNS = 0xB701  # ioctl: the user namespace owning a namespace

# Never reachable from a sandbox: "this" network, private, CGNAT, loopback, link-local, IETF
# protocol assignments, benchmarking, multicast and reserved (broadcast included).
DENIED_V4 = ("0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
             "172.16.0.0/12", "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/3")


def _settings():
    from config.settings import get_settings

    return get_settings()


def tool(name: str) -> str | None:
    """A helper binary from the trusted system path (never from a request's or the caller's PATH)."""
    return shutil.which(name, path=HELPER_PATH)


def refusal() -> str | None:
    """Why this node cannot give a sandbox an isolated network, or None when it can."""
    if _settings().sandbox_network == "off":
        return NETWORK_OFF
    needed = ("slirp4netns", "nft", "nsenter") + (("unshare",) if os.geteuid() == 0 else ())
    missing = [name for name in needed if not tool(name)]
    if missing:
        return (f"a network sandbox needs {', '.join(missing)} on the sandbox host and they are "
                "missing (scripts/install-system-deps.sh installs slirp4netns and nftables); "
                "the host's own network is never used instead")
    return None


def require_network(field: str = "spec.network") -> None:
    """Raise unless a network sandbox can be made here: :class:`PolicyDenied` when the operator
    turned them off, :class:`SandboxError` when a tool is missing."""
    why = refusal()
    if why and _settings().sandbox_network == "off":
        raise PolicyDenied(why, field=field)
    if why:
        raise SandboxError(why)


def host_addresses() -> list[str]:
    """The host's own IPv4 addresses (its local routing table, so aliases too)."""
    found, last = set(), None
    with open("/proc/net/fib_trie") as fh:
        for line in fh:
            text = line.strip()
            if text.startswith("|--"):
                last = text.split()[1]
            elif text == "/32 host LOCAL" and last:
                found.add(f"{last}/32")
    return sorted(found)


def host_subnets() -> list[str]:
    """The IPv4 subnets the host reaches directly (its neighbours: other nodes, the gateway)."""
    subnets = []
    with open("/proc/net/route") as fh:
        for line in list(fh)[1:]:
            iface, dest, _gw, flags, *_rest, mask = line.split()[:8]
            if iface == "lo" or int(flags, 16) & 0x2 or int(mask, 16) == 0:
                continue  # loopback, via a gateway, or the default route
            to_ip = lambda hexed: ipaddress.IPv4Address(int(hexed, 16).to_bytes(4, "little"))  # noqa: E731
            subnets.append(str(ipaddress.IPv4Network(f"{to_ip(dest)}/{to_ip(mask)}", strict=False)))
    return subnets


def denied_networks() -> list[str]:
    """Everything a network sandbox may not reach over IPv4, overlaps merged."""
    extra = [part.strip() for part in _settings().sandbox_network_deny.split(",") if part.strip()]
    nets = [ipaddress.IPv4Network(net, strict=False)
            for net in (*DENIED_V4, *host_addresses(), *host_subnets(), *extra)]
    return [str(net) for net in ipaddress.collapse_addresses(nets)]


def ruleset(denied: list[str]) -> str:
    """The nftables table put into a sandbox's namespace (pure)."""
    return f"""table inet prorl_sandbox {{
  chain output {{
    type filter hook output priority filter; policy accept;
    oifname "lo" accept
    ip daddr {SLIRP_DNS} meta l4proto {{ tcp, udp }} th dport 53 accept
    ip daddr {{ {", ".join(denied)} }} reject
    meta nfproto ipv6 reject
  }}
}}
"""


@functools.cache
def resolv_conf() -> str:
    """A host file naming slirp's resolver, bound over a network sandbox's /etc/resolv.conf: in
    a fresh 0711 directory of the host's own (a sandbox uid can open the file, not replace it)."""
    directory = tempfile.mkdtemp(prefix="prorl-netns-")
    os.chmod(directory, 0o711)
    path = os.path.join(directory, "resolv.conf")
    with open(path, "x") as fh:
        fh.write(f"nameserver {SLIRP_DNS}\noptions timeout:2 attempts:2\n")
    os.chmod(path, 0o444)
    atexit.register(shutil.rmtree, directory, True)
    return path


# -- attaching the network to a running sandbox ------------------------------------------------------
class UserNet:
    """slirp4netns serving one sandbox's namespace; :meth:`close` (or the host's death) ends it."""

    def __init__(self, proc: subprocess.Popen, exit_fd: int):
        self.proc = proc
        self._exit_fd: int | None = exit_fd

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close(self) -> None:
        """End of file on slirp4netns's exit fd makes it quit; SIGKILL if it lingers. Idempotent."""
        if self._exit_fd is not None:
            os.close(self._exit_fd)
            self._exit_fd = None
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


def _ns_args(netns: int, userns: int | None, *, nsenter: bool) -> list[str]:
    if nsenter:
        user = [f"--user=/proc/self/fd/{userns}", "--preserve-credentials"] if userns else []
        return [*user, f"--net=/proc/self/fd/{netns}"]
    user = [f"--userns-path=/proc/self/fd/{userns}"] if userns else []
    return ["--netns-type=path", *user, f"/proc/self/fd/{netns}"]


def open_low_ports(init_pid: int) -> None:
    """Let the sandbox's processes listen on ports below 1024 in the sandbox's own network
    namespace (``ip_unprivileged_port_start`` is per namespace), as a container's root can: an
    image's service (a web server on port 80) works. Only a root host can set it; elsewhere it is
    left as it is. Nothing beyond the sandbox's namespace changes."""
    if os.geteuid() != 0 or not tool("nsenter"):
        return
    argv = [tool("nsenter"), f"--net=/proc/{init_pid}/ns/net", "--", "/bin/sh", "-c",
            "echo 0 > /proc/sys/net/ipv4/ip_unprivileged_port_start"]
    done = subprocess.run(argv, capture_output=True, env=HELPER_ENV, timeout=10, cwd="/")
    if done.returncode != 0:
        raise SandboxError(f"could not open low ports in the sandbox's network namespace: "
                           f"{done.stderr.decode(errors='replace')[-300:]}")


def apply_rules(netns: int, userns: int | None, rules: str) -> None:
    fds = (netns,) + ((userns,) if userns else ())
    argv = [tool("nsenter"), *_ns_args(netns, userns, nsenter=True), tool("nft"), "-f", "-"]
    try:
        done = subprocess.run(argv, input=rules.encode(), pass_fds=fds, capture_output=True,
                              env=HELPER_ENV, timeout=10, cwd="/")
    except subprocess.TimeoutExpired as exc:
        raise OSError("nft took over 10 s to set the sandbox's network policy") from exc
    if done.returncode != 0:
        raise OSError(f"could not set the sandbox's network policy: {done.stderr.decode()[-500:]}")


def _private_mounts() -> list[str]:
    """As root: a mount namespace of slirp4netns's own whose mounts propagate nowhere (see the
    module). Not as another user: there its namespaces' mounts are slaves already. (``refusal``
    requires unshare as root; an image build's check does not, and runs without it.)"""
    unshare = tool("unshare")
    return [unshare, "--mount", "--propagation", "private", "--"] if os.geteuid() == 0 and unshare else []


def start_slirp(netns: int, userns: int | None) -> UserNet:
    """slirp4netns on a tap device in ``netns``, returned once it says it is ready."""
    ready_r, ready_w = os.pipe()
    exit_r, exit_w = os.pipe()  # non-inheritable: only slirp4netns gets exit_r, only we hold exit_w
    log = tempfile.TemporaryFile()
    argv = [*_private_mounts(), tool("slirp4netns"), "--configure", "--mtu=65520", "--disable-host-loopback",
            "--enable-sandbox", "--enable-seccomp", f"--ready-fd={ready_w}", f"--exit-fd={exit_r}",
            *_ns_args(netns, userns, nsenter=False), TAP]
    fds = (ready_w, exit_r, netns) + ((userns,) if userns else ())
    try:
        proc = spawn(argv, pass_fds=fds, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                     env=HELPER_ENV, cwd="/", start_new_session=True)
    except BaseException:
        for fd in (ready_r, ready_w, exit_r, exit_w):
            os.close(fd)
        log.close()
        raise
    os.close(ready_w)
    os.close(exit_r)
    net = UserNet(proc, exit_w)
    try:
        if not readable((ready_r,), READY_TIMEOUT_S) or os.read(ready_r, 1) != b"1":
            net.close()
            log.seek(0)
            raise OSError(f"slirp4netns did not come up: {log.read()[-800:].decode(errors='replace')!r}")
        return net
    finally:
        os.close(ready_r)
        log.close()


def attach(init_pid: int, pidfd: int | None = None) -> UserNet:
    """Give the sandbox whose pid 1 is ``init_pid`` its policy, then its network. ``pidfd``
    proves the namespace opened is still that sandbox's (its pid cannot have been reused)."""
    started = time.monotonic()
    netns = os.open(f"/proc/{init_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    userns = None
    try:
        if pidfd is not None and readable((pidfd,), 0):
            raise OSError("the sandbox exited before its network was set up")
        if os.geteuid() != 0:  # the owner of the sandbox's user namespace acts from inside it
            userns = fcntl.ioctl(netns, _NS_GET_USERNS)
        apply_rules(netns, userns, ruleset(denied_networks()))
        net = start_slirp(netns, userns)
        net.setup_s = time.monotonic() - started
        return net
    finally:
        os.close(netns)
        if userns is not None:
            os.close(userns)
