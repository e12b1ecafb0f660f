"""Who may call what: API keys for inference, the admin token for admin and worker management."""

from __future__ import annotations

import hmac
import ipaddress

from aiohttp import web

from rolloutgate.config import GatewaySettings
from rolloutgate.errors import Forbidden, Unauthorized

__all__ = ("check_admin", "check_api_key")


def _bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _is_loopback(request: web.Request) -> bool:
    remote = request.remote
    if not remote:
        return False
    try:
        return ipaddress.ip_address(remote).is_loopback
    except ValueError:
        return False


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
        raise Forbidden("admin endpoints accept only loopback clients unless --allow-remote-admin is set")


def check_api_key(request: web.Request, settings: GatewaySettings) -> None:
    if not settings.api_keys:
        return
    token = _bearer(request)
    if token is None or not any(hmac.compare_digest(token, key) for key in settings.api_keys):
        raise Unauthorized("a valid API key is required ('Authorization: Bearer <key>')")
