"""The store contract (tests/test_contract.py), unchanged, on PostgreSQL behind a real PgBouncer
in transaction mode and behind Django's own connection pool (tests/support/poolers.py)."""

from __future__ import annotations

import pytest

from tests.support.poolers import POOLED_STORES, pooled
from tests.test_contract import *  # noqa: F403 (the contract's tests, collected here again)

__all__ = ["pooled"]


@pytest.fixture(params=POOLED_STORES)
def store_alias(request: pytest.FixtureRequest, pooled: object) -> str:
    """The contract's stores here: the pooled ones."""
    return str(request.param)
