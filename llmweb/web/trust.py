"""What a request's transport says about where it came from: its client's address, and the checks
against other sites' pages. Never who it is: being the machine's owner rests on a secret
(web/owner.py), not on any of this, because a forwarder can make a stranger look local in every way.

A request's client ADDRESS (per-address limits, the login back-off, logs) is the TCP peer, unless
the peer is one of `LLMWEB_TRUSTED_PROXIES`: then the rightmost address of `X-Forwarded-For` (or of
`Forwarded: for=`) that is not itself a trusted proxy: the last hop a proxy we trust saw, which a
client cannot choose by sending a header of its own. A header from an untrusted peer is never
believed. On a Hugging Face Space (`SYSTEM=spaces`, cli/main.py) the default is `SPACES_INGRESS`:
the Space's ingress reaches the app from a private address and appends the visitor's address to
X-Forwarded-For (Gradio's docs: on Spaces `request.client.host` is the proxy's, e.g. 10.16.x.x).

Per-address limits (new anonymous visitors, the login back-off, uploads) count a client's GROUP, not
its address: an IPv6 address's network of `LLMWEB_IPV6_PREFIX` bits (64: what one home line or one
server gets, so a client cannot be 2^64 addresses), an IPv4-mapped IPv6 address its IPv4 address,
and any other address itself.

`Origin.local` (a loopback bind and peer, no forwarding header, a Host naming this machine) is only
a hint for the page's notice ("open the link printed in the terminal"), never trust.
`cross_site` and `host_is_local` refuse other sites' pages (CSRF) and DNS rebinding on `/v1`.

Pure functions over a request's peer address and headers (Gradio's `gr.Request` and Starlette's
`Request` both have `.client.host` and `.headers`). This module must not decide an owner
(web/identity.py does) or keep state.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from llmweb.config import Settings

LOCAL_HOSTNAMES = ("localhost", "127.0.0.1", "[::1]")
# the peers a Space's app sees: its ingress, from the platform's private network (and this container)
SPACES_INGRESS = "10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,100.64.0.0/10,fc00::/7,127.0.0.0/8,::1"
_FORWARDING = ("forwarded", "x-real-ip")  # and every x-forwarded-* header
_FOR = re.compile(r'for\s*=\s*("[^"]*"|[^;,\s]+)', re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a request came from: its client's address ("" unknown) and whether it looks local (a hint only)."""

    address: str
    local: bool
    forwarded: bool  # a forwarding header arrived (from a proxy, or from someone pretending)
    host_ok: bool  # the Host header names this machine (checked only on a loopback bind)
    group: str = ""  # what the per-address limits count (`address_group`)


def headers_of(request) -> dict[str, str]:
    """A request's headers, lower-cased; a repeated header's values joined with ", "."""
    raw = getattr(request, "headers", None)
    if raw is None:
        return {}
    items: Iterable = raw.items() if hasattr(raw, "items") else []
    if hasattr(raw, "multi_items"):  # Starlette's Headers: every line of a repeated header
        items = raw.multi_items()
    out: dict[str, str] = {}
    for k, v in items:
        k = str(k).lower()
        out[k] = f"{out[k]}, {v}" if k in out else str(v)
    return out


def peer_of(request) -> str:
    client = getattr(request, "client", None)
    host = getattr(client, "host", None) if client is not None else None
    return host if isinstance(host, str) else ""


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    text = text.strip().strip('"')
    if text.startswith("["):  # [v6]:port
        text = text[1 : text.find("]")] if "]" in text else text
    elif text.count(":") == 1:  # v4:port
        text = text.split(":")[0]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def is_loopback(address: str) -> bool:
    ip = _ip(address)
    return ip is not None and ip.is_loopback


def _trusted(address: str, networks) -> bool:
    ip = _ip(address)
    return ip is not None and any(ip in net for net in networks)


def is_forwarded(headers: Mapping[str, str]) -> bool:
    return any(k in _FORWARDING or k.startswith("x-forwarded-") for k in headers)


def _forwarded_chain(headers: Mapping[str, str]) -> list[str]:
    """The hops a proxy recorded, oldest first: X-Forwarded-For, else Forwarded's for= values."""
    if headers.get("x-forwarded-for"):
        return [h.strip() for h in headers["x-forwarded-for"].split(",") if h.strip()]
    return [m.group(1).strip('"') for m in _FOR.finditer(headers.get("forwarded", ""))]


def client_address(settings: Settings, peer: str, headers: Mapping[str, str]) -> str:
    """The client's address: the peer, or (behind trusted proxies) the rightmost untrusted hop."""
    networks = settings.proxy_networks
    if not networks or not _trusted(peer, networks):
        return peer
    chain = _forwarded_chain(headers)
    for hop in reversed(chain):
        if not _trusted(hop, networks):
            ip = _ip(hop)
            return str(ip) if ip is not None else hop[:64]
    return str(_ip(chain[0]) or chain[0][:64]) if chain else peer


def address_group(address: str, ipv6_prefix: int) -> str:
    """The key per-address limits count `address` under: an IPv6 address's /`ipv6_prefix` network, an
    IPv4-mapped IPv6 address's IPv4 address, anything else itself."""
    ip = _ip(address)
    if not isinstance(ip, ipaddress.IPv6Address):
        return address
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.ip_network((int(ip), ipv6_prefix), strict=False))


def host_is_local(host: str | None, port: int | None = None) -> bool:
    """Does a `Host` header name this machine (localhost, 127.0.0.1, [::1]), with `port` if given?"""
    if not host:
        return False
    host = host.strip().lower()
    name, _, given = host.rpartition(":") if not host.endswith("]") else (host, "", "")
    if not name:  # no port at all
        name, given = host, ""
    if name not in LOCAL_HOSTNAMES:
        return False
    if given and not given.isdigit():
        return False
    return port is None or not given or int(given) == port


def origin_of(settings: Settings, request, port: int | None = None) -> Origin:
    """Where `request` came from, and whether it looks local (this module's docstring: a hint, not trust)."""
    headers, peer = headers_of(request), peer_of(request)
    forwarded = is_forwarded(headers)
    host_ok = host_is_local(headers.get("host"), port)
    local = settings.on_loopback and is_loopback(peer) and not forwarded and host_ok
    address = client_address(settings, peer, headers)
    return Origin(address, local, forwarded, host_ok, address_group(address, settings.ipv6_prefix))


def cross_site(headers: Mapping[str, str]) -> bool:
    """A browser request sent by a page of another site: its `Origin` is not this server's Host
    (or is "null"), or the browser says so (`Sec-Fetch-Site: cross-site`)."""
    if headers.get("sec-fetch-site", "").lower() == "cross-site":
        return True
    origin = headers.get("origin")
    if origin is None:
        return False  # not a browser's cross-origin request (curl, SDKs, same-origin GETs)
    parts = urlsplit(origin.strip())
    return not parts.netloc or parts.netloc.lower() != (headers.get("host") or "").strip().lower()
