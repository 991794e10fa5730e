"""A node's book of preserved Prefill caches: every free and claim gets a definitive answer, and is counted."""

from __future__ import annotations

from lmdeploy_pdfix.domain.preserved import PreservedBook, ReleaseCause, Verdict

OWNER = (7 << 32) + 3
DECODE = 'http://127.0.0.1:9001'


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def book_with_one_cache(ttl: float = 600.0, claim_hold: float = 750.0) -> tuple[PreservedBook, Clock]:
    clock = Clock()
    book = PreservedBook(orphan_ttl_s=ttl, claim_hold_s=claim_hold, clock=clock)
    book.preserve(OWNER, [4, 5])
    return book, clock


def test_a_preserved_cache_is_released_once_and_then_not_found() -> None:
    book, _ = book_with_one_cache()
    assert book.release(OWNER, ReleaseCause.DECODE_FREED, session_exists=True).verdict is Verdict.RELEASED
    assert book.release(OWNER, ReleaseCause.FREED, session_exists=False).verdict is Verdict.NOT_FOUND
    assert book.audit()['releases'] == {'decode_freed': 1}
    assert book.audit()['frees_not_released'] == {'unknown': 1}


def test_a_session_that_is_not_a_preserved_cache_is_never_released() -> None:
    book, _ = book_with_one_cache()
    answer = book.release(OWNER + 1, ReleaseCause.FREED, session_exists=True)
    assert answer.verdict is Verdict.REFUSED and 'not a preserved cache' in answer.detail


def test_an_unclaimed_cache_is_reclaimed_after_the_orphan_ttl() -> None:
    book, clock = book_with_one_cache(ttl=10.0)
    clock.now += 9
    assert book.expired() == []
    clock.now += 2
    assert book.expired() == [OWNER]


def test_a_claim_holds_the_cache_past_the_orphan_ttl_until_its_lease_ends() -> None:
    book, clock = book_with_one_cache(ttl=10.0, claim_hold=100.0)
    clock.now += 8
    assert book.claim(OWNER, [4, 5]).verdict is Verdict.CLAIMED
    clock.now += 90  # the migration waits in the Decode's queue, far past the orphan TTL
    assert book.expired() == []
    clock.now += 20
    assert book.expired() == [OWNER]  # its Decode never ended it: the lease did


def test_a_reclaimed_owner_is_refused_to_a_late_claim_and_reported_to_a_late_free() -> None:
    book, _ = book_with_one_cache()
    book.release(OWNER, ReleaseCause.RECLAIMED, session_exists=True)
    assert book.claim(OWNER, [4, 5]).verdict is Verdict.RECLAIMED
    answer = book.release(OWNER, ReleaseCause.FREED, session_exists=False)
    assert answer.verdict is Verdict.NOT_FOUND and 'reclaimed' in answer.detail


def test_a_claim_must_name_exactly_the_owners_blocks() -> None:
    book, _ = book_with_one_cache()
    assert book.claim(OWNER, [4]).verdict is Verdict.REFUSED
    assert book.claim(OWNER, [4, 5]).verdict is Verdict.CLAIMED
    assert book.claim(OWNER + 9, [4, 5]).verdict is Verdict.NOT_FOUND


def test_the_audit_buckets_preserved_caches_by_age() -> None:
    book, clock = book_with_one_cache()
    clock.now += 70
    book.preserve(OWNER + 1, [6])
    audit = book.audit()
    assert audit['preserved'] == 2
    assert audit['preserved_by_age_s'] == {'<10': 1, '<60': 0, '<300': 1, '>=300': 0}
    assert audit['oldest_age_s'] == 70.0


def test_a_claim_that_comes_after_its_decode_freed_the_copied_cache_is_confirmed_once() -> None:
    # With a ticket the claim runs alongside the copy; under load it may reach the Prefill after the Decode's free.
    book, _ = book_with_one_cache()
    assert book.release(OWNER, ReleaseCause.DECODE_FREED, session_exists=True, by=DECODE).verdict is Verdict.RELEASED
    assert book.claim(OWNER, [4], DECODE).verdict is Verdict.NOT_FOUND  # not its blocks
    assert book.claim(OWNER, [4, 5], DECODE).verdict is Verdict.CLAIMED
    assert book.claim(OWNER, [4, 5], DECODE).verdict is Verdict.NOT_FOUND  # a second migration is not confirmed


def test_a_late_claim_is_confirmed_only_for_the_decode_node_that_freed_the_cache() -> None:
    # A ticket replayed to another Decode node: that node's copy may have read blocks the first one's free gave back
    book, _ = book_with_one_cache()
    book.release(OWNER, ReleaseCause.DECODE_FREED, session_exists=True, by=DECODE)
    assert book.claim(OWNER, [4, 5], 'http://127.0.0.1:9002').verdict is Verdict.NOT_FOUND
    assert book.claim(OWNER, [4, 5]).verdict is Verdict.NOT_FOUND  # a claimant that does not say who it is
    assert book.claim(OWNER, [4, 5], DECODE).verdict is Verdict.CLAIMED


def test_a_cache_claimed_before_its_decode_freed_it_is_not_confirmed_again() -> None:
    book, _ = book_with_one_cache()
    assert book.claim(OWNER, [4, 5]).verdict is Verdict.CLAIMED
    book.release(OWNER, ReleaseCause.DECODE_FREED, session_exists=True)
    assert book.claim(OWNER, [4, 5]).verdict is Verdict.NOT_FOUND


def test_a_cache_is_claimed_once_and_a_second_claim_neither_confirms_nor_extends_its_hold() -> None:
    book, clock = book_with_one_cache(ttl=10.0, claim_hold=100.0)
    assert book.claim(OWNER, [4, 5], DECODE).verdict is Verdict.CLAIMED
    clock.now += 90.0
    again = book.claim(OWNER, [4, 5], DECODE)
    assert again.verdict is Verdict.REFUSED and 'already claimed' in again.detail
    clock.now += 11.0
    assert book.expired() == [OWNER]  # the first lease alone held it
