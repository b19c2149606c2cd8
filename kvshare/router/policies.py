"""Placement policies: small strategy objects, each with one `choose()` (and an optional `placed()` to learn from).

Contract for every policy:
- `choose(request, candidates)` gets a non-empty list of healthy replicas not yet tried for this request, in
  configured order, and returns one of them. It must not block or do I/O.
- `placed(request, replica)` is called once the chosen replica has answered (first byte received); policies that
  remember where things went (alternate, cache-aware) record it there, so a failed attempt teaches them nothing.
All of it runs on the router's event loop only, so the state needs no lock. Switching policy at run time builds a
fresh instance: the new arm starts with no memory of the old one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import ClassVar

import xxhash

from kvshare.router.config import RouterConfig
from kvshare.router.prefix import PrefixMemory, prompt_keys
from kvshare.router.replicas import Replica
from kvshare.router.request import RequestInfo


class Policy(ABC):
    name: ClassVar[str]
    reads_prompt: ClassVar[bool] = False  # True: choose() reads the prompt, so the router must decode it

    def __init__(self, config: RouterConfig) -> None:
        self.config = config

    @abstractmethod
    def choose(self, request: RequestInfo, candidates: list[Replica]) -> Replica: ...

    def placed(self, request: RequestInfo, replica: Replica) -> None:
        """Called after `replica` answered the request; most policies need nothing here."""


class Rotation:
    """A cursor over replica indices: the next candidate after the last one returned, wrapping around. Unlike a
    counter modulo len(candidates), it does not skip or repeat replicas when one leaves or rejoins rotation."""

    def __init__(self) -> None:
        self.last_index = -1

    def next(self, candidates: list[Replica]) -> Replica:
        chosen = next_after(candidates, self.last_index)
        self.last_index = chosen.index
        return chosen


def next_after(candidates: list[Replica], index: int) -> Replica:
    return next((r for r in candidates if r.index > index), candidates[0])


class RoundRobin(Policy):
    """Every request goes to the next healthy replica in order, whatever its session."""

    name = "round-robin"

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self.rotation = Rotation()

    def choose(self, request: RequestInfo, candidates: list[Replica]) -> Replica:
        return self.rotation.next(candidates)


class Alternate(Policy):
    """Successive requests of one session go to different replicas (the next one after the session's last, in
    order): the cross-replica case a shared pool is for. A session's first request, and a request with no
    session, take the global round-robin turn. Sessions are remembered in an LRU of `sessions_remembered`."""

    name = "alternate"

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self.rotation = Rotation()
        self.last_by_session: OrderedDict[str, int] = OrderedDict()

    def choose(self, request: RequestInfo, candidates: list[Replica]) -> Replica:
        last = self.last_by_session.get(request.session_id) if request.session_id else None
        return self.rotation.next(candidates) if last is None else next_after(candidates, last)

    def placed(self, request: RequestInfo, replica: Replica) -> None:
        if request.session_id:
            self.last_by_session[request.session_id] = replica.index
            self.last_by_session.move_to_end(request.session_id)
            while len(self.last_by_session) > self.config.sessions_remembered:
                self.last_by_session.popitem(last=False)


class Fixed(Policy):
    """A session always lands on the same replica: rendezvous (highest-random-weight) hashing of the session id
    with each replica's URL by seedless xxh3-64, so adding or removing a replica moves only the sessions that
    hashed highest to it. With no session id, requests take round-robin turns."""

    name = "fixed"

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self.rotation = Rotation()

    def choose(self, request: RequestInfo, candidates: list[Replica]) -> Replica:
        if not request.session_id:
            return self.rotation.next(candidates)
        return max(candidates, key=lambda r: rendezvous_weight(request.session_id, r.url))


def rendezvous_weight(session_id: str, replica_url: str) -> int:
    return xxhash.xxh3_64_intdigest(session_id.encode() + b"\0" + replica_url.encode())


class LeastLoaded(Policy):
    """The replica with the fewest requests in flight; ties take round-robin turns."""

    name = "least-loaded"

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self.rotation = Rotation()

    def choose(self, request: RequestInfo, candidates: list[Replica]) -> Replica:
        fewest = min(r.in_flight for r in candidates)
        return self.rotation.next([r for r in candidates if r.in_flight == fewest])


class CacheAware(Policy):
    """Prefer the replica that most likely holds the prompt's longest prefix, weighed against its load.

    Score (lower wins) = uncached_fraction + load_weight * in_flight, where uncached_fraction = 1 - matched / total
    chunks of the prompt (1.0 for a prompt with no full chunk) and `matched` is the deepest prompt chunk key this
    router recently sent to the replica (prefix.PrefixMemory). With load_weight 0.5, a fully cached prompt is
    worth two in-flight requests. With a shared pool a local miss costs only a load from host memory, so a larger
    load_weight suits it; without one, a smaller one. Ties take round-robin turns."""

    name = "cache-aware"
    reads_prompt = True

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self.rotation = Rotation()
        self.memory: dict[int, PrefixMemory] = {}

    def choose(self, request: RequestInfo, candidates: list[Replica]) -> Replica:
        keys = self._keys(request)
        scores = {r.index: self.score(keys, r) for r in candidates}
        best = min(scores.values())
        return self.rotation.next([r for r in candidates if scores[r.index] == best])

    def score(self, keys: list[bytes], replica: Replica) -> float:
        matched = self._memory(replica).matched_chunks(keys)
        uncached = 1.0 - matched / len(keys) if keys else 1.0
        return uncached + self.config.load_weight * replica.in_flight

    def placed(self, request: RequestInfo, replica: Replica) -> None:
        self._memory(replica).remember(self._keys(request))

    def _keys(self, request: RequestInfo) -> list[bytes]:
        return prompt_keys(request, self.config.prefix_chunk_tokens, self.config.prefix_chunk_bytes)

    def _memory(self, replica: Replica) -> PrefixMemory:
        if replica.index not in self.memory:
            self.memory[replica.index] = PrefixMemory(self.config.prefix_keys_per_replica)
        return self.memory[replica.index]


POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (RoundRobin, Alternate, Fixed, LeastLoaded, CacheAware)}


def make_policy(name: str, config: RouterConfig) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}: choose one of {', '.join(POLICIES)}")
    return POLICIES[name](config)
