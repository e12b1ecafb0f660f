"""Who may call what: API keys for inference, the admin token for admin and worker management."""

from __future__ import annotations

import functools
import hmac
import ipaddress

from aiohttp import web

from rolloutgate.config import GatewaySettings
from rolloutgate.errors import Forbidden, Unauthorized

__all__ = ("check_admin", "check_api_key", "check_worker_admin")


def _bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _remote_address(request: web.Request) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(request.remote or "")
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped  # a dual-stack listener sees IPv4 callers as ::ffff:a.b.c.d
    return address


def _is_loopback(request: web.Request) -> bool:
    address = _remote_address(request)
    return address is not None and address.is_loopback


def check_worker_admin(request: web.Request, settings: GatewaySettings) -> None:
    """The calls a training cluster's own machines make with no token (reference/miles.md): engines
    registering and removing themselves, and the rollout's engine-control calls (`/abort_request`,
    `/flush_cache`). As any admin call, or from a trusted network; pause, update and every other admin call
    stay behind the token."""
    address = _remote_address(request)
    if address is not None and any(address in net for net in _parsed(tuple(settings.trusted_networks))):
        return
    check_admin(request, settings)


@functools.cache
def _parsed(networks: tuple[str, ...]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """The settings' trusted networks, parsed once (the settings validated them)."""
    return tuple(ipaddress.ip_network(network, strict=False) for network in networks)


def check_admin(request: web.Request, settings: GatewaySettings) -> None:
    """Admin calls need the admin token when one is set; without one, only loopback clients (by default)."""
    if settings.admin_token:
        token = _bearer(request)
        if token is None or not hmac.compare_digest(token, settings.admin_token):
            raise Unauthorized(
                "admin endpoints need 'Authorization: Bearer <admin token>'", code="invalid_admin_token"
            )
        return
    if not settings.allow_remote_admin and not _is_loopback(request):
        raise Forbidden(
            "admin endpoints accept only loopback clients unless --allow-remote-admin is set (engines "
            "registering themselves: --trust-network CIDR)"
        )


def check_api_key(request: web.Request, settings: GatewaySettings) -> None:
    if not settings.api_keys:
        return
    token = _bearer(request)
    if token is None or not any(hmac.compare_digest(token, key) for key in settings.api_keys):
        raise Unauthorized("a valid API key is required ('Authorization: Bearer <key>')")
