"""Who owns what in a fleet: engines to replicas (sticky, balanced), keys to replicas (rendezvous hashing).

Theory of operation: sans-IO, like core/. `Assignment` is a plain object driven by four events (a replica
joined or left, an engine was added or removed); each returns the ownership moves it made. `FleetView` is an
immutable snapshot of it (plus each replica's URL), the one thing replicas are told; every routing question a
replica asks is answered from its view alone, with no table of keys anywhere.

Engines. Each engine has exactly one owner while any replica is live; the owner alone admits, places, times
and health-checks it, so those stay exact and local. The rule, applied after every event:

1. an engine without an owner (new, or its owner left) goes to the least-loaded live replica (ties: the
   replica id, so the choice is deterministic);
2. then, while the most-loaded live replica holds two engines more than the least-loaded one, its most
   recently assigned engine moves to the least-loaded one.

So an engine keeps its owner while the owner lives, except for the moves balance needs, and those are as few
as balance allows (a joining or returning replica takes its fair share: floor or ceil of engines / replicas;
removing an engine can cost one move). Loads always differ by at most one. A move is not free: the old owner
drops the engine from its pool, and the calls it had running there are aborted and re-queued on its other
engines (core: EngineLeft). Balance is worth it because keys are spread evenly over replicas (below): a
replica with no engines could not serve its keys. Not yet: a drained hand-over.

Keys. A routing key (X-SMG-Routing-Key, X-Session-Id, a session id in a path) belongs to one replica:

- a session id minted by a replica names it (`replica-2.<hex>`, `mint_session_id`), so a session stays with
  the replica that holds its records for as long as that replica lives, whoever joins;
- any other key, or a session whose replica is gone: rendezvous hashing (highest random weight) over the live
  replicas that own engines (all live replicas while none does). Stable under membership change: when a
  replica leaves, only its keys move; when one joins, keys move only to it. No table: one blake2b of the key,
  then a 64-bit mix per replica (docs/fleet.md: ~3 us for 3 replicas, ~40 us for 64).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = (
    "Assignment",
    "EngineEntry",
    "FleetView",
    "Move",
    "engine_fleet_id",
    "mint_session_id",
    "named_replica",
    "rendezvous_order",
    "rendezvous_owner",
)

SESSION_ID_SEPARATOR = "."
MAX_REPLICA_ID_BYTES = 64
KEY_CACHE_ENTRIES = 65_536  # keys whose owner a view remembers


@dataclass(frozen=True, slots=True)
class EngineEntry:
    """An engine as the fleet knows it: what a replica needs to add it to its pool (config.EngineSpec)."""

    url: str
    family: str = "auto"
    capacity: int | None = None


@dataclass(frozen=True, slots=True)
class Move:
    """One engine changed owner: `source` None = it had none (new); `target` None = it has none (removed, or
    no replica is live)."""

    engine: str
    source: str | None
    target: str | None


def check_replica_id(replica_id: str) -> str:
    if not replica_id or SESSION_ID_SEPARATOR in replica_id or "/" in replica_id:
        raise ValueError(f"a replica id is non-empty, without '.' or '/': {replica_id!r}")
    if len(replica_id.encode()) > MAX_REPLICA_ID_BYTES:
        raise ValueError(f"a replica id is at most {MAX_REPLICA_ID_BYTES} bytes: {replica_id!r}")
    return replica_id


class Assignment:
    """Engines to live replicas (module docstring). Engines and replicas are named by strings (URL, id)."""

    def __init__(self) -> None:
        self._replicas: dict[str, list[str]] = {}  # live replica -> its engines, oldest assignment first
        self._owner: dict[str, str | None] = {}  # engine -> owner; insertion order = arrival order

    # -- events ------------------------------------------------------------------------------------------

    def add_replica(self, replica_id: str) -> list[Move]:
        if replica_id in self._replicas:
            return []
        self._replicas[check_replica_id(replica_id)] = []
        return self._settle()

    def remove_replica(self, replica_id: str) -> list[Move]:
        engines = self._replicas.pop(replica_id, None)
        if engines is None:
            return []
        for engine in engines:
            self._owner[engine] = None
        moves = self._settle()
        # the engines no live replica took (none is left): they have no owner now
        departed = set(engines)
        taken = {m.engine for m in moves}
        orphaned = [Move(engine, replica_id, None) for engine in engines if engine not in taken]
        moved = [
            Move(m.engine, replica_id, m.target) if m.source is None and m.engine in departed else m
            for m in moves
        ]
        return moved + orphaned

    def add_engine(self, engine: str, prefer: str | None = None) -> list[Move]:
        """`prefer`: a live replica that should keep it if balance allows (it already serves the engine)."""
        if engine in self._owner:
            return []
        if prefer is not None and prefer in self._replicas:
            self._owner[engine] = prefer
            self._replicas[prefer].append(engine)
            return [Move(engine, None, prefer), *self._settle()]
        self._owner[engine] = None
        return self._settle()

    def remove_engine(self, engine: str) -> list[Move]:
        if engine not in self._owner:
            return []
        owner = self._owner.pop(engine)
        if owner is not None:
            self._replicas[owner].remove(engine)
        return [Move(engine, owner, None), *self._settle()]

    # -- reads -------------------------------------------------------------------------------------------

    @property
    def replicas(self) -> list[str]:
        """Live replicas, in the order they joined."""
        return list(self._replicas)

    @property
    def engines(self) -> list[str]:
        return list(self._owner)

    def owner(self, engine: str) -> str | None:
        return self._owner.get(engine)

    def engines_of(self, replica_id: str) -> list[str]:
        return list(self._replicas.get(replica_id, ()))

    def loads(self) -> dict[str, int]:
        return {replica: len(engines) for replica, engines in self._replicas.items()}

    # -- the rule ----------------------------------------------------------------------------------------

    def _least_loaded(self) -> str:
        return min(self._replicas, key=lambda r: (len(self._replicas[r]), r))

    def _most_loaded(self) -> str:
        return max(self._replicas, key=lambda r: (len(self._replicas[r]), r))

    def _settle(self) -> list[Move]:
        if not self._replicas:
            return []
        moves: list[Move] = []
        for engine, owner in self._owner.items():
            if owner is None:
                target = self._least_loaded()
                self._owner[engine] = target
                self._replicas[target].append(engine)
                moves.append(Move(engine, None, target))
        # Each move narrows the spread; bounded by the number of engines.
        for _ in range(len(self._owner)):
            heavy, light = self._most_loaded(), self._least_loaded()
            if len(self._replicas[heavy]) - len(self._replicas[light]) <= 1:
                break
            engine = self._replicas[heavy].pop()
            self._replicas[light].append(engine)
            self._owner[engine] = light
            moves.append(Move(engine, heavy, light))
        return moves


# -- keys ----------------------------------------------------------------------------------------------------


_MASK64 = (1 << 64) - 1


@functools.cache
def _salt(replica_id: str) -> int:
    """A replica's 64-bit salt, once per replica id (a handful per fleet)."""
    return int.from_bytes(hashlib.blake2b(replica_id.encode(), digest_size=8).digest(), "big")


