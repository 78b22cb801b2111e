"""Several "hosts" on this machine, built from network namespaces, for multi-host tests.

Layout of one run (``<id>`` is ``maitre-<pytest pid>-<random hex>``)::

    netns <id>-br      a bridge ``br0``, and one veth end per host (``v0``, ``v1``, ...)
    netns <id>-h0      ``lo`` (up) and ``eth0`` = 10.231.<n>.1/24, the other end of ``v0``
    netns <id>-h1      ``lo`` (up) and ``eth0`` = 10.231.<n>.2/24, the other end of ``v1``
    ...

Every link is created inside a namespace of this harness, so the root namespace is never
touched, nothing is routed anywhere else, and runs never collide (each has its own namespaces;
``<n>`` is random too, for readable logs). A host's processes are started with ``ip netns exec``
and tagged with ``MAITRE_TEST_TAG`` (which their children inherit); at the end every tagged
process, and anything still inside the namespaces, is killed, and the namespaces are deleted,
which deletes their links. Namespaces left by a run that was itself killed (its pid is gone) are
deleted by the next run.

    def test_x(hosts):
        a, b = hosts(2)
        server = b.run([sys.executable, "-m", "http.server", "8000"])
        ...
        b.cut()       # b's veth end on the bridge goes down: b is off the network
        b.restore()
        b.cut_from(a)  # b's packets to a are dropped; to any other host they go
        b.restore_to(a)
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, TAG_VAR, _tagged_pids

_PREFIX = "maitre-"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip() or result.returncode}")
    return result


def _namespaces() -> list[str]:
    result = _ip("netns", "list", check=False)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _remove_leftovers() -> None:
    """Namespaces of earlier runs whose pytest process is gone."""
    pattern = re.compile(rf"{_PREFIX}(\d+)-[0-9a-f]+-")
    for ns in _namespaces():
        m = pattern.match(ns)
        if m is None or Path(f"/proc/{m.group(1)}").exists():
            continue
        pids = _ip("netns", "pids", ns, check=False).stdout.split()
        _kill([int(p) for p in pids if p.isdigit()])
        _ip("netns", "del", ns, check=False)


class Host:
    """One network namespace on the test bridge."""

    def __init__(self, net: "Network", index: int, ip: str) -> None:
        self.net = net
        self.index = index
        self.name = f"h{index}"
        self.netns = f"{net.id}-h{index}"
        self.ip = ip
        self.port = f"v{index}"  # its veth end on the bridge, in the bridge's namespace

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.ip}, netns={self.netns})"

    def run(self, cmd: list[str], *, extra_env: dict[str, str] | None = None, **popen_kw: Any) -> subprocess.Popen:
        """Start ``cmd`` in this host's namespace and return its Popen (cwd: the repository,
        its own session, the test's environment without ``MAITRE_*`` unless ``env`` is given,
        plus ``extra_env``, tagged for clean-up)."""
        env = popen_kw.pop("env", None)
        if env is None:
            env = {k: v for k, v in os.environ.items() if not k.startswith(("MAITRE_", "TORCHELASTIC_"))}
            env.setdefault("OMP_NUM_THREADS", "1")
            env.setdefault("PYTHONUNBUFFERED", "1")
        env = {**env, **(extra_env or {}), TAG_VAR: self.net.tag}
        popen_kw.setdefault("cwd", ROOT)
        popen_kw.setdefault("start_new_session", True)
        proc = subprocess.Popen(["ip", "netns", "exec", self.netns, *cmd], env=env, **popen_kw)
        self.net.procs.append(proc)
        return proc

    def check_output(self, cmd: list[str], timeout: float = 60, **kw: Any) -> str:
        """Run ``cmd`` here to the end and return its stdout (raises on a non-zero exit)."""
        proc = self.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, cmd, out, err)
        return out

    def cut(self) -> None:
        """Take this host off the network: its veth end on the bridge goes down, so its
        ``eth0`` loses carrier and packets to and from it are dropped (no reset is sent; its
        address and routes stay, as on a real partition)."""
        _ip("-n", self.net.bridge_ns, "link", "set", self.port, "down")

    def restore(self) -> None:
        """Put it back on the bridge."""
        _ip("-n", self.net.bridge_ns, "link", "set", self.port, "up")

    def cut_from(self, other: "Host") -> None:
        """Drop whatever this host sends to ``other`` (a blackhole route: its connections there
        fail at once), the rest of the network untouched: a partition that heals toward some
        hosts before others."""
        _ip("-n", self.netns, "route", "add", "blackhole", f"{other.ip}/32")

    def restore_to(self, other: "Host") -> None:
        _ip("-n", self.netns, "route", "del", "blackhole", f"{other.ip}/32")


class Network:
    """A bridge and the hosts on it; :meth:`close` removes everything it made or started."""

    def __init__(self) -> None:
        self.id = f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.tag = uuid.uuid4().hex
        self.subnet = random.randrange(256)
        self.bridge_ns = f"{self.id}-br"
        self.created: list[str] = []
        self.hosts: list[Host] = []
        self.procs: list[subprocess.Popen] = []

    def _netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self.created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def add_hosts(self, n: int) -> list[Host]:
        if not self.created:
            self._netns(self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        new = []
        for _ in range(n):
            i = len(self.hosts)
            if i >= 254:
                raise ValueError("at most 254 hosts on one bridge")
            host = Host(self, i, f"10.231.{self.subnet}.{i + 1}")
            self._netns(host.netns)
            _ip(
                "-n",
                host.netns,
                "link",
                "add",
                "eth0",
                "type",
                "veth",
                "peer",
                "name",
                host.port,
                "netns",
                self.bridge_ns,
            )
            _ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
            _ip("-n", self.bridge_ns, "link", "set", host.port, "master", "br0", "up")
            self.hosts.append(host)
            new.append(host)
        return new

    def close(self) -> None:
        for proc in self.procs:  # a polite word first, so that agents stop their workers
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGINT)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + 5
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for _ in range(3):
            pids = _tagged_pids(self.tag)
            for ns in self.created:  # anything else in there (a process that dropped its env)
                pids += [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split() if p.isdigit()]
            if not pids:
                break
            _kill(pids)
            time.sleep(0.2)
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self.created):
            _ip("netns", "del", ns, check=False)
        self.created.clear()


def _can_make_namespaces() -> str | None:
    """None when this machine can build the hosts, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` binary (iproute2)"
    probe = f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}-probe"
    result = _ip("netns", "add", probe, check=False)
    if result.returncode != 0:
        return f"`ip netns add` failed: {result.stderr.strip()}"
    try:
        link = _ip("-n", probe, "link", "add", "br0", "type", "bridge", check=False)
        if link.returncode != 0:
            return f"cannot create a bridge in a namespace: {link.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


@pytest.fixture
def hosts() -> Iterator[Callable[[int], list[Host]]]:
    """``hosts(n)``: ``n`` more hosts on this test's network; all removed after the test."""
    reason = _can_make_namespaces()
    if reason is not None:
        pytest.skip(f"cannot build network namespaces here: {reason}")
    _remove_leftovers()
    net = Network()
    try:
        yield net.add_hosts
    finally:
        net.close()
