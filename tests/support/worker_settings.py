"""Settings for processes the tests start (Celery workers): the test settings, pointed at the
test databases pytest-django created for the same KEEL_TEST_RUN_ID."""

from __future__ import annotations

from tests.settings import *  # noqa: F403
from tests.settings import DATABASES

for _config in DATABASES.values():
    _test = _config.get("TEST")
    if isinstance(_test, dict) and _test.get("NAME"):
        _config["NAME"] = _test["NAME"]
