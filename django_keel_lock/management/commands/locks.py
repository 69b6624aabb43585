"""`manage.py locks`: list, show, force-release and prune the locks of a store; run a command
under a lock, or on one node only.

    manage.py locks list [--store ALIAS] [--prefix P] [--json]
    manage.py locks show KEY [--store ALIAS] [--json] [--show-owner]
    manage.py locks release KEY [--store ALIAS] [--fence N] [--yes]
    manage.py locks prune [--store ALIAS]
    manage.py locks run KEY [--ttl T] [--wait T] [--grace T] [--store A] [--skip-ok] -- COMMAND...
    manage.py locks lead NAME [--ttl T] [--grace T] [--store A] -- COMMAND...
    manage.py locks results [--store ALIAS] [--prefix P] [--json] [--prune]
    manage.py locks forget KEY [--store ALIAS]

`run` and `lead` live in `..running` (their exit statuses are described there); `results` and
`forget` (idempotent results) in `..results`.

Exit codes: 0 done; 1 the key is not held (show, release) or the release was declined at the
prompt; 2 usage errors (bad arguments, a key the store cannot hold) and an unknown or
misconfigured store alias; 3 the store could not be reached (the state of the locks is unknown).

`list` streams: rows are printed as the store yields them (page by page for the database store),
the column widths set by the first rows (WIDTH_SAMPLE), so the table never needs every row in
memory; nothing is cut. A key held by a semaphore or shared lock has a row per holder (each
permit), with its MODE. Keys held together (a multi-key lock: one owner on several keys) are
one holder: `list` names each such holder's keys after the table (and counts it once), `show`
names the keys held with the one shown, and `release` frees every key of its holder (releasing
one of them loses the holder its lock anyway). Django's common options (--settings,
--traceback, -v, ...) are taken after the action too.

Owner tokens are never printed unless `show --show-owner` asks: the token is what a store checks
before it releases or extends a lock for its holder, so it stays out of terminals, logs and
pasted output by default. Keys and holders are printed with control characters escaped
(`\x1b`): a row written by another client of the store cannot drive the operator's terminal.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Iterator
from datetime import UTC
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from ...conf import conf
from ...core import force_release
from ...exceptions import LockStoreUnavailable
from ...options import printable, validate_key
from ...registry import get_lock_store
from ...stores.base import LockInfo, LockStore
from ...together import OwnerDigests, held_together, held_with, keys_with, release_others
from .. import results, running

EXIT_NOT_HELD = 1
EXIT_CONFIG = 2
EXIT_UNAVAILABLE = 3

#: Rows read before the table's column widths are set from them (a page of a store is held
#: in memory anyway); a wider value after them widens its column from there on. Nothing is
#: ever cut: a Celery task id in a holder is 36 characters, a Redis fence 16 digits.
WIDTH_SAMPLE = 500
HEADER = ("FENCE", "MODE", "EXPIRES IN", "ACQUIRED (UTC)", "HOLDER", "KEY")
#: Which columns are right-aligned (numbers); KEY comes last and is not padded.
RIGHT = (True, False, True, False, False)
#: Django's options that every command takes, taken after the action too (`locks list
#: --settings X`). SUPPRESS: an option not given after the action keeps the value given
#: before it, if any.
COMMON_OPTIONS: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("-v", "--verbosity"), {"type": int, "choices": [0, 1, 2, 3]}),
    (("--settings",), {}),
    (("--pythonpath",), {}),
    (("--traceback",), {"action": "store_true"}),
    (("--no-color",), {"action": "store_true"}),
    (("--force-color",), {"action": "store_true"}),
]


def format_acquired(info: LockInfo) -> str:
    if info.acquired_at is None:
        return "-"
    return info.acquired_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:23]


def format_expires(seconds: float) -> str:
    return f"{seconds:.1f}s"


def info_dict(
    info: LockInfo, *, owner: bool = False, together: tuple[str, ...] = ()
) -> dict[str, Any]:
    data: dict[str, Any] = {
        "key": info.key,
        "mode": info.mode,
        "holder": info.holder,
        "fence": info.fence,
        "acquired_at": None if info.acquired_at is None else info.acquired_at.isoformat(),
        "expires_in": round(info.expires_in, 3),
    }
    if owner:
        data["owner"] = info.owner
    if together:
        data["with"] = list(together)
    return data


def row_cells(info: LockInfo) -> tuple[str, ...]:
    """A holder's row of the table, as printed (control characters escaped)."""
    return (
        str(info.fence),
        info.mode,
        format_expires(info.expires_in),
        format_acquired(info),
        printable(info.holder),
        printable(info.key),
    )


