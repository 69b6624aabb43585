"""`manage.py locks results` and `locks forget`: the kept answers of idempotent requests.

    manage.py locks results [--store A] [--prefix P] [--json] [--prune]
    manage.py locks forget KEY [--store A]

`results` lists each live result: its key ("idempotent:<scope>:<key>", "once:<key>"),
status (the response's; "-" for a function's result), age and size in bytes; `--prune`
deletes the expired ones first (the database stores delete them as they write, too).
`forget` deletes one, so the next request with that key runs its view again; exit 1 when
there was none.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

from django.core.management.base import CommandError

from ..idempotency.storage import result_store_for
from ..options import printable
from ..stores.base import LockStore
from ..stores.results import StoredResult

EXIT_NONE = 1
HEADERS = ("KEY", "STATUS", "AGE", "SIZE")


def add_arguments(add: Any) -> None:
    """The `results` and `forget` subcommands, on the `locks` command's `add(name, help)`."""
    listing = add(
        "results", "List the kept answers of idempotent requests: key, status, age, size."
    )
    listing.add_argument("--prefix", default="", help="only keys starting with this")
    listing.add_argument("--json", action="store_true", help="one JSON object per line")
    listing.add_argument("--prune", action="store_true", help="delete expired results first")
    forget = add("forget", "Forget one kept answer: the next request with its key runs again.")
    forget.add_argument("key")


def do_results(store: LockStore, options: dict[str, Any], write: Callable[[str], None]) -> int:
    results = result_store_for(store.alias)
    if options.get("prune"):
        write(f"pruned {results.prune()} expired result(s)")
    now = datetime.now(UTC)
    rows = (_row(result, now) for result in results.iter_results(options.get("prefix", "")))
    for line in _json_lines(rows) if options.get("json") else _table(rows):
        write(line)
    return 0


def do_forget(store: LockStore, options: dict[str, Any], write: Callable[[str], None]) -> int:
    key: str = options["key"]
    if not result_store_for(store.alias).forget(key):
        raise CommandError(
            f"no result is kept under {printable(key)!r} in store {store.alias!r}",
            returncode=EXIT_NONE,
        )
    write(f"forgot the result of {printable(key)!r}")
    return 0


def _row(result: StoredResult, now: datetime) -> dict[str, Any]:
    age = None if result.created_at is None else (now - result.created_at).total_seconds()
    return {
        "key": result.key,
        "status": result.status or None,
        "age": None if age is None else round(max(age, 0.0), 3),
        "size": result.size,
        "fence": result.fence,
    }


def _json_lines(rows: Iterator[dict[str, Any]]) -> Iterator[str]:
    return (json.dumps(row) for row in rows)


def _table(rows: Iterator[dict[str, Any]]) -> Iterator[str]:
    cells = [
        (
            printable(row["key"]),
            "-" if row["status"] is None else str(row["status"]),
            "?" if row["age"] is None else f"{row['age']:.0f}s",
            str(row["size"]),
        )
        for row in rows
    ]
    if not cells:
        yield "no results kept"
        return
    widths = [max(len(row[i]) for row in [HEADERS, *cells]) for i in range(len(HEADERS))]
    for row in [HEADERS, *cells]:
        yield "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
