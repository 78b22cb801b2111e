"""The c10d stores' door (maitre.control.storedoor) and the worker's link to it
(maitre.runtime.storelink): only a run's own workers reach its store, and nothing else is served."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from datetime import timedelta
from typing import Iterator

import pytest
import torch.distributed as dist

from maitre.control.storedoor import StoreDoor, Stores
from maitre.runtime.storelink import StoreLink, StoreLinkError

TOKEN_A, TOKEN_B = "a" * 64, "b" * 64


@pytest.fixture
def door():
    stores = Stores()
    stores.open("alpha/1", TOKEN_A)
    stores.open("beta/1", TOKEN_B)
    door = StoreDoor(stores).start()
    yield door
    door.stop()
    stores.retain(set())


@contextlib.contextmanager
def links(port: int, *runs: tuple[str, str]) -> Iterator[list[StoreLink]]:
    """A worker's link to the door on ``port`` for each (run key, token), closed afterwards."""
    opened = [StoreLink(("127.0.0.1", port), key, token) for key, token in runs]
    try:
        yield opened
    finally:
        for link in opened:
            link.close()


def client(link: StoreLink, timeout_s: float = 10.0) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", link.port, is_master=False, timeout=timedelta(seconds=timeout_s))


@pytest.mark.timeout(60)
def test_a_run_s_workers_share_its_store_through_their_links(door: StoreDoor) -> None:
    with links(door.port, ("alpha/1", TOKEN_A), ("alpha/1", TOKEN_A)) as (one, two):
        a, b = client(one), client(two)
        a.set("addr/0", b"10.0.0.1:1234")
        assert b.get("addr/0") == b"10.0.0.1:1234"
        b.wait(["addr/0"], timedelta(seconds=5))
        assert a.add("count", 2) == 2 and b.add("count", 3) == 5
        # a process group forms through it (what every epoch does)
        prefix = dist.PrefixStore("job/alpha/e1/", a)
        assert prefix.num_keys() >= 1
    assert door.refused == 0


@pytest.mark.timeout(60)
def test_runs_do_not_see_each_other_s_keys(door: StoreDoor) -> None:
    with links(door.port, ("alpha/1", TOKEN_A), ("beta/1", TOKEN_B)) as (la, lb):
        a, b = client(la), client(lb)
        a.set("secret-address", b"10.0.0.1:1")
        assert not b.check(["secret-address"])
        b.set("other", b"x")
        assert a.num_keys() == b.num_keys()  # each sees its own key (and torch's own) only
        assert not a.check(["other"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "key,token", [("alpha/1", TOKEN_B), ("alpha/1", ""), ("gamma/1", TOKEN_A), ("alpha/2", TOKEN_A)]
)
def test_a_wrong_token_or_an_unknown_run_is_refused_before_any_key(door: StoreDoor, key: str, token: str) -> None:
    with links(door.port, (key, token)) as (link,):
        with pytest.raises(StoreLinkError, match="refused") as refused:
            link.check()
        assert refused.value.refused
        # and a TCPStore behind that link gets nothing: the door closes on it
        with pytest.raises((RuntimeError, dist.DistError)):
            client(link, timeout_s=2).get("anything")
    assert door.refused >= 2


@pytest.mark.timeout(60)
def test_a_plain_tcpstore_client_at_the_door_gets_nothing(door: StoreDoor) -> None:
    """torch's own client speaks first and never answers the challenge: closed, unserved."""
    t0 = time.monotonic()
    with pytest.raises((RuntimeError, dist.DistError)):
        dist.TCPStore("127.0.0.1", door.port, is_master=False, timeout=timedelta(seconds=3)).get("job/alpha/e1/0")
    assert time.monotonic() - t0 < 30
    with socket.create_connection(("127.0.0.1", door.port), timeout=5) as s:
        s.sendall(b"alpha/1 " + b"0" * 64 + b"\n")  # a guess, not the answer to the nonce
        assert s.recv(100).startswith(b"MAITRE-STORE/1 ")
        s.settimeout(5)
        assert s.recv(100) == b""  # closed


@pytest.mark.timeout(60)
def test_an_ended_run_s_store_is_closed(door: StoreDoor) -> None:
    door.stores.retain({"beta/1"})
    assert door.stores.keys() == ["beta/1"]
    with links(door.port, ("alpha/1", TOKEN_A)) as (link,):
        with pytest.raises(StoreLinkError, match="refused"):
            link.check()


@pytest.mark.timeout(60)
def test_the_link_serves_its_own_process_only(door: StoreDoor) -> None:
    """Another process on the node (another user's, say) that finds the link's port is cut off
    before the door is even asked."""
    with links(door.port, ("alpha/1", TOKEN_A)) as (link,):
        client(link).set("mine", b"1")  # this process: served
        probe = (
            "import socket,sys\n"
            "s = socket.create_connection(('127.0.0.1', %d), timeout=5)\n"
            "s.sendall(b'x' * 16); s.settimeout(5)\n"
            "try:\n    got = s.recv(100)\nexcept ConnectionResetError:\n    got = b''\n"
            "sys.stdout.write(repr(got))" % link.port
        )
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
        assert out.stdout == "b''", (out.stdout, out.stderr)  # closed unanswered
        assert door.refused == 0  # the door was never asked


@pytest.mark.timeout(60)
def test_an_unreachable_door_is_not_a_refusal() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    with links(port, ("alpha/1", TOKEN_A)) as (link,):
        with pytest.raises(StoreLinkError, match="cannot reach") as err:
            link.check()
        assert not err.value.refused
