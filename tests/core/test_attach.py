from __future__ import annotations

import math

import pytest

from rolloutgate.core.attach import AttachIndex, attach_key


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"idempotency_key": "abc"}, "key:abc"),
        ({"idempotency_key": "abc", "session_id": "s", "body_hash": "h"}, "key:abc"),
        ({"session_id": "s", "body_hash": "h"}, "session:s:h"),
        ({"body_hash": "h"}, None),  # never a bare body hash
        ({"session_id": "s"}, None),
        ({}, None),
    ],
)
def test_attach_key(kwargs: dict[str, str], key: str | None) -> None:
    assert attach_key(**kwargs) == key


def test_live_then_finished_then_expired() -> None:
    idx = AttachIndex(ttl_s=10.0, max_finished=100)
    idx.register("k", "r1", 0.0)
    assert idx.lookup("k", 1.0).request_id == "r1"  # type: ignore[union-attr]
    assert not idx.lookup("k", 1.0).is_finished  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        idx.register("k", "r2", 1.0)
    assert idx.finished("r1", 5.0) == []
    entry = idx.lookup("k", 14.9)
    assert entry is not None and entry.is_finished and entry.expires_at == 15.0
    assert idx.next_expiry_at() == 15.0
    assert idx.expire(14.0) == []
    assert idx.expire(15.0) == ["r1"]
    assert idx.lookup("k", 15.0) is None and idx.next_expiry_at() == math.inf
    assert idx.finished("unknown", 1.0) == []


def test_lookup_after_ttl_is_none_even_before_expire() -> None:
    idx = AttachIndex(ttl_s=1.0)
    idx.register("k", "r1", 0.0)
    idx.finished("r1", 0.0)
    assert idx.lookup("k", 1.0) is None and idx.finished_count == 0


def test_lru_bound_on_finished_entries() -> None:
    idx = AttachIndex(ttl_s=100.0, max_finished=2)
    for i in range(3):
        idx.register(f"k{i}", f"r{i}", 0.0)
    idx.finished("r0", 1.0)
    idx.finished("r1", 2.0)
    assert idx.lookup("k0", 3.0) is not None  # k0 becomes most recently used
    assert idx.finished("r2", 3.0) == ["r1"]  # the least recently used goes
    assert idx.lookup("k1", 3.0) is None and idx.lookup("k0", 3.0) is not None
    assert idx.finished_count == 2 and idx.live_count == 0
    assert idx.expire(101.0) == ["r0"]  # r1's expiry is skipped: already evicted
    assert idx.expire(200.0) == ["r2"]


def test_discard_and_reregister_replaces_finished() -> None:
    idx = AttachIndex(ttl_s=10.0)
    idx.register("k", "r1", 0.0)
    assert idx.discard("r1") and not idx.discard("r1")
    assert idx.lookup("k", 0.0) is None
    idx.register("k", "r2", 0.0)
    idx.finished("r2", 1.0)
    idx.register("k", "r3", 2.0)  # a new request under the same key replaces the finished entry
    assert idx.lookup("k", 2.0).request_id == "r3"  # type: ignore[union-attr]
    assert idx.expire(100.0) == [] and idx.next_expiry_at() == math.inf
    assert "1 live" in repr(idx)


def test_invalid_settings() -> None:
    with pytest.raises(ValueError):
        AttachIndex(ttl_s=-1.0)
    with pytest.raises(ValueError):
        AttachIndex(max_finished=-1)


def test_next_expiry_skips_entries_evicted_or_replaced() -> None:
    idx = AttachIndex(ttl_s=10.0, max_finished=1)
    idx.register("a", "r1", 0.0)
    idx.register("b", "r2", 0.0)
    idx.finished("r1", 1.0)
    assert idx.finished("r2", 2.0) == ["r1"]  # r1 evicted: its expiry (11.0) is stale
    assert idx.next_expiry_at() == 12.0


def test_a_session_result_read_in_full_is_forgotten_an_explicit_keys_is_kept() -> None:
    idx = AttachIndex(ttl_s=10.0)
    session, explicit = attach_key(session_id="s", body_hash="h"), attach_key(idempotency_key="k")
    assert session is not None and explicit is not None
    for key, rid in ((session, "r1"), (explicit, "r2")):
        idx.register(key, rid, 0.0)
        idx.finished(rid, 1.0)
    assert not idx.delivered(session, "other")  # a key that names another request: kept
    assert idx.delivered(session, "r1") and idx.lookup(session, 2.0) is None
    assert not idx.delivered(explicit, "r2") and idx.lookup(explicit, 2.0) is not None
    assert idx.expire(11.0) == ["r2"]  # the forgotten entry's expiry is skipped
