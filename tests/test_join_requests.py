"""Join requests as tickets (gradsync/elastic/verdicts.py): a round's leader reads the requests made since the
current round formed, and finds the same pending joiners as the full scan over every worker number."""

import random

import torch.distributed as dist

from gradsync.elastic import keys, verdicts


def test_the_requests_since_a_round_are_the_pending_joiners_the_full_scan_finds() -> None:
    store, rng = dist.HashStore(), random.Random(0)
    pending: set[int] = set()
    since = 0  # the requests the current round counted
    for number in range(1, 301):  # a long job: every restart takes a new number
        store.add(keys.SEQUENCE, 1)
        if rng.random() < 0.5:
            verdicts.ask_to_join(store, number)
            pending.add(number)
        if rng.random() < 0.2:  # a round forms: each joiner it saw admitted, or left out and asking again
            counted = int(store.add(keys.JOIN_REQUESTS, 0))
            seen = verdicts.joiners_pending(store, since)
            assert seen == verdicts.every_joiner_pending(store) == sorted(pending)
            for joiner in seen:
                if rng.random() < 0.7:
                    store.set(keys.joined(joiner), "1")
                    pending.discard(joiner)
                else:  # expired, then asks again with a new ticket
                    store.set(keys.joined(joiner), "expired: it had not registered")
                    store.delete_key(keys.joined(joiner))
                    verdicts.ask_to_join(store, joiner)
            since = counted
    assert verdicts.joiners_pending(store, since) == verdicts.every_joiner_pending(store) == sorted(pending)


def test_a_member_left_out_asks_again_under_its_old_number() -> None:
    store = dist.HashStore()
    for number in (1, 2, 3):
        store.add(keys.SEQUENCE, 1)
        store.set(keys.joined(number), "1")  # round 1's members
    store.delete_key(keys.joined(2))  # worker 2 was cut off, and asks to join again
    verdicts.ask_to_join(store, 2)
    assert verdicts.joiners_pending(store, since=0) == [2] == verdicts.every_joiner_pending(store)


def test_a_ticket_taken_but_not_yet_written_falls_back_to_the_full_scan() -> None:
    store = dist.HashStore()
    store.add(keys.SEQUENCE, 2)
    store.set(keys.joiner(2), "1")
    store.add(keys.JOIN_REQUESTS, 1)  # worker 2 counted its request; its ticket is not written yet
    assert verdicts.joiners_pending(store, since=0) == [2]