def _mix(x: int) -> int:
    """splitmix64's finalizer: each input bit reaches every output bit, so (key hash ^ salt) is a fair
    weight per replica at a few integer operations, not one hash per replica."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def rendezvous_owner(key: str, replicas: Iterable[str]) -> str | None:
    """The replica with the highest weight for `key` (ties, which need equal 64-bit weights: the larger
    id); None when there is none."""
    hashed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
    best, best_weight = None, -1
    for replica_id in replicas:
        weight = _mix(hashed ^ _salt(replica_id))
        if weight > best_weight or (weight == best_weight and best is not None and replica_id > best):
            best, best_weight = replica_id, weight
    return best


def rendezvous_order(key: str, replicas: Iterable[str]) -> list[str]:
    """Every replica by its weight for `key`, highest first (`rendezvous_owner` is the first)."""
    hashed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
    return sorted(replicas, key=lambda r: (_mix(hashed ^ _salt(r)), r), reverse=True)


def mint_session_id(replica_id: str, token: str) -> str:
    """A session id that names the replica holding its records; `token` is the unique part (random hex)."""
    return f"{replica_id}{SESSION_ID_SEPARATOR}{token}"


def named_replica(key: str) -> str | None:
    """The replica a minted session id names (any key of the form `<id>.<rest>`), else None."""
    replica_id, separator, rest = key.partition(SESSION_ID_SEPARATOR)
    return replica_id if separator and replica_id and rest else None


def engine_fleet_id(url: str) -> str:
    """An engine's id across the fleet (`GET /workers`, `DELETE /workers/{id}`): from its URL, path-safe and
    the same on every replica (each replica's pool numbers its own engines `engine-N`)."""
    return "e-" + hashlib.blake2b(url.encode(), digest_size=6).hexdigest()


# -- the snapshot replicas get ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FleetView:
    """The fleet at one `version` of one controller `epoch` (a restarted controller starts a new epoch).

    `replicas`: live replica id -> its base URL, in the order they joined. `engines`: every engine, with its
    owner (None only while no replica is live). `weight_versions`: the weight version each engine held when
    its owner last answered a fleet-wide operation (fleet/controller.py), so that each replica judges its own
    engines' lag against the whole fleet's newest weights."""

    epoch: str
    version: int
    replicas: Mapping[str, str]
    engines: Mapping[str, EngineEntry]
    owners: Mapping[str, str | None]
    incarnations: Mapping[str, str] = field(default_factory=dict)  # replica id -> its process's token
    weight_versions: Mapping[str, str | None] = field(default_factory=dict)  # engine URL -> its label
    # replica id -> what its peers reach it by (its Ray actor handle; in one process the replica itself)
    handles: Mapping[str, object] = field(default_factory=dict, compare=False, repr=False)
    key_candidates: tuple[str, ...] = field(init=False)
    # key -> owner, as this view answered: a session's or a rollout's key comes back every turn
    _owner_of_key: dict[str, str | None] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        owning = set(self.owners.values())
        holding = tuple(r for r in self.replicas if r in owning)
        object.__setattr__(self, "key_candidates", holding or tuple(self.replicas))
        object.__setattr__(self, "_owner_of_key", {})

    @classmethod
    def of(
        cls,
        assignment: Assignment,
        *,
        epoch: str,
        version: int,
        urls: Mapping[str, str],
        engines: Mapping[str, EngineEntry],
        incarnations: Mapping[str, str],
        handles: Mapping[str, object] | None = None,
        weight_versions: Mapping[str, str | None] | None = None,
    ) -> FleetView:
        live = assignment.replicas
        return cls(
            epoch=epoch,
            version=version,
            replicas={r: urls[r] for r in live},
            engines={url: engines[url] for url in assignment.engines},
            owners={url: assignment.owner(url) for url in assignment.engines},
            incarnations={r: incarnations[r] for r in live if r in incarnations},
            handles={r: handle for r, handle in (handles or {}).items() if r in live},
            weight_versions={u: v for u, v in (weight_versions or {}).items() if u in assignment.engines},
        )

    def engines_of(self, replica_id: str) -> list[str]:
        return [url for url, owner in self.owners.items() if owner == replica_id]

    def key_owner(self, key: str) -> str | None:
        """The live replica that owns `key` (module docstring); None when no replica is live."""
        known = self._owner_of_key
        if key in known:
            return known[key]
        named = named_replica(key)
        owner = named if named is not None and named in self.replicas else None
        owner = owner or rendezvous_owner(key, self.key_candidates)
        if len(known) >= KEY_CACHE_ENTRIES:
            known.clear()  # bounded; the hot keys come back at once
        known[key] = owner
        return owner

    def without(self, replica_id: str) -> FleetView:
        """This view as it will be once `replica_id` is taken out (its engines without an owner)."""
        return FleetView(
            epoch=self.epoch,
            version=self.version,
            replicas={r: u for r, u in self.replicas.items() if r != replica_id},
            engines=self.engines,
            owners={e: (None if o == replica_id else o) for e, o in self.owners.items()},
            incarnations={r: i for r, i in self.incarnations.items() if r != replica_id},
            handles={r: h for r, h in self.handles.items() if r != replica_id},
            weight_versions=self.weight_versions,
        )

    def preference(self, key: str) -> list[str]:
        """The live replicas in the order `key_owner` would pick them as each one before goes: the replica a
        minted session id names, then the key's rendezvous order. A session's first two are its owner and
        its backup (fleet/replication.py)."""
        named = named_replica(key)
        first = [named] if named is not None and named in self.replicas else []
        return first + [r for r in rendezvous_order(key, self.key_candidates) if r not in first]

    def url_of(self, replica_id: str) -> str | None:
        return self.replicas.get(replica_id)
