"""The interface a node's workers advertise: detection, precedence, and a real namespace."""

from __future__ import annotations

import json
import sys

import pytest

from hosts import hosts  # noqa: F401  (the fixture)
from maitre.agent import netaddr

ROUTES = """\
Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth0\t00000000\t0100E70A\t0003\t0\t0\t0\t00000000\t0\t0\t0
eth0\t0000E70A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
eth1\t0001E70A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
eth2\t0002E70A\t00000000\t0000\t0\t0\t0\t00FFFFFF\t0\t0\t0
"""


@pytest.fixture(autouse=True)
def fresh_cache():
    netaddr.detect_cached.cache_clear()
    yield
    netaddr.detect_cached.cache_clear()


@pytest.mark.timeout(30)
def test_addresses_split_into_host_and_port() -> None:
    assert netaddr.split_address("10.0.0.1:8080") == ("10.0.0.1", 8080)
    assert netaddr.split_address("[::1]:80") == ("::1", 80)
    assert netaddr.split_address("coord.example:1") == ("coord.example", 1)
    for bad in ("10.0.0.1", ":80", "host:", "host:x"):
        with pytest.raises(ValueError):
            netaddr.split_address(bad)


@pytest.mark.timeout(30)
def test_loopback_is_recognised_by_address_and_name() -> None:
    for host in ("127.0.0.1", "127.1.2.3", "::1", "localhost", "LOCALHOST"):
        assert netaddr.is_loopback(host), host
    for host in ("10.231.0.1", "192.0.2.7", "no-such-host.invalid"):
        assert not netaddr.is_loopback(host), host


@pytest.mark.timeout(30)
def test_on_loopback_nothing_is_set_unless_the_agent_names_an_interface() -> None:
    assert netaddr.detect("127.0.0.1:9") is None
    assert netaddr.worker_env("127.0.0.1:9", {}) == {}
    assert netaddr.worker_env("localhost:9", {}) == {}
    assert netaddr.worker_env("127.0.0.1:9", {}, "eth7") == {"GLOO_SOCKET_IFNAME": "eth7", "NCCL_SOCKET_IFNAME": "eth7"}


@pytest.mark.timeout(30)
def test_the_user_env_wins_over_the_flag_which_wins_over_detection(monkeypatch) -> None:
    monkeypatch.setattr(netaddr, "detect", lambda c: netaddr.Route("detected0", "10.9.9.9"))
    both = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
    assert netaddr.worker_env("10.1.1.1:9", {}) == dict.fromkeys(both, "detected0")
    assert netaddr.worker_env("10.1.1.1:9", {}, "flag0") == dict.fromkeys(both, "flag0")
    assert netaddr.worker_env("10.1.1.1:9", {"GLOO_SOCKET_IFNAME": "user0"}, "flag0") == {
        "NCCL_SOCKET_IFNAME": "flag0"
    }  # each variable on its own
    user = {"GLOO_SOCKET_IFNAME": "", "NCCL_SOCKET_IFNAME": "ib0"}  # empty: keep the default
    assert netaddr.worker_env("10.1.1.1:9", user) == {}


@pytest.mark.timeout(30)
def test_detection_runs_once_per_coordinator(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(netaddr, "detect", lambda c: calls.append(c) or netaddr.Route("eth0", "10.9.9.9"))
    for _ in range(5):
        netaddr.worker_env("10.1.1.1:9", {})
    netaddr.worker_env("10.1.1.2:9", {})
    assert calls == ["10.1.1.1:9", "10.1.1.2:9"]


@pytest.mark.timeout(30)
def test_failed_detection_sets_nothing() -> None:
    assert netaddr.detect("no-such-host.invalid:9") is None
    assert netaddr.detect("[2001:db8::1]:9") is None  # IPv6: not covered
    assert netaddr.detect("not an address") is None


@pytest.mark.timeout(30)
def test_the_longest_matching_up_route_names_the_interface() -> None:
    assert netaddr.route_interface("10.231.1.5", ROUTES) == "eth1"
    assert netaddr.route_interface("10.231.0.5", ROUTES) == "eth0"
    assert netaddr.route_interface("10.231.2.5", ROUTES) == "eth0"  # eth2's route is not up
    assert netaddr.route_interface("8.8.8.8", ROUTES) == "eth0"  # the default route
    assert netaddr.route_interface("8.8.8.8", ROUTES.splitlines()[0]) is None


@pytest.mark.timeout(30)
def test_interface_addresses_include_loopback() -> None:
    assert netaddr.interface_addresses().get("lo") == "127.0.0.1"


_PROBE = """
import json, sys
from maitre.agent import netaddr
r = netaddr.detect(sys.argv[1])
print(json.dumps({"route": r and [r.iface, r.address],
                  "env": netaddr.worker_env(sys.argv[1], {}),
                  "loopback": netaddr.worker_env("127.0.0.1:9", {}),
                  "addresses": netaddr.interface_addresses()}))
"""


@pytest.mark.timeout(30)
def test_in_a_network_namespace_the_veth_is_detected_not_lo(hosts) -> None:  # noqa: F811
    a, b = hosts(2)
    # Port 9 need not listen: a UDP connect only picks the route.
    seen = json.loads(a.check_output([sys.executable, "-c", _PROBE, f"{b.ip}:9"]))
    assert seen["route"] == ["eth0", a.ip], seen
    assert seen["env"] == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}, seen
    assert seen["loopback"] == {}, seen
    assert seen["addresses"] == {"lo": "127.0.0.1", "eth0": a.ip}, seen


@pytest.mark.timeout(60)
def test_an_agent_given_an_interface_this_machine_lacks_is_refused_in_one_line() -> None:
    from conftest import run_tagged

    result = run_tagged(
        [sys.executable, "-m", "maitre.cli", "agent", "--coordinator", "127.0.0.1:1", "--iface", "nosuchif0"],
        timeout=50,
    )
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    expected = "maitre: error: --iface nosuchif0: no such network interface on this machine"
    assert result.stderr.strip() == expected, result.stderr
    assert result.stdout == ""
