"""Which network interface a node's workers advertise to the peers of their process group.

gloo (and NCCL's bootstrap) pick the address a worker listens on from the host name unless
``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` name an interface. On many machines the host name
resolves to a loopback address (``127.0.1.1`` on Debian, ``127.0.0.1`` in containers), so peers on
other hosts are told to connect to their own loopback and every group fails to build.

The rule: **a worker advertises the interface its agent uses to reach the coordinator.** That is
the interface holding the source address the kernel picks for a packet to the coordinator (a
connected UDP socket's ``getsockname``; nothing is sent). The address is mapped to its interface
with ``SIOCGIFADDR`` on each interface of ``socket.if_nameindex()``; when no interface holds it as
its primary address (a secondary address), the interface of the longest matching route to the
coordinator in ``/proc/net/route`` is used. The assumption is that the peers of a job reach each
other the way each of them reaches the coordinator; where that is not so, say which interface
to use.

Precedence, for each of the two variables on its own:

1. the user's environment (the agent's own, or the job's): an existing ``GLOO_SOCKET_IFNAME`` is
   never replaced, even an empty one (set it empty to keep gloo's default);
2. the agent's ``--iface NAME`` flag, which is used even when the coordinator is on loopback;
3. the detected interface, except when the coordinator is reached over loopback (``127.x``,
   ``::1``, ``localhost``): that is the one-machine case, where the default works, and nothing
   is set. An agent that reaches a multi-host coordinator over loopback (it runs on the
   coordinator's machine) must be given ``--iface``.

Detection covers IPv4 coordinators; for IPv6 ones, or if detection fails (no route, the name does
not resolve), nothing is set and gloo's default applies.
"""

from __future__ import annotations

import fcntl
import functools
import ipaddress
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass

VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class Route:
    """The interface (and its IPv4 address) this machine reaches the coordinator through."""

    iface: str
    address: str


def split_address(coordinator: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``[V6]:PORT``) → ``(host, port)``."""
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"coordinator must be HOST:PORT, got {coordinator!r}")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) means this machine's loopback."""
    name = host.lower()
    if name in ("localhost", "localhost.localdomain") or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def source_address(host: str, port: int) -> str:
    """The local IPv4 address the kernel uses as the source of a packet to ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))  # UDP: picks the route and source, sends nothing
        return s.getsockname()[0]


def interface_addresses() -> dict[str, str]:
    """Each interface's primary IPv4 address (interfaces without one are left out)."""
    found: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)
            except OSError:  # no IPv4 address on it
                continue
            found[name] = socket.inet_ntoa(reply[20:24])
    return found


def route_interface(destination: str, routes: str | None = None) -> str | None:
    """The interface of the longest-prefix route to ``destination`` in ``/proc/net/route``
    (whose addresses are little-endian hex), or None."""
    if routes is None:
        try:
            with open("/proc/net/route") as f:
                routes = f.read()
        except OSError:
            return None
    dest = struct.unpack("<I", socket.inet_aton(destination))[0]
    best: tuple[int, str] | None = None
    for line in routes.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 8:
            continue
        try:
            net, flags, mask = int(fields[1], 16), int(fields[3], 16), int(fields[7], 16)
        except ValueError:
            continue
        if not flags & 0x1 or dest & mask != net:  # RTF_UP
            continue
        length = bin(mask).count("1")
        if best is None or length > best[0]:
            best = (length, fields[0])
    return best[1] if best else None


def detect(coordinator: str) -> Route | None:
    """The interface and address used to reach ``coordinator`` (``HOST:PORT``); None when it is
    on loopback, not IPv4, or cannot be worked out."""
    try:
        host, port = split_address(coordinator)
        if is_loopback(host):
            return None
        address = source_address(host, port)
    except (OSError, ValueError):
        return None
    if ipaddress.ip_address(address).is_loopback:
        return None
    for name, addr in interface_addresses().items():
        if addr == address:
            return Route(name, address)
    try:
        name = route_interface(socket.gethostbyname(host))
    except OSError:
        return None
    return Route(name, address) if name else None


@functools.lru_cache(maxsize=None)
def detect_cached(coordinator: str) -> Route | None:
    """:func:`detect`, once per coordinator address for the life of the process."""
    return detect(coordinator)


def worker_env(coordinator: str, environ: Mapping[str, str], iface: str | None = None) -> dict[str, str]:
    """The variables to add to a worker's environment ``environ`` so that the peers of its
    process group can reach it (see the module docstring for the precedence)."""
    name = iface
    if not name:
        route = detect_cached(coordinator)
        name = route.iface if route is not None else None
    if not name:
        return {}
    return {var: name for var in VARIABLES if var not in environ}
