"""Which addresses the downloader may connect to (DESIGN.md section 9).

A URL list is untrusted input: a row pointing at ``http://169.254.169.254/`` or at a
service on the build machine's private network must not be fetched. The guard works on
*resolved* addresses, so a public hostname whose DNS answer is private is refused too,
and the fetcher connects to the exact address vetted here (no second lookup that DNS
rebinding could change).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Cloud instance-metadata endpoints (AWS/GCP/Azure/OCI, AWS over IPv6, Alibaba). They hand
# out credentials, so they are named explicitly even where another rule would catch them.
_METADATA = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "fd00:ec2::254", "100.100.100.200"))
_CGNAT = ipaddress.ip_network("100.64.0.0/10")
# NAT64 well-known prefix: the last 32 bits are an IPv4 address a gateway will reach.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class BlockedAddress(Exception):
    """No address of a host may be contacted; ``str(err)`` says which and why."""

    def __init__(self, reason: str, address: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.address = address


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 form stands for (mapped, NAT64, 6to4, Teredo), if any."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]  # (server, client): the client is where traffic goes
    return None


def _classify(ip: IPAddress) -> str | None:
    # Order matters: the most specific (and most alarming) name wins in error messages.
    if ip in _METADATA:
        return "cloud metadata"
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if isinstance(ip, ipaddress.IPv4Address) and ip in _CGNAT:
        return "carrier-grade NAT"
    if ip.is_reserved:  # before is_private, which also lists 240.0.0.0/4
        return "reserved"
    if ip.is_private:
        return "private"
    if not ip.is_global:
        # Documentation, benchmarking, 6to4 relay anycast and the like.
        return "not globally routable"
    return None


def refusal_reason(ip: IPAddress) -> str | None:
    """Why ``ip`` must not be contacted (``"loopback"``, ``"private"``, ...); None if public."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.scope_id:
            # a scope id (fe80::1%eth0) does not change the class, but it breaks equality
            ip = ipaddress.IPv6Address(int(ip))
        inner = _embedded_ipv4(ip)
        if inner is not None:
            reason = _classify(inner)
            if reason is not None:
                return f"{reason} (IPv4 {inner} inside IPv6)"
            if ip.ipv4_mapped is not None or ip in _NAT64:
                # ::ffff:8.8.8.8 reaches 8.8.8.8; DNS64 hands out 64:ff9b::/96 on
                # IPv6-only clusters, where refusing it would refuse every IPv4 site
                return None
    return _classify(ip)


def _parse_literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _sockaddr(ip: IPAddress, port: int) -> tuple[int, tuple]:
    if isinstance(ip, ipaddress.IPv4Address):
        return socket.AF_INET, (str(ip), port)
    return socket.AF_INET6, (str(ip), port, 0, 0)


class AddressGuard:
    """Resolve hosts and keep only addresses that are public or explicitly allow-listed."""

    def __init__(self, allow_networks: Iterable[str] = ()) -> None:
        self._allow = [ipaddress.ip_network(n, strict=False) for n in allow_networks]

    def allowed(self, ip: IPAddress) -> bool:
        """True when ``ip`` is inside an allow-listed network or is a public address."""
        return self._allow_listed(ip) or refusal_reason(ip) is None

    def _allow_listed(self, ip: IPAddress) -> bool:
        candidates = [ip]
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            candidates.append(ip.ipv4_mapped)  # ::ffff:127.0.0.1 is 127.0.0.1 on the wire
        return any(c in net for c in candidates for net in self._allow)

    def resolve(self, host: str, port: int) -> list[tuple[int, tuple]]:
        """``(family, sockaddr)`` pairs to connect to; raise BlockedAddress if none is allowed.

        ``socket.gaierror`` from a failed lookup propagates unchanged.
        """
        literal = _parse_literal(host)
        if literal is not None:
            candidates = [_sockaddr(literal, port)]
        else:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       proto=socket.IPPROTO_TCP)
            candidates = [(family, sockaddr) for family, _, _, _, sockaddr in infos
                          if family in (socket.AF_INET, socket.AF_INET6)]
        allowed: list[tuple[int, tuple]] = []
        refused: list[tuple[str, str]] = []
        for family, sockaddr in candidates:
            ip = ipaddress.ip_address(sockaddr[0])
            if self.allowed(ip):
                if (family, sockaddr) not in allowed:
                    allowed.append((family, sockaddr))
            else:
                shown = host.strip("[]") if literal is not None else sockaddr[0]
                refused.append((shown, refusal_reason(ip) or "refused"))
        if allowed:
            return allowed
        if not refused:
            raise BlockedAddress(f"{host} has no IPv4/IPv6 address")
        address, reason = refused[0]
        via = "" if literal is not None else f"{host} resolves to "
        raise BlockedAddress(f"{via}refused address {address} ({reason})", address)
