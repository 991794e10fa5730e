"""A node's book of preserved Prefill caches, kept where the scheduler lives (the engine process).

A Prefill session whose request asked to preserve its cache stays in the scheduler after its answer until a
Decode node migrates it (and frees it over ZMQ), the proxy frees it (``/distserve/free_cache``), or nobody
does and the orphan TTL reclaims it. The book knows which sessions those are, gives every free and every
claim a definitive answer, and counts each outcome for the node audit. No patching here.

A Decode's claim is a lease: the orphan TTL waits until the lease ends, so a migration that sat in a queue
never copies blocks already handed to other work. A claim is exclusive: one per cache, so one Decode request
migrates it and no claim extends a hold past one lease. A free still releases at once: the proxy frees only once
its Decode request has ended (and its gc leaves migrating requests alone), and a Decode frees once its
migration has ended, copied or failed.
"""

from __future__ import annotations

import enum
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lmdeploy_pdfix import settings

_REMEMBERED_RELEASES = 4096  # owners remembered after their release, per kind
_AGE_BUCKETS_S = (10.0, 60.0, 300.0)


class Verdict(str, enum.Enum):
    RELEASED = 'released'
    CLAIMED = 'claimed'
    NOT_FOUND = 'not_found'
    RECLAIMED = 'reclaimed'  # the orphan TTL released it; a late Decode must not read its blocks
    REFUSED = 'refused'


class ReleaseCause(str, enum.Enum):
    DECODE_FREED = 'decode_freed'  # its Decode node freed it over ZMQ once the migration ended (copied or failed)
    FREED = 'freed'  # /distserve/free_cache (the proxy compensating a failure, or its gc)
    RECLAIMED = 'reclaimed'  # nobody claimed or freed it within the orphan TTL, or its claim's lease ran out
    CANCELLED = 'cancelled'  # its request was aborted before the cache was handed out
    ABORTED = 'aborted'  # the node was told to abort all its work (abort_all, sleep) before a Decode claimed it


@dataclass(frozen=True)
class Answer:
    verdict: Verdict
    detail: str = ''
    counted_as: str = ''  # how the audit counts a free that released nothing

    def as_dict(self) -> dict[str, str]:
        return {'status': self.verdict.value, 'detail': self.detail}


@dataclass
class PreservedCache:
    owner: int
    block_ids: tuple[int, ...]
    preserved_at: float
    held_until: float  # the end of the orphan TTL, or of the latest claim's lease: reclaimed after it
    claimed: bool = False
    freed_by: str | None = None  # the Decode node that freed it over ZMQ after its copy (as the link names it)


