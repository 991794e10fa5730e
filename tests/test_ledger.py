"""The proxy's books of retained Prefill caches."""

from __future__ import annotations

import pytest

from lmdeploy_pdfix.domain.ledger import DuplicateOwnerError, OwnerLedger, RecordState, ReleaseCause


def test_each_retained_cache_is_open_exactly_from_open_to_its_first_close() -> None:
    ledger = OwnerLedger()
    record = ledger.open(5, 'p', 'd')
    assert ledger.audit(record.opened_at)['open'] == 1
    assert ledger.close(record, ReleaseCause.MIGRATED)
    assert not ledger.close(record, ReleaseCause.COMPENSATED)  # a second exit changes nothing
    assert ledger.audit(record.opened_at)['open'] == 0 and ledger.releases == {'migrated': 1}


def test_an_owner_still_open_on_the_same_prefill_cannot_be_opened_twice() -> None:
    ledger = OwnerLedger()
    ledger.open(5, 'p1', 'd')
    ledger.open(5, 'p2', 'd')  # the same number on another Prefill node is another cache
    with pytest.raises(DuplicateOwnerError):
        ledger.open(5, 'p1', 'd')


def test_gc_collects_stale_orphaned_and_failed_records_only() -> None:
    ledger = OwnerLedger()
    fresh = ledger.open(1, 'p', 'd')
    stale = ledger.open(2, 'p', 'd')
    orphan = ledger.open(3, 'p', 'gone')
    failed = ledger.open(4, 'p', 'd')
    failed.state = RecordState.RELEASE_FAILED
    now = fresh.opened_at + 10
    stale.opened_at -= 1000
    collectable = ledger.collectable(older_than_s=600, live_urls={'p', 'd'}, now=now)
    assert {record.owner for record in collectable} == {stale.owner, orphan.owner, failed.owner}


def test_gc_leaves_a_migrating_record_to_its_relay_however_old() -> None:
    # its Decode may hold a claim and still wait to copy: freeing now would let it copy reused blocks
    ledger = OwnerLedger()
    queued = ledger.open(1, 'p', 'd')
    queued.state = RecordState.MIGRATING
    queued.opened_at -= 1000
    assert ledger.collectable(older_than_s=600, live_urls={'p'}, now=queued.opened_at + 1000) == []


def test_audit_reports_books_by_state_age_cause_and_rejection() -> None:
    ledger = OwnerLedger()
    record = ledger.open(1, 'p', 'd')
    record.state = RecordState.MIGRATING
    ledger.close(ledger.open(2, 'p', 'd'), ReleaseCause.COMPENSATED)
    ledger.release_failed(ledger.open(3, 'q', 'd'), ReleaseCause.GC)
    ledger.reject('PrefillAnswerError')
    audit = ledger.audit(now=record.opened_at + 2.5)
    assert audit == {'open': 2, 'open_by_state': {'migrating': 1, 'release_failed': 1},
                     'open_by_prefill': {'p': 1, 'q': 1}, 'oldest_age_s': 2.5,
                     'releases': {'compensated': 1}, 'owner_rejections': {'PrefillAnswerError': 1},
                     'release_failures': {'gc': 1}}
