"""Admin for locks: the database store's table, read-only, and the held locks of every store.

Two rules shape this module:
- Remaining time and held/expired come from the store's clock, never the app server's: the
  changelist asks the database (`RemainingSeconds`), the all-stores page reads
  `LockInfo.expires_in`.
- Owner tokens never leave this module: whoever knows one can release or extend that lock.

Force release goes through `core.force_release` (store call, signal, WARNING); the admin adds the
permission check, a confirmation step and a `LogEntry`.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlencode

import django
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.admin.utils import unquote
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import PermissionDenied
from django.db import NotSupportedError, connections, models
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models.constants import LOOKUP_SEP
from django.db.models.sql.compiler import SQLCompiler
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.http import url_has_allowed_host_and_scheme

from .conf import conf
from .core import force_release
from .models import IdempotentResult, Lock, StoreLock
from .registry import get_lock_store
from .stores.base import PERMIT_OWNERS, LockInfo, LockStore
from .stores.database.dialects import DIALECTS
from .stores.database.results import store_now
from .together import held_with, keys_with, release_others

logger = logging.getLogger("django_keel_lock")

#: Rows of one store the all-stores page renders at once (the rest: "next" link or a prefix).
STORE_PAGE_SIZE = 100

#: The owner column of a released row (the database store's RELEASED): a release empties it,
#: an expiry leaves the last holder's token, so the row tells the two apart.
RELEASED_OWNER = ""


@functools.cache
def breadcrumbs_as_list() -> bool:
    """Does the running Django's admin mark breadcrumbs up as `<ol class="breadcrumbs">` with
    an `<li>` each (6.1, whose stylesheet styles only that) rather than `<div
    class="breadcrumbs">` (5.2, whose stylesheet styles only that)? Read from Django's own base
    template, so the lock admin's pages look like the rest of whichever Django runs."""
    base = Path(admin.__file__).parent / "templates" / "admin" / "base.html"
    try:
        return '<ol class="breadcrumbs">' in base.read_text(encoding="utf-8")
    except OSError:  # a packaging that leaves templates out: go by the version that changed
        return django.VERSION >= (6, 1)


def format_acquired(value: datetime | None) -> str:
    """ "2026-12-04 21:51:07" in the current time zone, as a `<time>` that wraps between the
    date and the time only (pages style `.keel-nowrap`): short enough to fit a narrow column."""
    if value is None:
        return "—"
    shown = timezone.localtime(value) if timezone.is_aware(value) else value
    return format_html(
        '<time datetime="{}"><span class="keel-nowrap">{}</span> '
        '<span class="keel-nowrap">{}</span></time>',
        value.isoformat(),
        shown.strftime("%Y-%m-%d"),
        shown.strftime("%H:%M:%S"),
    )


class RemainingSeconds(models.Func):
    """Seconds until a lock row expires, by the database's own clock (<= 0 once expired).

    The dialect's own clock expression, as the database store uses for `expires_in`, so the
    changelist and the store never disagree about whether a lock is held.
    """

    arity = 1
    output_field = models.FloatField()

    def as_sql(
        self,
        compiler: SQLCompiler,
        connection: BaseDatabaseWrapper,
        function: str | None = None,
        template: str | None = None,
        arg_joiner: str | None = None,
        **extra: Any,
    ) -> Any:
        dialect = DIALECTS.get(connection.vendor)
        if dialect is None:
            raise NotSupportedError(
                f"the lock admin reads the clock of PostgreSQL, MariaDB and SQLite only, "
                f"not {connection.vendor!r}"
            )
        template = f"({dialect().remaining('%(expressions)s')})"
        return super().as_sql(compiler, connection, function, template, arg_joiner, **extra)


