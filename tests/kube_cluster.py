"""A real Kubernetes control plane on this machine for the tests: etcd, kube-apiserver (RBAC on),
kube-controller-manager, kube-scheduler, and kubemark's hollow nodes (the real kubelet code with
a fake container runtime: pods are scheduled, bound and reported Running, but no process runs).

The binaries are built once from Debian's source package and cached outside the checkout
(``deploy/kubernetes/testbed/build-control-plane``, about 6 minutes cold, instant warm); etcd is
Debian's ``etcd-server``. No test builds them: a cold build under a test's time limit, on a busy
machine, ran past it. ``.ci/run`` runs the build as a step of its own, with its own time limit,
and names the binaries' directory in ``$MAITRE_KUBE_BIN``; without it, the tests take the newest
complete build in the build's cache. Everything else lives in a temporary directory: etcd's data, the
service-account key pair, the API server's self-signed certificate, a static token file (an
``admin`` in ``system:masters``), an admin kubeconfig, every daemon's log. Every port is a free
one; every daemon is stopped by its pid afterwards, the API server before etcd.

What is real: the API server (schemas, structural pruning, subresources, RBAC, finalizers,
garbage collection), etcd, the controllers (service-account tokens, garbage collector, node
lifecycle), the scheduler. What stands in: the container runtime (hollow nodes run nothing), so
the processes of a maitre job are local processes of the test: agents standing for the nodes,
or, for replica pods, :class:`LocalRuntime` running each Running pod's container command.

Where there are no binaries, the tests skip, naming the command that builds them; under CI
(``CI=true``), or where ``$MAITRE_KUBE_BIN`` names a directory without them, they fail instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, free_ports

BUILD = ROOT / "deploy" / "kubernetes" / "testbed" / "build-control-plane"
BIN_VAR = "MAITRE_KUBE_BIN"
"""The binaries' directory, as :data:`BUILD` printed it (``.ci/run`` sets it)."""
BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubemark")
NODE_GPUS = 8
"""What each hollow node reports as ``nvidia.com/gpu`` capacity (patched in: a fake runtime
has no device plugin)."""


def _cache() -> Path:
    """Where :data:`BUILD` keeps its builds, one directory per source version."""
    return Path(os.environ.get("MAITRE_KUBE_CACHE") or Path.home() / ".cache" / "maitre")


