"""The worker's way to its job's c10d store: a loopback port that leads through the door.

The coordinator's stores sit behind a door that lets a connection through only once it proved
that it holds its job's token (:mod:`maitre.control.storedoor`). torch's ``TCPStore`` client
cannot say anything before its own protocol, so the worker runs this link: its ``TCPStore``
connects to a port on 127.0.0.1, and each connection accepted there is answered at the door
(the challenge, its HMAC with the token) and then joined to it byte for byte.

Only this process may use the link: a connection is accepted only if the socket at its other end
is one of this process's own (found through ``/proc``), so another user of the node cannot borrow
the worker's way in. An agent runs one for an unmodified script (``elastic: restart``), whose
``TCPStore`` cannot be told of a door: its owners are then that worker's processes and their
children, and the agent learns from it that the script reached its store (``on_connect``).

The link carries rendezvous traffic only (addresses, small keys); gradients
never pass through it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import threading
from collections.abc import Callable

GREETING = b"MAITRE-STORE/1 "
_TIMEOUT_S = 10.0
_LOOPBACK = "127.0.0.1"


class StoreLinkError(ConnectionError):
    """The door refused this worker (``refused``: a wrong token, a run that is over) or cannot
    be reached."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class StoreLink:
    """Listens on 127.0.0.1; every connection this process makes there reaches the store of run
    ``run_key`` through the door at ``door`` (host, port)."""

    def __init__(
        self,
        door: tuple[str, int],
        run_key: str,
        token: str,
        *,
        owners: Callable[[], set[int]] | None = None,
        on_connect: Callable[[], None] | None = None,
    ) -> None:
        """``owners``: the processes that may connect (default: this one); ``on_connect``:
        called at each connection let through."""
        self.door = door
        self.run_key = run_key
        self._token = token.encode()
        self._owners = owners
        self._on_connect = on_connect
        self._sock = socket.socket()
        self._sock.bind((_LOOPBACK, 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, name="maitre-store-link", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def check(self) -> None:
        """Knock once (raises :class:`StoreLinkError` if the door refuses): a wrong token is a
        clear error here, not a c10d timeout later."""
        self._open_door().close()

    # -- connections -----------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            pids = {os.getpid()} if self._owners is None else self._owners()
            if not _ours(peer[1], self.port, pids):
                conn.close()
                continue
            if self._on_connect is not None:
                self._on_connect()
            # The store's requests are a few small writes each: relayed one by one, Nagle's
            # algorithm would hold each behind the last one's (delayed) acknowledgement.
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._join, args=(conn,), name="maitre-store-link-conn", daemon=True).start()

    def _join(self, conn: socket.socket) -> None:
        try:
            up = self._open_door()
        except StoreLinkError:
            conn.close()
            return
        threading.Thread(target=_pipe, args=(up, conn), name="maitre-store-link-pipe", daemon=True).start()
        _pipe(conn, up)

    def _open_door(self) -> socket.socket:
        where = f"{self.door[0]}:{self.door[1]}"
        try:
            up = socket.create_connection(self.door, timeout=_TIMEOUT_S)
        except OSError as exc:
            raise StoreLinkError(f"cannot reach the store door at {where}: {exc}") from exc
        try:
            greeting = _line(up)
            if not greeting.startswith(GREETING):
                raise StoreLinkError(f"{where} is not a maitre store door", refused=bool(greeting))
            nonce = greeting[len(GREETING) :].strip()
            response = hmac.new(self._token, nonce, hashlib.sha256).hexdigest()
            up.sendall(f"{self.run_key} {response}\n".encode())
            if _line(up) != b"OK\n":
                raise StoreLinkError(
                    f"the store door at {where} refused run {self.run_key!r}: "
                    "this worker's job token does not match, or the run is over",
                    refused=True,
                )
        except StoreLinkError:  # (an OSError too: first)
            up.close()
            raise
        except OSError as exc:
            up.close()
            raise StoreLinkError(f"store door handshake with {where} failed: {exc}") from exc
        up.settimeout(None)
        up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return up


def _line(sock: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n") and len(data) <= 512:
        chunk = sock.recv(1)
        if not chunk:
            break
        data += chunk
    return data


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        src.close()


def _hex_address(ip: str, port: int) -> str:
    """How ``/proc/net/tcp`` (an IPv4 ``ip``) or ``/proc/net/tcp6`` writes an address and port:
    the address as native-order 32-bit words, the port in host order."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    packed = socket.inet_pton(family, ip)
    words = struct.unpack(f"={len(packed) // 4}I", packed)
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}"


def _ours(peer_port: int, our_port: int, pids: set[int]) -> bool:
    """Is the socket connected to us from 127.0.0.1:``peer_port`` one of the processes
    ``pids``'? It may be an IPv4 socket, or an IPv6 one speaking to the IPv4-mapped address (as
    torch's ``TCPStore`` client does)."""
    tables = (("/proc/net/tcp", _LOOPBACK), ("/proc/net/tcp6", "::ffff:" + _LOOPBACK))
    inode = None
    for path, ip in tables:
        local, remote = _hex_address(ip, peer_port), _hex_address(ip, our_port)
        try:
            with open(path) as table:
                for row in table:
                    cols = row.split()
                    if len(cols) > 9 and cols[1] == local and cols[2] == remote:
                        inode = cols[9]
                        break
        except OSError:
            continue
        if inode is not None:
            break
    if inode is None:
        return False
    target = f"socket:[{inode}]"
    for pid in pids:
        where = "/proc/self/fd" if pid == os.getpid() else f"/proc/{pid}/fd"
        try:
            fds = os.listdir(where)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"{where}/{fd}") == target:
                    return True
            except OSError:
                continue
    return False


def descendants(pids: set[int]) -> set[int]:
    """``pids`` and every live process below them (from ``/proc``: a launcher's children)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # (the name, in brackets, may hold spaces)
        parent[int(entry)] = int(fields[1])
    found = set(pids)
    grew = True
    while grew:
        below = {pid for pid, ppid in parent.items() if ppid in found and pid not in found}
        grew = bool(below)
        found |= below
    return found