def format_remaining(seconds: float) -> str:
    """ "4m 05s" for people: whole seconds rounded up, tenths below ten seconds."""
    if seconds <= 0:
        return "expired"
    if seconds < 10:
        return f"{math.ceil(seconds * 10) / 10:.1f}s"
    hours, rest = divmod(math.ceil(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m {secs:02d}s"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"


def database_stores() -> dict[str, str]:
    """The database of each configured alias whose store's locks are rows of a lock table
    (`LockStore.table_database`), in settings order (an alias that cannot be built is left
    out: it must not hide the others)."""
    found: dict[str, str] = {}
    for alias in conf.STORES:
        try:
            database = get_lock_store(alias).table_database
        except Exception:
            continue
        if database is not None:
            found[alias] = database
    return found


def database_store_alias(database: str) -> str | None:
    """The first configured alias whose store is the database store on `database`."""
    return next((alias for alias, db in database_stores().items() if db == database), None)


@dataclass(frozen=True)
class LockRow:
    """What the admin shows of one holder of a lock (a permit, for semaphores and shared
    locks): everything but the owner token."""

    key: str
    holder: str
    fence: int
    acquired_at: datetime | None
    expires_in: float
    remaining: str
    release_url: str | None = None
    mode: str = "exclusive"
    #: The other keys its holder holds with it (a multi-key lock): one holder, several keys.
    together: tuple[str, ...] = ()

    @property
    def acquired(self) -> str:
        return format_acquired(self.acquired_at)

    @classmethod
    def from_info(
        cls, info: LockInfo, release_url: str | None = None, together: tuple[str, ...] = ()
    ) -> LockRow:
        return cls(
            key=info.key,
            holder=info.holder,
            fence=info.fence,
            acquired_at=info.acquired_at,
            expires_in=info.expires_in,
            remaining=format_remaining(info.expires_in),
            release_url=release_url,
            mode=info.mode,
            together=together,
        )


@dataclass
class StoreSection:
    """One store on the all-stores page: its held locks (a page of them) or its error."""

    alias: str
    backend: str
    rows: list[LockRow]
    start: int = 0
    error: str | None = None
    note: str | None = None
    next_url: str | None = None
    previous_url: str | None = None
    all_url: str | None = None


class StateFilter(admin.SimpleListFilter):
    """Held (the default: a table keeps every key ever locked until its clean-up), released,
    expired or all, judged by the database's clock like the store judges it."""

    title = "state"
    parameter_name = "state"
    default = "held"

    def lookups(self, request: HttpRequest, model_admin: Any) -> Sequence[tuple[str, str]]:
        return (("held", "held"), ("released", "released"), ("expired", "expired"), ("all", "all"))

    def value(self) -> str:
        return super().value() or self.default

    def choices(self, changelist: Any) -> Iterator[Any]:
        # Django's own first choice, "All", drops the parameter, which here means "held": the
        # lookups carry their own "all".
        choices = super().choices(changelist)
        next(choices, None)
        yield from choices

    def queryset(self, request: HttpRequest, queryset: models.QuerySet[Any]) -> Any:
        value = self.value()
        if value == "held":
            return queryset.filter(remaining__gt=0)
        if value == "released":
            return queryset.filter(remaining__lte=0, owner=RELEASED_OWNER)
        if value == "expired":
            return queryset.filter(remaining__lte=0).exclude(owner=RELEASED_OWNER)
        return queryset


class ReadOnlyAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Rows are written only by the store's SQL: nobody adds, edits or deletes them here
    (superusers pass every has_perm, so say no explicitly)."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Lock)
class LockAdmin(ReadOnlyAdmin):
    """Read-only view of the database store's table, plus the all-stores page and force release."""

    list_display = (
        "key",
        "mode_display",
        "holder_display",
        "fence",
        "acquired_display",
        "remaining_display",
        "state_display",
    )
    list_filter = (StateFilter,)
    search_fields = ("key",)
    fields = (
        "key",
        "mode_display",
        "holder_display",
        "fence",
        "acquired_at",
        "expires_at",
        "remaining_display",
        "state_display",
    )
    readonly_fields = fields
    actions = ("force_release_selected",)
    show_full_result_count = False  # one COUNT(*) per page is enough on a big table
    store_page_size = STORE_PAGE_SIZE

    # -- permissions ----------------------------------------------------------------------
    def has_force_release_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(f"{self.opts.app_label}.force_release_lock")

    # -- the changelist -------------------------------------------------------------------
    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest) -> bool:
        # No filter on owner, with any lookup or transform: a viewer could otherwise read a
        # token a character at a time from which rows `owner__startswith` keeps (Django then
        # answers 400). Ordering is by list_display columns only, and owner is not one.
        if lookup.split(LOOKUP_SEP, 1)[0] == "owner":
            return False
        return bool(super().lookup_allowed(lookup, value, request))

    def get_queryset(self, request: HttpRequest) -> models.QuerySet[Lock]:
        # The store's own database, not the router's choice: without a router for this app,
        # that is "default", which has no rows (or no table) when the store lives elsewhere.
        queryset = super().get_queryset(request).using(_model_database())
        return cast(
            "models.QuerySet[Lock]", queryset.annotate(remaining=RemainingSeconds("expires_at"))
        )

    @admin.display(description="remaining", ordering="remaining")
    def remaining_display(self, obj: Lock) -> str:
        seconds = _remaining(obj)
        if seconds <= 0:
            return "—"
        return format_html(
            '<span title="{} s">{}</span>', f"{seconds:.3f}", format_remaining(seconds)
        )

    @admin.display(description="state")
    def state_display(self, obj: Lock) -> str:
        if _remaining(obj) > 0:
            return "held"
        return "released" if obj.owner == RELEASED_OWNER else "expired"

    @admin.display(description="acquired", ordering="acquired_at")
    def acquired_display(self, obj: Lock) -> str:
        return format_acquired(obj.acquired_at)

    @admin.display(description="mode")
    def mode_display(self, obj: Lock) -> str:
        return PERMIT_OWNERS.get(obj.owner, "exclusive")

    @admin.display(description="holder", ordering="holder")
    def holder_display(self, obj: Lock) -> str:
        # A key held by permits has one row here and a holder per permit: the page of every
        # store's locks (and this row's force release) lists each of them.
        if obj.owner in PERMIT_OWNERS:
            return "(permits: each is listed under “Locks in every store”)"
        return obj.holder

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        changelist = super().get_changelist_instance(request)
        if not changelist.query:
            # Django's "(Show all)" beside the count links to the bare list, which is the held
            # locks here: shown only to clear a search; the filter's "all" shows every row.
            changelist.full_result_count = changelist.result_count
        return changelist

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        extra = {"stores_url": self._url("stores"), **(extra_context or {})}
        return super().changelist_view(request, extra)

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        extra = dict(extra_context or {})
        obj = self.get_object(request, unquote(object_id))
        if obj is not None and _remaining(obj) > 0 and self.has_force_release_permission(request):
            alias = database_store_alias(obj._state.db or "default")
            if alias is not None:
                extra["force_release_url"] = self._release_url(
                    alias, obj.key, next_url=request.get_full_path()
                )
        return super().change_view(request, object_id, form_url, extra)

    @admin.action(description="Force release selected locks", permissions=["force_release"])
    def force_release_selected(
        self, request: HttpRequest, queryset: models.QuerySet[Lock]
    ) -> HttpResponse | None:
        alias = database_store_alias(queryset.db)
        if alias is None:
            self.message_user(
                request,
                f"No KEEL_LOCK_STORES alias is a DatabaseLockStore on database {queryset.db!r}, "
                "so these locks cannot be released from here.",
                messages.ERROR,
            )
            return None
        selected = list(queryset)
        if request.POST.get("post") == "yes":
            self._release_confirmed(request, alias, selected)
            return None
        held = [obj for obj in selected if _remaining(obj) > 0]
        context = {
            **self._context(request, "Force release locks"),
            "mode": "action",
            "store": alias,
            "rows": [_row_from_model(obj) for obj in held],
            "skipped": [obj.key for obj in selected if _remaining(obj) <= 0],
            "selected_keys": [obj.pk for obj in selected],
            "fences": json.dumps({obj.key: obj.fence for obj in held}),
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "cancel_url": request.get_full_path(),  # the list as filtered when selected
        }
        return TemplateResponse(
            request, "admin/django_keel_lock/lock/force_release_confirmation.html", context
        )

    def _release_confirmed(self, request: HttpRequest, alias: str, selected: list[Lock]) -> None:
        try:
            fences = json.loads(request.POST.get("fences") or "")
        except ValueError:
            fences = None
        if not isinstance(fences, dict):  # never "every holder": the page showed some only
            self.message_user(
                request,
                "Nothing was released: the form did not say which holders you confirmed "
                "(its fences are missing or not readable). Select the locks and confirm again.",
                messages.ERROR,
            )
            return
        released = 0
        for obj in selected:
            expected = fences.get(obj.key)
            if not isinstance(expected, int) or isinstance(expected, bool):
                continue  # not held when the user confirmed: nothing was asked for
            level, text = self._release_one(request, alias, obj.key, expected)
            if level == messages.SUCCESS:
                released += 1
            else:
                self.message_user(request, text, level)
        if released:
            noun = "lock" if released == 1 else "locks"
            self.message_user(
                request, f"Force-released {released} {noun} in store {alias!r}.", messages.SUCCESS
            )

    # -- the all-stores page --------------------------------------------------------------
    def get_urls(self) -> list[URLPattern]:
        name = f"{self.opts.app_label}_{self.opts.model_name}"
        view = self.admin_site.admin_view
        return [
            path("stores/", view(self.stores_view), name=f"{name}_stores"),
            path("stores/release/", view(self.force_release_view), name=f"{name}_force_release"),
            *super().get_urls(),
        ]

    def stores_view(self, request: HttpRequest) -> HttpResponse:
        """Every configured store's held locks, a page per store; a broken store shows its
        error instead of failing the page."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        prefix = request.GET.get("prefix", "")
        only = request.GET.get("store") or None
        start = (_count(request.GET.get("start")) or 0) if only else 0
        aliases = [alias for alias in conf.STORES if only is None or alias == only]
        can_release = self.has_force_release_permission(request)
        sections = [self._section(alias, prefix, start, can_release, only) for alias in aliases]
        _note_shared_tables(sections)
        context = {
            **self._context(request, "Locks in every store"),
            "sections": sections,
            "prefix": prefix,
            "only": only,
            "can_release": can_release,
            "page_size": self.store_page_size,
            "stores_url": self._url("stores"),
        }
        return TemplateResponse(request, "admin/django_keel_lock/lock/stores.html", context)

    def _section(
        self, alias: str, prefix: str, start: int, can_release: bool, only: str | None
    ) -> StoreSection:
        backend = str(conf.STORES.get(alias, {}).get("BACKEND", "?")).rsplit(".", 1)[-1]
        section = StoreSection(alias=alias, backend=backend, rows=[], start=start)
        size = self.store_page_size
        here = self._url("stores")
        try:
            store = get_lock_store(alias)
            section.backend = type(store).__name__
            infos = _take(store.iter_locks(prefix), start, size + 1)
        except Exception as exc:  # unreachable, misconfigured or broken: say so, keep the page
            logger.warning("lock admin could not list store %r: %s", alias, exc)
            section.error = f"{type(exc).__name__}: {exc}"
            return section
        section.note = store.admin_note
        together = _held_with(store, infos[:size])
        for info in infos[:size]:
            url = None
            if can_release:
                url = self._release_url(alias, info.key, next_url=None, fence=info.fence)
            section.rows.append(LockRow.from_info(info, url, keys_with(info, together)))
        query = {"store": alias, **({"prefix": prefix} if prefix else {})}
        if len(infos) > size:
            section.next_url = f"{here}?{urlencode({**query, 'start': start + size})}"
        if start > 0:
            previous = max(0, start - size)
            section.previous_url = f"{here}?{urlencode({**query, 'start': previous})}"
        if only is None and section.next_url is not None:
            section.all_url = f"{here}?{urlencode(query)}"
        return section

    # -- force release (all-stores page and change view) -----------------------------------
    def force_release_view(self, request: HttpRequest) -> HttpResponse:
        """GET: confirm releasing one key of one store (with `fence`: its holder with that
        fence only). POST with post=yes: release what the user confirmed, no more (see
        `_release_one`)."""
        if not self.has_force_release_permission(request):
            raise PermissionDenied
        data = request.POST if request.method == "POST" else request.GET
        alias, key = data.get("store", ""), data.get("key", "")
        next_url = self._next_url(request, data.get("next"))
        if alias not in conf.STORES:
            self.message_user(request, f"There is no lock store {alias!r}.", messages.ERROR)
            return HttpResponseRedirect(next_url)
        one = _count(data.get("fence")) if data.get("one") == "1" else None
        if request.method == "POST" and data.get("post") == "yes":
            return self._release_posted(request, alias, key, next_url, exact=one is not None)
        try:
            holders = get_lock_store(alias).holders(key)
        except Exception as exc:
            self.message_user(
                request, f"Cannot read {key!r} in store {alias!r}: {exc}", messages.ERROR
            )
            return HttpResponseRedirect(next_url)
        if one is not None:
            holders = [info for info in holders if info.fence == one]
        if not holders:
            self.message_user(
                request,
                f"{key!r} is not held in store {alias!r}"
                f"{'' if one is None else f' by fence {one}'}: nothing to release.",
                messages.WARNING,
            )
            return HttpResponseRedirect(next_url)
        together = _held_with(get_lock_store(alias), holders)
        context = {
            **self._context(request, "Force release a lock"),
            "mode": "single",
            "store": alias,
            "rows": [
                LockRow.from_info(info, together=keys_with(info, together)) for info in holders
            ],
            # Each holder shown has a fence no greater than this; one who came later does not.
            "fence": max(info.fence for info in holders),
            "one": one is not None,
            "next_url": next_url,
            "cancel_url": next_url,
        }
        return TemplateResponse(
            request, "admin/django_keel_lock/lock/force_release_confirmation.html", context
        )

    def _release_posted(
        self, request: HttpRequest, alias: str, key: str, next_url: str, *, exact: bool
    ) -> HttpResponse:
        """The confirmation page's POST: release what it showed, named by its `fence`. Without
        a fence that is a number nothing is released (releasing every holder would free ones
        the page never showed): the user is sent back to the page to confirm again."""
        expected = _count(request.POST.get("fence"))
        if expected is None:
            self.message_user(
                request,
                f"Nothing was released: the form did not say which holders of {key!r} you "
                f"confirmed (fence {request.POST.get('fence')!r} is not a number). "
                "Check the holders below and confirm again.",
                messages.ERROR,
            )
            return HttpResponseRedirect(
                self._release_url(alias, key, next_url=next_url, fence=None)
            )
        level, text = self._release_one(request, alias, key, expected, exact=exact)
        self.message_user(request, text, level)
        return HttpResponseRedirect(next_url)

    def _release_one(
        self,
        request: HttpRequest,
        alias: str,
        key: str,
        expected_fence: int,
        *,
        exact: bool = False,
    ) -> tuple[int, str]:
        """Force-release the holders of `key` in `alias` the user confirmed: the one with
        `expected_fence` (`exact`), or each whose fence is no greater (every holder the page
        showed: fences only grow, so one that came since is left alone). A holder of several
        keys (a multi-key lock) loses them all: its other keys are released too. (message
        level, message); a LogEntry per key released."""
        try:
            store = get_lock_store(alias)
            holders = store.holders(key)
            confirmed = [
                info
                for info in holders
                if (info.fence == expected_fence if exact else info.fence <= expected_fence)
            ]
            if not holders:
                return messages.WARNING, f"{key!r} in store {alias!r} was no longer held."
            if not confirmed:
                current = holders[0]
                return messages.WARNING, (
                    f"{key!r} in store {alias!r} was taken again since you confirmed "
                    f"(holder {current.holder}, fence {current.fence}); nothing was released."
                )
            together = _held_with(store, confirmed)
            freed = self._force_release(request, alias, confirmed, together)
        except Exception as exc:  # store down, bad key: report, never a 500
            logger.warning("lock admin could not force-release %r in %r: %s", key, alias, exc)
            return messages.ERROR, f"Could not force-release {key!r} in store {alias!r}: {exc}"
        if not freed:
            return messages.WARNING, f"{key!r} in store {alias!r} was no longer held."
        what = "; ".join(
            f"holder {info.holder}, fence {info.fence}"
            + (f"; with {', '.join(map(repr, others))}" if others else "")
            for info, others in freed
        )
        return messages.SUCCESS, f"Force-released {key!r} in store {alias!r} ({what})."

    def _force_release(
        self,
        request: HttpRequest,
        alias: str,
        confirmed: list[LockInfo],
        together: dict[str, list[LockInfo]],
    ) -> list[tuple[LockInfo, list[str]]]:
        """Release each confirmed holder by its fence, then the other keys it holds with it;
        each freed holder with the other keys freed, a LogEntry for each key."""
        freed = []
        for each in confirmed:
            info = force_release(each.key, store=alias, user=request.user, fence=each.fence)
            if info is None:
                continue
            self._log_release(request, alias, info)
            others = release_others(alias, each, together, user=request.user)
            for also in others:
                self._log_release(request, alias, also)
            freed.append((info, [also.key for also in others]))
        return freed

    def _log_release(self, request: HttpRequest, alias: str, info: LockInfo) -> None:
        # object_id only when the lock is a row this admin shows, so "Recent actions" links
        # resolve; locks of other stores are named by object_repr and the message.
        own_row = _is_model_store(alias)
        LogEntry.objects.create(
            user_id=cast(int, request.user.pk),  # admin_view let only a signed-in user here
            content_type=ContentType.objects.get_for_model(Lock),
            object_id=info.key if own_row else None,
            object_repr=info.key[:200],
            action_flag=CHANGE,
            change_message=(
                f"Force-released in store {alias!r}: holder {info.holder}, fence {info.fence}."
            ),
        )

    # -- helpers --------------------------------------------------------------------------
    def _url(self, name: str) -> str:
        return reverse(
            f"admin:{self.opts.app_label}_{self.opts.model_name}_{name}",
            current_app=self.admin_site.name,
        )

    def _release_url(
        self, alias: str, key: str, *, next_url: str | None, fence: int | None = None
    ) -> str:
        """The confirmation page for releasing `key` (with `fence`: that holder only)."""
        query = {"store": alias, "key": key, **({"next": next_url} if next_url else {})}
        if fence is not None:
            query.update(fence=str(fence), one="1")
        return f"{self._url('force_release')}?{urlencode(query)}"

    def _next_url(self, request: HttpRequest, candidate: str | None) -> str:
        if candidate and url_has_allowed_host_and_scheme(
            candidate, allowed_hosts={request.get_host()}, require_https=request.is_secure()
        ):
            return candidate
        return self._url("stores")

    def _context(self, request: HttpRequest, title: str) -> dict[str, Any]:
        request.current_app = self.admin_site.name
        return {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": title,
            "has_view_permission": self.has_view_permission(request),
            "breadcrumbs_as_list": breadcrumbs_as_list(),
        }


@admin.register(StoreLock)
class StoreLockAdmin(ReadOnlyAdmin):
    """The entry that links the page of every store's locks from the site index and the app's
    list (the navigation sidebar too): its list is that page, for whoever may view locks."""

    def has_module_permission(self, request: HttpRequest) -> bool:
        return self.has_view_permission(request)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return request.user.has_perm(f"{self.opts.app_label}.view_lock")

    def get_urls(self) -> list[URLPattern]:
        name = f"{self.opts.app_label}_{self.opts.model_name}_changelist"
        return [path("", self.admin_site.admin_view(self.changelist_view), name=name)]

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        stores = reverse(
            f"admin:{self.opts.app_label}_lock_stores", current_app=self.admin_site.name
        )
        return HttpResponseRedirect(stores)


def _held_with(store: LockStore, infos: list[LockInfo]) -> dict[str, list[LockInfo]]:
    """`together.held_with` for the holders shown (one scan of the store's locks)."""
    return held_with(store, [info.owner for info in infos])


def _remaining(obj: Lock) -> float:
    value = getattr(obj, "remaining", None)
    return float(value) if value is not None else 0.0


def _row_from_model(obj: Lock) -> LockRow:
    """The row of a changelist object, as the store would have read it."""
    info = LockInfo(
        key=obj.key,
        owner=obj.owner,
        holder=obj.holder if obj.owner not in PERMIT_OWNERS else "(each permit)",
        fence=obj.fence,
        acquired_at=obj.acquired_at,
        expires_in=_remaining(obj),
        mode=PERMIT_OWNERS.get(obj.owner, "exclusive"),
    )
    return LockRow.from_info(info)


def _model_database(stores: dict[str, str] | None = None) -> str:
    """The database whose lock table the changelist shows: the "default" store's if that is a
    DatabaseLockStore, else the first one configured; with none, the router's choice."""
    from django.db import router

    stores = database_stores() if stores is None else stores
    if "default" in stores:
        return stores["default"]
    return next(iter(stores.values()), None) or router.db_for_read(Lock) or "default"


def _is_model_store(alias: str) -> bool:
    """Is `alias` a database store on the database this admin's changelist reads?"""
    stores = database_stores()
    return alias in stores and stores[alias] == _model_database(stores)


def _note_shared_tables(sections: list[StoreSection]) -> None:
    """Database stores on one database share one table: say so where the same locks repeat."""
    stores = database_stores()
    first: dict[str, str] = {}
    for section in sections:
        database = stores.get(section.alias)
        if section.error is not None or database is None:
            continue
        owner = first.setdefault(database, section.alias)
        if owner != section.alias:
            shared = f"Same table as store {owner!r} (database {database!r}): same locks."
            section.note = f"{section.note} {shared}" if section.note else shared


def _take(locks: Iterable[LockInfo], start: int, count: int) -> list[LockInfo]:
    """Up to `count` locks after skipping `start`, streaming: never more in memory."""
    iterator = iter(locks)
    try:
        return list(itertools.islice(iterator, start, start + count))
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()


def _count(value: str | None) -> int | None:
    """A non-negative int from a query parameter, None if missing or garbage."""
    try:
        return max(0, int(value)) if value is not None else None
    except ValueError:
        return None


# -- idempotent results (django_keel_lock.idempotency) ---------------------------------------
@admin.register(IdempotentResult)
class IdempotentResultAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """The kept answers of idempotent requests (the database stores' table), read-only; the
    "Delete" action forgets them, so the next request with such a key runs its view again.
    The bodies are not shown: they are what a user was answered."""

    list_display = ("key", "status_display", "age_display", "size", "expires_at")
    search_fields = ("key",)
    fields = ("key", "status_display", "fence", "size", "created_at", "expires_at")
    readonly_fields = fields
    list_per_page = 100
    show_full_result_count = False

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_queryset(self, request: HttpRequest) -> models.QuerySet[IdempotentResult]:
        # Where the database store keeps them (as the lock table's changelist), without the
        # data column: a listing reads no bodies. The expired ones wait for their clean-up.
        database = _model_database()
        queryset = super().get_queryset(request).using(database).defer("data")
        # By the store's clock: MySQL's Now() is the session time zone's, the expiry UTC's.
        return queryset.filter(expires_at__gt=store_now(connections[database].vendor))

    @admin.display(description="status", ordering="status")
    def status_display(self, obj: IdempotentResult) -> str:
        return "function result" if obj.status == 0 else str(obj.status)

    @admin.display(description="age", ordering="-created_at")
    def age_display(self, obj: IdempotentResult) -> str:
        # By this server's clock: a display, nothing is decided by it.
        age = (timezone.now() - obj.created_at).total_seconds()
        return format_remaining(age) if age > 0 else "0s"