def _version(build: Path) -> list[Any]:
    """``kubernetes-1.20.2...`` -> its numbers as numbers, for the newest build."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", build.parent.name)]


def binaries() -> tuple[Path | None, str]:
    """(the directory of the control plane's binaries, why not: empty when found): the one
    ``$MAITRE_KUBE_BIN`` names, else the newest complete build in :data:`BUILD`'s cache. Nothing
    is built here (see the module's docstring)."""
    build = f"{BUILD.relative_to(ROOT)} builds them (root, apt; about 6 minutes once, then cached)"
    given = os.environ.get(BIN_VAR)
    candidates = [Path(given)] if given else sorted(_cache().glob("kubernetes-*/bin"), key=_version, reverse=True)
    found = next((d for d in candidates if all(os.access(d / b, os.X_OK) for b in BINARIES)), None)
    if found is None:
        where = f"${BIN_VAR}={given} holds no {', '.join(BINARIES)}" if given else f"no control plane in {_cache()}"
        return None, f"{where}: {build}"
    if shutil.which("etcd") is None:
        return None, f"etcd is not installed: {BUILD.relative_to(ROOT)} installs it (apt-get install etcd-server)"
    return found, ""


def require() -> Path:
    """The binaries' directory. Without it, a skip that names the command that builds them; a
    failure under CI (``CI=true``) or where ``$MAITRE_KUBE_BIN`` is set (there, a build was made
    for these tests: that it is not there is a fault, not a machine without one)."""
    found, why = binaries()
    if found is not None:
        return found
    if os.environ.get("CI") == "true" or os.environ.get(BIN_VAR):
        pytest.fail(f"the Kubernetes tests need their control plane: {why}")
    pytest.skip(why)


@dataclass
class KubeCluster:
    """A control plane in ``root`` with ``nodes`` hollow nodes (``node-1`` ...); use as a context
    manager, or :meth:`start` and :meth:`stop`."""

    root: Path
    bin: Path
    nodes: int = 2
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def kubeconfig(self) -> Path:
        """The admin's kubeconfig (``system:masters``: what a cluster's owner applies with)."""
        return self.root / "admin.kubeconfig"

    @property
    def ca(self) -> Path:
        """The API server's self-signed certificate (for 127.0.0.1), which clients check."""
        return self.root / "certs" / "apiserver.crt"

    def write_kubeconfig(self, path: Path, user: str, token: str) -> Path:
        """A kubeconfig for ``token`` (a ServiceAccount's, say) at ``path``."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": {"server": self.server, "certificate-authority": str(self.ca)}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": user}}],
            "current-context": "test",
        }
        path.write_text(json.dumps(config))
        return path

    # -- life --------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 120.0) -> "KubeCluster":
        d = self.root
        d.mkdir(parents=True, exist_ok=True)
        (self.etcd_port, self.etcd_peer, self.api_port, cm_port, sched_port) = free_ports(5)
        kubelet_ports = free_ports(2 * self.nodes)
        subprocess.run(["openssl", "genrsa", "-out", str(d / "sa.key"), "2048"], check=True, capture_output=True)
        subprocess.run(
            ["openssl", "rsa", "-in", str(d / "sa.key"), "-pubout", "-out", str(d / "sa.pub")],
            check=True,
            capture_output=True,
        )
        (d / "tokens.csv").write_text(f"{self.token},admin,admin,system:masters\n")
        kc = str(self.kubeconfig)
        etcd_url = f"http://127.0.0.1:{self.etcd_port}"
        self._spawn(
            "etcd",
            ["etcd", "--data-dir", str(d / "etcd"), "--listen-client-urls", etcd_url,
             "--advertise-client-urls", etcd_url, "--listen-peer-urls", f"http://127.0.0.1:{self.etcd_peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.etcd_peer}",
             "--initial-cluster", f"default=http://127.0.0.1:{self.etcd_peer}"],
        )  # fmt: skip
        self._spawn(
            "kube-apiserver",
            [str(self.bin / "kube-apiserver"), f"--etcd-servers={etcd_url}", "--bind-address=127.0.0.1",
             "--advertise-address=127.0.0.1", f"--secure-port={self.api_port}", f"--cert-dir={d / 'certs'}",
             f"--token-auth-file={d / 'tokens.csv'}", "--authorization-mode=RBAC",
             "--service-account-issuer=https://kubernetes.default.svc", f"--service-account-key-file={d / 'sa.pub'}",
             f"--service-account-signing-key-file={d / 'sa.key'}", "--service-cluster-ip-range=10.0.0.0/24",
             "--insecure-port=0"],
        )  # fmt: skip
        self._wait(lambda: self._ready("/readyz"), timeout_s, "the API server to be ready")
        self.write_kubeconfig(self.kubeconfig, "admin", self.token)  # (its certificate exists now)
        self._spawn(
            "kube-controller-manager",
            [str(self.bin / "kube-controller-manager"), f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}",
             f"--authorization-kubeconfig={kc}", "--bind-address=127.0.0.1", f"--secure-port={cm_port}", "--port=0",
             "--leader-elect=false", f"--service-account-private-key-file={d / 'sa.key'}",
             f"--root-ca-file={d / 'certs' / 'apiserver.crt'}", "--use-service-account-credentials=true",
             "--controllers=*,-csrsigning,-csrapproving,-nodeipam", "--node-monitor-grace-period=20s"],
        )  # fmt: skip
        self._spawn(
            "kube-scheduler",
            [str(self.bin / "kube-scheduler"), f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}",
             f"--authorization-kubeconfig={kc}", "--bind-address=127.0.0.1", f"--secure-port={sched_port}",
             "--port=0", "--leader-elect=false"],
        )  # fmt: skip
        for n in range(1, self.nodes + 1):
            port, ro = kubelet_ports[2 * (n - 1) : 2 * n]
            self._spawn(
                f"node-{n}",
                [str(self.bin / "kubemark"), "--morph=kubelet", f"--name=node-{n}", f"--kubeconfig={kc}",
                 f"--kubelet-port={port}", f"--kubelet-read-only-port={ro}"],
            )  # fmt: skip
        self._wait(lambda: len(self.ready_nodes()) == self.nodes, timeout_s, f"{self.nodes} Ready nodes")
        for n in range(1, self.nodes + 1):
            self.request(
                "PATCH",
                f"/api/v1/nodes/node-{n}/status",
                [{"op": "add", "path": "/status/capacity/nvidia.com~1gpu", "value": str(NODE_GPUS)}],
                content_type="application/json-patch+json",
            )
        self._wait(
            lambda: self.request("GET", "/api/v1/namespaces/default/serviceaccounts/default", allow=(404,)) is not None,
            timeout_s,
            "the default ServiceAccount",
        )
        return self

    def stop(self) -> None:
        """The API server first (it holds etcd's connections; its graceful shutdown drains
        watches for 20 s, and it keeps no state of its own: 2 s, then SIGKILL), then the rest
        together, etcd last."""
        rest = [k for k in self.procs if k not in ("kube-apiserver", "etcd")]
        for names, grace in ((["kube-apiserver"], 2), (rest, 15), (["etcd"], 15)):
            procs = [self.procs.pop(n) for n in names if n in self.procs]
            for proc in procs:
                proc.terminate()
            deadline = time.monotonic() + grace
            for proc in procs:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def __enter__(self) -> "KubeCluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- asking it ---------------------------------------------------------------------------------
    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        token: str | None = None,
        content_type: str = "application/json",
        allow: tuple[int, ...] = (),
    ) -> Any:
        """The API server's JSON answer; None for a status in ``allow``; raises otherwise."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {token or self.token}")
        if data is not None:
            req.add_header("Content-Type", content_type)
        # (before the API server is up, its certificate may not exist yet: nothing to check)
        context = ssl.create_default_context(cafile=str(self.ca)) if self.ca.exists() else None
        try:
            if context is None:
                raise OSError("the API server has no certificate yet")
            with urllib.request.urlopen(req, timeout=10, context=context) as resp:
                text = resp.read()
        except urllib.error.HTTPError as exc:
            if exc.code in allow:
                return None
            raise AssertionError(f"{method} {path}: {exc.code} {exc.read().decode(errors='replace')[:2000]}") from None
        return json.loads(text) if text.strip().startswith(b"{") else text.decode()

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Debian's kubectl against this cluster as its admin."""
        result = subprocess.run(
            ["kubectl", f"--kubeconfig={self.kubeconfig}", *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {result.returncode}\n{result.stdout}\n{result.stderr}")
        return result

    def ready_nodes(self) -> list[str]:
        nodes = self.request("GET", "/api/v1/nodes", allow=(403, 404)) or {"items": []}
        return [
            n["metadata"]["name"]
            for n in nodes["items"]
            if any(c["type"] == "Ready" and c["status"] == "True" for c in n.get("status", {}).get("conditions", []))
        ]

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace")[-6000:] if path.exists() else ""

    def _spawn(self, name: str, cmd: list[str]) -> None:
        with open(self.root / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def _ready(self, path: str) -> bool:
        try:
            return self.request("GET", path, allow=(500, 503)) is not None
        except (OSError, AssertionError):
            return False

    def _wait(self, predicate: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise AssertionError(f"{name} exited ({proc.returncode}) waiting for {what}:\n{self.log(name)}")
            try:
                if predicate():
                    return
            except (OSError, AssertionError):
                pass
            time.sleep(0.3)
        raise AssertionError(f"waited {timeout_s:.0f} s for {what}:\n{self.log('kube-apiserver')}")


class LocalRuntime:
    """The container runtime that the hollow nodes lack, for replica pods: the container
    ``agent`` of every pod of ``namespace`` labelled ``maitre.dev/job`` that a hollow node reports
    Running is run as a local process, as the pod says (its command and args, ``$(VAR)`` expanded
    from its env, whose ``fieldRef`` to ``metadata.name`` is resolved; ``maitre`` is this
    Python's ``-m maitre.cli``). A pod deleted (evicted, preempted, or by the operator) has its
    process sent SIGTERM, as a kubelet does, and SIGKILL after the pod's grace period."""

    def __init__(self, kube: KubeCluster, namespace: str, env: dict[str, str], log_dir: Path) -> None:
        self.kube, self.namespace, self.env, self.log_dir = kube, namespace, env, log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.terminated: dict[str, float] = {}
        """Pod name -> when its process was sent SIGTERM (time.time())."""
        self._grace: dict[str, float] = {}
        self._family: dict[int, set[int]] = {}
        """Each agent's pid -> every pid seen under it (a worker outlives its agent's exit)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="local-runtime", daemon=True)

    def __enter__(self) -> "LocalRuntime":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs.values():  # the containers' every process, as a cgroup holds them
            self._kill(proc)

    def _kill(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL to the container: the agent and every process under it, now or seen under it
        before (its workers run in sessions of their own; a kubelet's cgroup would still hold
        them)."""
        family = self._family.setdefault(proc.pid, {proc.pid}) | _descendants(proc.pid, _parents())
        for pid in family:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()

    def command(self, pod: dict[str, Any]) -> list[str]:
        agent = next(c for c in pod["spec"]["containers"] if c["name"] == "agent")
        values = {e["name"]: e.get("value", "") for e in agent.get("env", [])}
        for e in agent.get("env", []):
            ref = (e.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
            if ref == "metadata.name":
                values[e["name"]] = pod["metadata"]["name"]
        words = [*agent.get("command", []), *agent.get("args", [])]
        words = [re.sub(r"\$\((\w+)\)", lambda m: values.get(m.group(1), m.group(0)), w) for w in words]
        if words and words[0] == "maitre":
            words = [sys.executable, "-m", "maitre.cli", *words[1:]]
        return words

    def _run(self) -> None:
        while not self._stop.wait(0.3):
            try:
                listed = self.kube.request(
                    "GET", f"/api/v1/namespaces/{self.namespace}/pods?labelSelector=maitre.dev%2Fjob"
                )
            except (OSError, AssertionError):
                continue
            seen = set()
            for pod in listed["items"]:
                name = pod["metadata"]["name"]
                seen.add(name)
                if pod["metadata"].get("deletionTimestamp"):
                    self._term(name, pod["spec"].get("terminationGracePeriodSeconds", 30))
                elif pod.get("status", {}).get("phase") == "Running" and name not in self.procs:
                    with open(self.log_dir / f"{name}.log", "wb") as log:
                        self.procs[name] = subprocess.Popen(
                            self.command(pod), cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )  # fmt: skip
            for name in set(self.procs) - seen:
                self._term(name, 30)
            parents = _parents()  # (one scan of /proc a pass, for every container)
            for proc in self.procs.values():
                if proc.poll() is None:
                    self._family.setdefault(proc.pid, {proc.pid}).update(_descendants(proc.pid, parents))
            now = time.time()
            for name, at in self.terminated.items():
                proc = self.procs[name]
                if proc.poll() is None and now > at + self._grace[name]:
                    self._kill(proc)

    def _term(self, name: str, grace: float) -> None:
        proc = self.procs.get(name)
        if proc is not None and name not in self.terminated:
            self.terminated[name] = time.time()
            self._grace[name] = grace
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)


def _parents() -> dict[int, int]:
    """Every process's parent, now (from /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return parents


def _descendants(pid: int, parents: dict[int, int]) -> set[int]:
    """Every process under ``pid`` in ``parents`` (:func:`_parents`)."""
    family, grew = {pid}, True
    while grew:
        more = {p for p, parent in parents.items() if parent in family} - family
        family |= more
        grew = bool(more)
    return family - {pid}
