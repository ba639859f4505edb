"""The address guard. Non-loopback addresses are only ever classified, never contacted."""

from __future__ import annotations

import ipaddress
import socket

import pytest

from pairforge.download.address_guard import AddressGuard, BlockedAddress, refusal_reason


@pytest.mark.parametrize(("address", "reason"), [
    ("127.0.0.1", "loopback"),
    ("127.0.0.2", "loopback"),
    ("::1", "loopback"),
    ("10.1.2.3", "private"),
    ("172.16.0.1", "private"),
    ("172.31.255.254", "private"),
    ("192.168.1.1", "private"),
    ("fc00::1", "private"),
    ("fd12:3456::1", "private"),
    ("169.254.1.1", "link-local"),
    ("fe80::1", "link-local"),
    ("fe80::1%eth0", "link-local"),
    ("224.0.0.1", "multicast"),
    ("239.255.255.250", "multicast"),
    ("ff02::1", "multicast"),
    ("240.0.0.1", "reserved"),
    ("255.255.255.255", "reserved"),
    ("0.0.0.0", "unspecified"),
    ("::", "unspecified"),
    ("169.254.169.254", "cloud metadata"),
    ("fd00:ec2::254", "cloud metadata"),
    ("100.100.100.200", "cloud metadata"),
    ("100.64.0.1", "carrier-grade NAT"),
    ("100.127.255.255", "carrier-grade NAT"),
    ("::ffff:127.0.0.1", "loopback"),
    ("::ffff:10.0.0.1", "private"),
    ("::ffff:169.254.169.254", "cloud metadata"),
    ("::ffff:100.64.0.1", "carrier-grade NAT"),
    ("64:ff9b::a00:1", "private"),  # NAT64 form of 10.0.0.1
    ("2002:a9fe:a9fe::1", "cloud metadata"),  # 6to4 form of 169.254.169.254
    ("192.0.2.1", "private"),  # documentation range: not globally routable
])
def test_refused_addresses(address: str, reason: str) -> None:
    got = refusal_reason(ipaddress.ip_address(address))
    assert got is not None and got.startswith(reason), got


@pytest.mark.parametrize("address", [
    "8.8.8.8", "1.1.1.1", "93.184.216.34", "100.63.255.255", "100.128.0.0", "172.32.0.1",
    "2606:4700:4700::1111", "2a00:1450:4001::200e", "::ffff:8.8.8.8", "64:ff9b::808:808",
])
def test_public_addresses_pass(address: str) -> None:
    assert refusal_reason(ipaddress.ip_address(address)) is None


@pytest.fixture
def no_dns(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"unexpected DNS lookup {args}")

    monkeypatch.setattr(socket, "getaddrinfo", fail)


def fake_dns(monkeypatch: pytest.MonkeyPatch, answers: dict[str, list[str]]) -> list[str]:
    """Make getaddrinfo answer from ``answers``; return the list of names looked up."""
    asked: list[str] = []

    def getaddrinfo(host: str, port: int, *args: object, **kwargs: object) -> list:
        asked.append(host)
        out = []
        for address in answers[host]:
            ip = ipaddress.ip_address(address)
            if ip.version == 4:
                out.append((socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port)))
            else:
                out.append((socket.AF_INET6, socket.SOCK_STREAM, 6, "", (address, port, 0, 0)))
        return out

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return asked


def test_literal_allowed_without_dns(no_dns: None) -> None:
    guard = AddressGuard(["127.0.0.1/32"])
    assert guard.resolve("127.0.0.1", 8080) == [(socket.AF_INET, ("127.0.0.1", 8080))]


@pytest.mark.parametrize("host", ["127.0.0.2", "[::1]", "::ffff:127.0.0.2", "10.0.0.1"])
def test_literal_refused_without_dns(no_dns: None, host: str) -> None:
    guard = AddressGuard(["127.0.0.1/32"])
    with pytest.raises(BlockedAddress) as info:
        guard.resolve(host, 80)
    assert info.value.address == host.strip("[]")
    assert host.strip("[]") in str(info.value)


def test_allow_list_covers_ipv4_mapped_form(no_dns: None) -> None:
    guard = AddressGuard(["127.0.0.1/32"])
    [(family, sockaddr)] = guard.resolve("::ffff:127.0.0.1", 80)
    assert family == socket.AF_INET6 and sockaddr[1:] == (80, 0, 0)
    assert ipaddress.ip_address(sockaddr[0]) == ipaddress.ip_address("::ffff:127.0.0.1")


def test_allow_list_opens_a_private_network() -> None:
    guard = AddressGuard(["10.0.0.0/8"])
    assert guard.allowed(ipaddress.ip_address("10.9.8.7"))
    assert not guard.allowed(ipaddress.ip_address("192.168.0.1"))
    assert guard.allowed(ipaddress.ip_address("8.8.8.8"))


def test_default_guard_refuses_loopback() -> None:
    assert not AddressGuard().allowed(ipaddress.ip_address("127.0.0.1"))


def test_dns_answers_are_filtered(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = fake_dns(monkeypatch, {"mixed.test": ["10.0.0.5", "8.8.8.8", "8.8.8.8"]})
    guard = AddressGuard()
    assert guard.resolve("mixed.test", 443) == [(socket.AF_INET, ("8.8.8.8", 443))]
    assert asked == ["mixed.test"]


@pytest.mark.parametrize(("answer", "reason"), [
    (["169.254.169.254"], "cloud metadata"),
    (["10.0.0.5", "192.168.0.9"], "private"),
    (["100.64.3.4"], "carrier-grade NAT"),
    (["fe80::1"], "link-local"),
    (["::ffff:127.0.0.2"], "loopback"),
])
def test_dns_name_to_refused_address(monkeypatch: pytest.MonkeyPatch, answer: list[str],
                                     reason: str) -> None:
    fake_dns(monkeypatch, {"evil.test": answer})
    with pytest.raises(BlockedAddress) as info:
        AddressGuard(["127.0.0.1/32"]).resolve("evil.test", 80)
    message = str(info.value)
    assert "evil.test" in message and answer[0] in message and reason in message


def test_dns_failure_propagates(monkeypatch: pytest.MonkeyPatch) -> None:
    def getaddrinfo(*args: object, **kwargs: object) -> list:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    with pytest.raises(socket.gaierror):
        AddressGuard().resolve("nowhere.test", 80)