class Table:
    """Lines of aligned columns, as wide as the widest value seen so far in each."""

    def __init__(self, rows: list[tuple[str, ...]]) -> None:
        self.widths = [max(len(row[column]) for row in [HEADER, *rows]) for column in range(5)]

    def line(self, cells: tuple[str, ...]) -> str:
        parts = []
        for column, right in enumerate(RIGHT):
            cell = cells[column]
            width = self.widths[column] = max(self.widths[column], len(cell))
            parts.append(cell.rjust(width) if right else cell.ljust(width))
        return "  ".join([*parts, cells[-1]])


def list_lines(store: LockStore, prefix: str = "", as_json: bool = False) -> Iterator[str]:
    """The lines `locks list` prints, produced a store row at a time (after the first
    WIDTH_SAMPLE, which set the column widths).

    The first row is read before anything is produced: a store that cannot be reached fails
    the command with nothing printed, not under a table header that looks like an empty table.
    """
    digests = OwnerDigests()
    rows = iter(digests.seen(store.iter_locks(prefix)))
    first = next(rows, None)
    count = 0
    if as_json:
        for info in rows if first is None else itertools.chain([first], rows):
            count += 1
            yield json.dumps(info_dict(info), ensure_ascii=False)
        return
    sample = [] if first is None else [first, *itertools.islice(rows, WIDTH_SAMPLE - 1)]
    cells = [row_cells(info) for info in sample]
    table = Table(cells)
    yield table.line(HEADER)
    for row in itertools.chain(cells, (row_cells(info) for info in rows)):
        count += 1
        yield table.line(row)
    groups = held_together(store, digests, prefix)
    for group in groups:
        keys = " + ".join(printable(info.key) for info in group)
        yield f"Held together by {printable(group[0].holder)}: {keys}"
    count -= sum(len(group) - 1 for group in groups)
    what = f" with prefix {prefix!r}" if prefix else ""
    several = f" ({len(groups)} of them hold{'s' if len(groups) == 1 else ''} several keys)"
    yield (
        f"{count} holder{'' if count == 1 else 's'} in store {store.alias!r}{what}"
        f"{several if groups else ''}."
    )


def checked_prefix(prefix: str) -> str:
    """`prefix` if a key can start with it, else a usage error naming --prefix: no key holds a
    control character (a NUL, which PostgreSQL refuses), nor what is not UTF-8 (bytes from the
    shell that are not, which Python keeps as surrogates)."""
    try:
        validate_key(prefix or "-")
    except ValueError as exc:
        raise CommandError(
            f"bad --prefix {prefix!r}: no lock key starts with it ({exc})", returncode=EXIT_CONFIG
        ) from exc
    return prefix


