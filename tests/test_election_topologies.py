"""Leader election on a real Redis Cluster and behind a real Sentinel (both started here): a
resign is taken over at once (the release's wake-up), terms increase, observers see it."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from django_keel_lock import election
from django_keel_lock.stores import RedisLockStore

from .conftest import needs, serving
from .support.redis_servers import REDIS_SERVER, redis_cluster, redis_sentinel, via_sentinel

pytestmark = needs(os.path.exists(REDIS_SERVER), "the redis-server binary")


@pytest.fixture(params=["cluster", "sentinel"])
def topology_alias(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "cluster":
        with redis_cluster(3) as nodes:
            store = RedisLockStore(
                f"cluster-{uuid.uuid4().hex[:8]}", {"URL": nodes[0].url, "CLUSTER": True}
            )
            with serving(store) as alias:
                yield alias
    else:
        # A service name of its own: django-redis keeps a sentinel pool per LOCATION for the
        # process, and test_redis_topologies' "keelmaster" would reach this sentinel once gone.
        service = "keelelection"
        with (
            redis_sentinel(service) as setup,
            via_sentinel(setup.sentinel.port, service) as alias,
        ):
            yield alias


def test_a_resign_is_taken_over_at_once_and_terms_increase(topology_alias: str, key: str) -> None:
    first = election(key, ttl=10, store=topology_alias, holder="first:1")
    second = election(key, ttl=10, store=topology_alias, holder="second:2")
    term = first.campaign(timeout=2)
    taken: list[tuple[int, float]] = []
    waiting = threading.Thread(
        target=lambda: taken.append((second.campaign(timeout=20), time.monotonic()))
    )
    waiting.start()
    time.sleep(0.5)  # in the line
    leader = second.current()
    assert leader is not None and (leader.holder, leader.term) == ("first:1", term)
    resigned = time.monotonic()
    assert first.resign()
    waiting.join(20)
    ((new_term, at),) = taken
    assert new_term > term
    assert at - resigned < 1.0  # woken by the release, long before the 10 s ttl
    assert second.resign()
    assert first.current() is None
