"""Run lock operations in a separate Python process against the test databases.

    python -m tests.support.child acquire --store postgres --key K --ttl 30 [--hold 5]
    python -m tests.support.child <command> ...   (prints one JSON line per result)

Children find the test databases through KEEL_TEST_RUN_ID (exported by tests.settings), so
they share the parent's test database names, Redis and SQLite file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def setup_django() -> None:
    """Configure Django like the test run, pointing every database at its test database."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django
    from django.conf import settings

    for config in settings.DATABASES.values():
        test_name = config.get("TEST", {}).get("NAME")  # type: ignore[union-attr]
        if test_name:
            config["NAME"] = test_name
    django.setup()


def emit(**data: object) -> None:
    print(json.dumps(data), flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["acquire", "restore-release", "restore-extend"])
    parser.add_argument("--store", default="default")
    parser.add_argument("--key", default="")
    parser.add_argument("--ttl", type=float, default=30)
    parser.add_argument("--timeout", type=float, default=0)
    parser.add_argument("--retry-delay", type=float, default=0.05)
    parser.add_argument("--hold", type=float, default=0, help="seconds to hold, then release")
    parser.add_argument("--token", default="")
    args = parser.parse_args(argv)
    setup_django()
    from django_keel_lock import lock, restore_lock

    if args.command == "acquire":
        handle = lock(args.key, ttl=args.ttl, store=args.store)
        acquired = handle.acquire(timeout=args.timeout, retry_delay=args.retry_delay)
        emit(
            acquired=acquired,
            fence=handle.fence,
            remaining=handle.remaining_time(),
            token=handle.serialize() if acquired else None,
            wall=time.time(),
            at=time.monotonic(),
        )
        if acquired and args.hold:
            time.sleep(args.hold)
            emit(released=handle.release())
    elif args.command == "restore-release":
        emit(released=restore_lock(args.token).release())
    elif args.command == "restore-extend":
        restored = restore_lock(args.token)
        restored.extend(args.ttl)
        emit(remaining=restored.remaining_time())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