class PreservedBook:

    def __init__(self, orphan_ttl_s: float = settings.ORPHAN_TTL_S.default,
                 claim_hold_s: float = settings.CLAIM_LEASE_S.default,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.orphan_ttl_s = orphan_ttl_s
        self.claim_hold_s = claim_hold_s
        self._clock = clock
        self._caches: dict[int, PreservedCache] = {}
        self._reclaimed: OrderedDict[int, None] = OrderedDict()
        # caches their Decode freed after copying them: a claim that ran alongside the copy may come after the free
        self._migrated: OrderedDict[int, PreservedCache] = OrderedDict()
        self.releases: Counter[str] = Counter()
        self.frees: Counter[str] = Counter()
        self.claims: Counter[str] = Counter()
        self.migration_failures: Counter[str] = Counter()
        self.migrations_aborted = 0  # Decode requests whose client left before or during their migration

    def preserve(self, owner: int, block_ids: Sequence[int]) -> None:
        now = self._clock()
        self._caches[owner] = PreservedCache(owner, tuple(block_ids), preserved_at=now,
                                             held_until=now + self.orphan_ttl_s)

    def is_preserved(self, owner: int) -> bool:
        return owner in self._caches

    def cancelled(self) -> None:
        """Count a preserved request ended before its cache was handed out."""
        self.releases[ReleaseCause.CANCELLED.value] += 1

    def release(self, owner: int, cause: ReleaseCause, *, session_exists: bool, by: str | None = None) -> Answer:
        """Whether ``owner``'s session may be ended for ``cause``: only RELEASED allows it. ``by``: the Decode
        node that freed it, for DECODE_FREED."""
        answer = self._judge_release(owner, session_exists)
        if answer.verdict is Verdict.RELEASED:
            cache = self._caches.pop(owner)
            self.releases[cause.value] += 1
            if cause is ReleaseCause.RECLAIMED:
                remember_recent(self._reclaimed, owner, None)
            elif cause is ReleaseCause.DECODE_FREED:
                cache.freed_by = by
                remember_recent(self._migrated, owner, cache)
        else:
            self.frees[answer.counted_as or answer.verdict.value] += 1
        return answer

    def claim(self, owner: int, block_ids: Sequence[int], decode: str | None = None) -> Answer:
        """A Decode node's check, before or while it migrates, that ``owner`` still holds exactly ``block_ids``;
        ``decode``: the claiming node, as its link to this one names it."""
        answer = self._judge_claim(owner, tuple(block_ids), decode)
        self.claims[answer.verdict.value] += 1
        return answer

    def unclaimed(self) -> list[int]:
        """Owners no Decode node has claimed: nothing reads their blocks."""
        return [cache.owner for cache in self._caches.values() if not cache.claimed]

    def expired(self) -> list[int]:
        """Owners nobody claimed or freed within the orphan TTL, and those whose claim's lease ran out."""
        now = self._clock()
        return [cache.owner for cache in self._caches.values() if cache.held_until < now]

    def migration_failed(self, reason: str) -> None:
        self.migration_failures[reason] += 1

    def migration_aborted(self) -> None:
        self.migrations_aborted += 1

    def audit(self) -> dict[str, Any]:
        now = self._clock()
        ages = [now - cache.preserved_at for cache in self._caches.values()]
        return {
            'preserved': len(ages),
            'claimed': sum(cache.claimed for cache in self._caches.values()),
            'preserved_by_age_s': _by_age(ages),
            'oldest_age_s': round(max(ages, default=0.0), 3),
            'orphan_ttl_s': self.orphan_ttl_s,
            'releases': dict(self.releases),
            'frees_not_released': dict(self.frees),
            'claims': dict(self.claims),
            'migration_failures': dict(self.migration_failures),
            'migrations_aborted': self.migrations_aborted,
        }

    def _judge_release(self, owner: int, session_exists: bool) -> Answer:
        if owner in self._caches:
            return Answer(Verdict.RELEASED, f'preserved cache {owner} released')
        if session_exists:
            return Answer(Verdict.REFUSED, f'session {owner} is not a preserved cache (it is still running or '
                                           'never asked to preserve its cache); nothing released',
                          counted_as='not_preserved')
        if owner in self._reclaimed:
            return Answer(Verdict.NOT_FOUND, f'preserved cache {owner} was already reclaimed after the orphan TTL',
                          counted_as='already_reclaimed')
        return Answer(Verdict.NOT_FOUND, f'no preserved cache {owner} on this node', counted_as='unknown')

    def _judge_claim(self, owner: int, block_ids: tuple[int, ...], decode: str | None) -> Answer:
        cache = self._caches.get(owner)
        if cache is not None:
            if cache.block_ids != block_ids:
                # the caller learns that its block ids are wrong, not which are right
                return Answer(Verdict.REFUSED, f'block ids do not match preserved cache {owner}')
            if cache.claimed:
                # exclusive: a cache is migrated once, by one Decode request; a second claim would copy blocks
                # the first migration's free hands back, and re-claiming would hold the cache forever
                return Answer(Verdict.REFUSED, f'preserved cache {owner} is already claimed by a migration')
            cache.claimed = True
            cache.held_until = max(cache.held_until, self._clock() + self.claim_hold_s)
            return Answer(Verdict.CLAIMED, f'preserved cache {owner} confirmed')
        if owner in self._reclaimed:
            return Answer(Verdict.RECLAIMED, f'preserved cache {owner} was reclaimed after the orphan TTL '
                                             f'({self.orphan_ttl_s:g} s); its blocks may hold other data now')
        migrated = self._migrated.get(owner)
        if (migrated is not None and migrated.block_ids == block_ids and not migrated.claimed
                and decode is not None and migrated.freed_by == decode):
            # preserved from its answer until its Decode freed it after the copy: that node's copy read it intact.
            # Once, and only for that node: any other migration of the cache copied blocks freed since.
            migrated.claimed = True
            return Answer(Verdict.CLAIMED, f'preserved cache {owner} was copied and freed by its Decode node')
        return Answer(Verdict.NOT_FOUND, f'no preserved cache {owner} on this node')


def remember_recent(memory: OrderedDict[Any, Any], key: Any, value: Any, limit: int = _REMEMBERED_RELEASES) -> None:
    """Note ``key`` in ``memory``, forgetting the oldest beyond ``limit``."""
    memory[key] = value
    while len(memory) > limit:
        memory.popitem(last=False)


def _by_age(ages: list[float]) -> dict[str, int]:
    labels = [f'<{int(bound)}' for bound in _AGE_BUCKETS_S] + [f'>={int(_AGE_BUCKETS_S[-1])}']
    counts = dict.fromkeys(labels, 0)
    for age in ages:
        index = next((i for i, bound in enumerate(_AGE_BUCKETS_S) if age < bound), len(_AGE_BUCKETS_S))
        counts[labels[index]] += 1
    return counts
