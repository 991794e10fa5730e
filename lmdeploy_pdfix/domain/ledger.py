"""The proxy's books of retained Prefill caches: one record per owner, from the Prefill answer until release.

Every exit of a DistServe request closes its record with a cause, so the books always say what is still
held, where and for how long. No patching here: the proxy patch drives it. (LMDeploy's own shelf is not
mirrored: nothing reads it once the proxy relays by owner, and dropping a link no longer frees from it.)
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


class RecordState(str, enum.Enum):
    PREFILLED = 'prefilled'  # the Prefill node holds the cache; no Decode has it yet
    MIGRATING = 'migrating'  # a Decode node was asked to take it over
    RELEASE_FAILED = 'release_failed'  # a compensating free did not get through; gc retries it


class ReleaseCause(str, enum.Enum):
    MIGRATED = 'migrated'  # the Decode node copied it and freed the Prefill session itself
    COMPENSATED = 'compensated'  # the proxy freed it after a failure
    GC = 'gc'  # released by /distserve/gc


@dataclass
class OwnerRecord:
    owner: int
    p_url: str
    d_url: str
    state: RecordState = RecordState.PREFILLED
    opened_at: float = field(default_factory=time.monotonic)

    @property
    def key(self) -> tuple[str, int]:
        return (self.p_url, self.owner)

    def age(self, now: float) -> float:
        return now - self.opened_at


class DuplicateOwnerError(ValueError):
    """A Prefill node named an owner that is still open: two requests would share one cache."""


class OwnerLedger:

    def __init__(self) -> None:
        self._open: dict[tuple[str, int], OwnerRecord] = {}
        self._held: Counter[str] = Counter()  # open records by Prefill node
        self.releases: Counter[str] = Counter()
        self.rejections: Counter[str] = Counter()
        self.release_failures: Counter[str] = Counter()

    def open(self, owner: int, p_url: str, d_url: str) -> OwnerRecord:
        record = OwnerRecord(owner=owner, p_url=p_url, d_url=d_url)
        if record.key in self._open:
            raise DuplicateOwnerError(f'Prefill node {p_url} named owner {owner}, which is still open')
        self._open[record.key] = record
        self._held[p_url] += 1
        return record

    def close(self, record: OwnerRecord, cause: ReleaseCause) -> bool:
        """Close ``record``; False if it was already closed (every exit may call this, only one counts)."""
        if self._open.get(record.key) is not record:
            return False
        del self._open[record.key]
        self._held[record.p_url] -= 1
        if not self._held[record.p_url]:
            del self._held[record.p_url]
        self.releases[cause.value] += 1
        return True

    def held(self, p_url: str) -> int:
        """How many caches the Prefill node at ``p_url`` keeps for this proxy's open records."""
        return self._held[p_url]

    def release_failed(self, record: OwnerRecord, cause: ReleaseCause) -> None:
        """A free for ``cause`` did not get through: the record stays open for gc to retry."""
        record.state = RecordState.RELEASE_FAILED
        self.release_failures[cause.value] += 1

    def reject(self, reason: str) -> None:
        """Count a Prefill answer whose owner could not be used."""
        self.rejections[reason] += 1

    def records(self) -> list[OwnerRecord]:
        return list(self._open.values())

    def collectable(self, *, older_than_s: float, live_urls: set[str], now: float) -> list[OwnerRecord]:
        """Records gc may release: whose release failed before, and stale ones or those of a gone node that no
        Decode has been asked to take. A migrating record is its relay's to close: its Decode may have claimed
        the cache and still wait to copy it (a free now would let it copy reused blocks); the Prefill's claim
        lease is the backstop should the relay never close it."""
        return [record for record in self._open.values()
                if record.state is RecordState.RELEASE_FAILED
                or (record.state is RecordState.PREFILLED
                    and (record.age(now) > older_than_s or not {record.p_url, record.d_url} <= live_urls))]

    def audit(self, now: float) -> dict[str, Any]:
        records = self._open.values()
        return {
            'open': len(records),
            'open_by_state': dict(Counter(record.state.value for record in records)),
            'open_by_prefill': dict(self._held),
            'oldest_age_s': round(max((record.age(now) for record in records), default=0.0), 3),
            'releases': dict(self.releases),
            'owner_rejections': dict(self.rejections),
            'release_failures': dict(self.release_failures),
        }