class Command(BaseCommand):
    help = (
        "List, show, force-release and prune the locks of a django-keel-lock store; run a "
        "command under a lock (run) or on one node only (lead)."
    )
    # A mistake in one alias must not turn every command into exit 1 ("not held"); the alias
    # used is checked when it is built (bad config: exit 2).
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

        def add(name: str, help: str) -> Any:
            sub = actions.add_parser(name, help=help, description=help)
            for flags, kwargs in COMMON_OPTIONS:
                sub.add_argument(
                    *flags, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs
                )
            sub.add_argument(
                "--store", default="default", metavar="ALIAS", help="store alias (default: default)"
            )
            return sub

        listing = add(
            "list", "List every holder of a lock: key, mode, holder, fence, acquired, expires in."
        )
        listing.add_argument("--prefix", default="", help="only keys starting with this")
        listing.add_argument("--json", action="store_true", help="one JSON object per line")
        show = add("show", "Show one lock in detail: each holder of it.")
        show.add_argument("key")
        show.add_argument("--json", action="store_true", help="print a JSON object")
        show.add_argument(
            "--show-owner",
            action="store_true",
            help="also print the owner token (hidden by default: release and extend check it)",
        )
        release = add("release", "Force-release a lock (each holder of it), whoever holds it.")
        release.add_argument("key")
        release.add_argument(
            "--fence", type=int, metavar="N", help="only the holder with this fence (one permit)"
        )
        release.add_argument("--yes", action="store_true", help="do not ask for confirmation")
        add("prune", "Delete expired locks the store keeps (Redis deletes its own); say how many.")
        running.add_arguments(add)
        results.add_arguments(add)

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        running.check_command_split(parser)
        return parser

    def handle(self, *args: Any, **options: Any) -> None:
        alias: str = options["store"]
        store = self.get_store(alias)
        try:
            status = getattr(self, f"do_{options['action']}")(store, options)
        except ImproperlyConfigured as exc:  # found only when the store is first used
            raise CommandError(str(exc), returncode=EXIT_CONFIG) from exc
        except LockStoreUnavailable as exc:
            raise CommandError(
                f"store {alias!r} is unavailable, nothing was done: {exc}",
                returncode=EXIT_UNAVAILABLE,
            ) from exc
        if status:  # run, lead: the command's exit status
            raise SystemExit(status)

    def get_store(self, alias: str) -> LockStore:
        try:
            stores = conf.STORES
            if alias not in stores:
                known = ", ".join(sorted(stores)) or "none"
                raise CommandError(
                    f"unknown store alias {alias!r} (KEEL_LOCK_STORES has: {known})",
                    returncode=EXIT_CONFIG,
                )
            return get_lock_store(alias)
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc), returncode=EXIT_CONFIG) from exc

    # -- actions --------------------------------------------------------------------------
    def do_list(self, store: LockStore, options: dict[str, Any]) -> None:
        prefix = checked_prefix(options["prefix"])
        try:
            for line in list_lines(store, prefix, options["json"]):
                self.stdout.write(line)
        except ValueError as exc:  # a value the store refuses (`_refused`: it names no key)
            raise CommandError(
                f"bad --prefix {prefix!r}: store {store.alias!r} cannot take it ({exc})",
                returncode=EXIT_CONFIG,
            ) from exc

    def do_show(self, store: LockStore, options: dict[str, Any]) -> None:
        holders = self.read(store, self.checked_key(store, options["key"]))
        together = held_with(store, [info.owner for info in holders])
        show_owner: bool = options["show_owner"]
        if options["json"]:
            # The first holder (soonest expiry) at the top, as for a lock; all of them below.
            data = {
                "store": store.alias,
                **info_dict(holders[0], owner=show_owner, together=keys_with(holders[0], together)),
                "holders": [
                    info_dict(info, owner=show_owner, together=keys_with(info, together))
                    for info in holders
                ],
            }
            self.stdout.write(json.dumps(data))
            return
        for number, info in enumerate(holders):
            if number:
                self.stdout.write("")
            others = keys_with(info, together)
            rows = [
                ("key", info.key),
                ("store", store.alias),
                ("mode", info.mode),
                ("holder", info.holder),
                ("fence", str(info.fence)),
                *([("owner", info.owner)] if show_owner else []),
                ("acquired", f"{format_acquired(info)} UTC"),
                ("expires in", format_expires(info.expires_in)),
                *([("with", " + ".join(others))] if others else []),
            ]
            for label, value in rows:
                self.stdout.write(f"{label + ':':<12}{printable(value)}")

    def do_release(self, store: LockStore, options: dict[str, Any]) -> None:
        """Free the holders read now (the one with --fence), each by its fence: a holder that
        came after they were read (while the person was asked) is left alone. A holder of
        several keys (a multi-key lock) loses them all: each of its keys is freed too."""
        key = self.checked_key(store, options["key"])
        fence: int | None = options.get("fence")
        holders = [info for info in self.read(store, key) if fence in (None, info.fence)]
        if not holders:
            raise CommandError(
                f"lock {key!r} has no holder with fence {fence} in store {store.alias!r}",
                returncode=EXIT_NOT_HELD,
            )
        together = held_with(store, [info.owner for info in holders])
        if not options["yes"]:
            self.confirm_release(store, key, holders, together)
        freed = [
            info
            for info in holders
            if force_release(key, store=store.alias, fence=info.fence) is not None
        ]
        if not freed:
            fences = ", ".join(str(info.fence) for info in holders)
            raise CommandError(
                f"Not released: {key!r} was released or taken again (no longer fence "
                f"{fences}) meanwhile; run the command again.",
                returncode=EXIT_NOT_HELD,
            )
        for info in freed:
            self.stdout.write(
                f"Released {key!r} in store {store.alias!r} (was held by "
                f"{printable(info.holder)}, {info.mode}, fence {info.fence})."
            )
            for other in release_others(store.alias, info, together):
                self.stdout.write(
                    f"Released {other.key!r} in store {store.alias!r} (held together "
                    f"with {key!r}, fence {other.fence})."
                )

    @staticmethod
    def confirm_release(
        store: LockStore, key: str, holders: list[LockInfo], together: dict[str, list[LockInfo]]
    ) -> None:
        """Ask before releasing; anything but yes: exit 1, nothing released."""
        held_by = "; ".join(
            f"{printable(info.holder)} ({info.mode}, fence {info.fence}, expires in "
            f"{format_expires(info.expires_in)}"
            + (
                f", with {' + '.join(printable(k) for k in others)}: released too"
                if (others := keys_with(info, together))
                else ""
            )
            + ")"
            for info in holders
        )
        question = (
            f"Force-release {key!r} in store {store.alias!r}, held by {held_by}? "
            f"{'Its holder' if len(holders) == 1 else 'Each holder'} will keep running "
            "without the lock. [y/N] "
        )
        try:
            answer = input(question)
        except EOFError:
            answer = ""
        if answer.strip().lower() not in {"y", "yes"}:
            raise CommandError(
                "Not released (answer 'y' to release; --yes skips the question).",
                returncode=EXIT_NOT_HELD,
            )

    def do_prune(self, store: LockStore, options: dict[str, Any]) -> None:
        if store.expires_by_itself:
            # Not "Pruned 0": that reads as "nothing had expired yet", or as a prune that failed.
            self.stdout.write(
                f"Store {store.alias!r} ({type(store).__name__}) deletes expired locks by "
                "itself: nothing to prune."
            )
            return
        count = store.prune()
        self.stdout.write(
            f"Pruned {count} expired lock{'' if count == 1 else 's'} from store {store.alias!r}."
        )

    def do_run(self, store: LockStore, options: dict[str, Any]) -> int:
        return running.do_run(store, self.checked_key(store, options["key"]), options)

    def do_lead(self, store: LockStore, options: dict[str, Any]) -> int:
        return running.do_lead(store, options["name"], options)

    def do_results(self, store: LockStore, options: dict[str, Any]) -> int:
        return results.do_results(store, options, self.stdout.write)

    def do_forget(self, store: LockStore, options: dict[str, Any]) -> int:
        return results.do_forget(store, options, self.stdout.write)

    # -- helpers --------------------------------------------------------------------------
    @staticmethod
    def checked_key(store: LockStore, key: str) -> str:
        try:
            return validate_key(key, store)
        except (TypeError, ValueError) as exc:
            raise CommandError(f"bad key: {exc}", returncode=EXIT_CONFIG) from exc

    def read(self, store: LockStore, key: str) -> list[LockInfo]:
        """The key's holders, soonest expiry first; not held: exit 1."""
        holders = store.holders(key)
        if not holders:
            raise self.not_held(store, key)
        return holders

    @staticmethod
    def not_held(store: LockStore, key: str) -> CommandError:
        return CommandError(
            f"lock {key!r} is not held in store {store.alias!r}", returncode=EXIT_NOT_HELD
        )
