"""Attach keys at the edge (server/attach.py `key_for`): explicit keys first, else the session and the body."""

from __future__ import annotations

import hashlib

from multidict import CIMultiDict

from rolloutgate.server.attach import key_for


def test_a_request_without_a_key_or_a_session_has_no_attach_key() -> None:
    assert key_for(CIMultiDict(), None, b"{}") is None
    assert key_for(CIMultiDict({"Idempotency-Key": ""}), None, b"{}") is None


def test_an_explicit_key_wins_over_the_session() -> None:
    assert key_for(CIMultiDict({"idempotency-key": "k1"}), "s", b"{}") == "key:k1"
    assert key_for(CIMultiDict({"X-Request-Id": "r1"}), None, b"{}") == "key:r1"
    both = CIMultiDict({"X-Request-Id": "r1", "Idempotency-Key": "k1"})
    assert key_for(both, None, b"{}") == "key:k1"


def test_a_session_request_is_keyed_by_its_body() -> None:
    digest = hashlib.sha256(b'{"a":1}').hexdigest()[:32]
    assert key_for(CIMultiDict(), "agent-7", b'{"a":1}') == f"session:agent-7:{digest}"
    assert key_for(CIMultiDict(), "agent-7", b'{"a":2}') != key_for(CIMultiDict(), "agent-7", b'{"a":1}')
