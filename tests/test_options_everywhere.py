"""Every lock option (`options.LockOptions`) is taken by every surface and means the same there,
or is refused with an error that says what to do: the list is declared once, so a new option
cannot be forgotten on one surface again (`shared=` on `locked_task`, `name=` on `@locked` and
`@lock_view` were).

Each surface is run for real on memory stores, and the handle it made (returned, found as
`request.keel_lock` or as the task's `current_lock()`, or sent with `lock_acquired`) is asked
whether it carries the option.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from django.dispatch import receiver
from django.http import HttpRequest, HttpResponse
from django.test import RequestFactory
from django.views import View

from django_keel_lock import Lock, LockViewMixin, lock, lock_view, locked, semaphore, signals
from django_keel_lock.contrib import celery as contrib_celery
from django_keel_lock.contrib import tasks as contrib_tasks
from django_keel_lock.options import OPTION_DEFAULTS, OPTION_NAMES, LockOptions, LockSpec
from django_keel_lock.testing import memory_lock_store

try:
    from django.tasks import task
except ImportError:  # Django 5.2: the backport
    from django_tasks import task

#: A value for each option, unlike its default, and how a handle shows that it carries it.
VALUES: dict[str, tuple[object, Callable[[Lock], object]]] = {
    "ttl": (7, lambda handle: handle.ttl == 7.0),
    "timeout": (0.25, lambda handle: handle.timeout == 0.25),
    "retry_delay": (0.125, lambda handle: handle.retry_delay == 0.125),
    "store": ("other", lambda handle: handle.store_alias == "other"),
    "holder": ("tester:1", lambda handle: handle.holder == "tester:1"),
    "auto_extend": (True, lambda handle: handle.auto_extend is True),
    "max_hold": (30, lambda handle: handle.max_hold == 30.0),
    "on_lost": ("warn", lambda handle: handle.on_lost == "warn"),
    "name": ("invoices", lambda handle: handle.name == "invoices"),
    "limit": (3, lambda handle: handle.mode.kind == "semaphore" and handle.mode.limit == 3),
    "shared": (True, lambda handle: handle.mode.kind == "shared"),
}
#: What a surface says when it does not take an option, by (surface, option).
REFUSED = {
    ("lock", "limit"): r"lock\(\) got an unexpected keyword argument 'limit': .*semaphore\(",
    ("semaphore", "shared"): (
        r"semaphore\(\) got an unexpected keyword argument 'shared': .*lock\(key, shared=True\)"
    ),
}
KEY = "options-everywhere"


def with_option(option: str) -> dict[str, Any]:
    """The options that ask for `option`'s value (max_hold needs auto_extend)."""
    options: dict[str, Any] = {option: VALUES[option][0]}
    if option == "max_hold":
        options["auto_extend"] = True
    return options


@pytest.fixture(autouse=True)
def stores() -> Iterator[None]:
    with memory_lock_store("default", "other"):
        yield


@pytest.fixture
def acquired() -> Iterator[list[Lock]]:
    """The handles `lock_acquired` announces while the test runs."""
    seen: list[Lock] = []

    @receiver(signals.lock_acquired, weak=False)
    def record(lock: Lock, **kwargs: Any) -> None:
        seen.append(lock)

    yield seen
    signals.lock_acquired.disconnect(record)


# -- the surfaces: each makes a handle with `options` and gives it back -----------------------
def via_lock(options: dict[str, Any], acquired: list[Lock]) -> Lock:
    return lock(KEY, **options)


def via_semaphore(options: dict[str, Any], acquired: list[Lock]) -> Lock:
    return semaphore(KEY, **{"limit": 2, **options})


def via_lock_class(options: dict[str, Any], acquired: list[Lock]) -> Lock:
    return Lock(KEY, **options)


def via_locked(options: dict[str, Any], acquired: list[Lock]) -> Lock:
    @locked(KEY, **options)
    def job() -> None:
        pass

    job()
    return acquired[-1]


def via_lock_view(options: dict[str, Any], acquired: list[Lock]) -> Lock:
    seen: list[Lock] = []

    @lock_view(KEY, **options)
    def view(request: HttpRequest) -> HttpResponse:
        seen.append(request.keel_lock)  # type: ignore[attr-defined]
        return HttpResponse("ok")

    assert view(RequestFactory().post("/")).status_code == 200
    return seen[0]


def via_mixin(options: dict[str, Any], acquired: list[Lock]) -> Lock:
    seen: list[Lock] = []

    class Charge(LockViewMixin, View):
        lock_key = KEY

        def post(self, request: HttpRequest) -> HttpResponse:
            seen.append(request.keel_lock)  # type: ignore[attr-defined]
            return HttpResponse("ok")

    for option, value in options.items():
        setattr(Charge, f"lock_{option}", value)
    assert Charge.as_view()(RequestFactory().post("/")).status_code == 200
    return seen[0]


eager = Celery("keel-lock-options", set_as_current=False, broker="memory://")
eager.conf.task_always_eager = True
celery_names = itertools.count()


def via_celery_task(options: dict[str, Any], acquired: list[Lock]) -> Lock:
    seen: list[Lock] = []

    def body() -> None:
        handle = contrib_celery.current_lock()
        assert handle is not None
        seen.append(handle)

    name = f"options.{next(celery_names)}"
    eager.task(name=name)(contrib_celery.locked_task(KEY, **options)(body))()
    return seen[0]


def record_task_lock() -> None:
    """The body of the Django Tasks task (a task's function is defined at module level)."""
    handle = contrib_tasks.current_lock()
    assert handle is not None
    task_locks.append(handle)


task_locks: list[Lock] = []


def via_django_task(options: dict[str, Any], acquired: list[Lock]) -> Lock:
    task_locks.clear()
    contrib_tasks.locked_task(KEY, **options)(task(record_task_lock)).enqueue()
    return task_locks[0]


SURFACES: dict[str, Callable[[dict[str, Any], list[Lock]], Lock]] = {
    "lock": via_lock,
    "semaphore": via_semaphore,
    "Lock": via_lock_class,
    "locked": via_locked,
    "lock_view": via_lock_view,
    "LockViewMixin": via_mixin,
    "celery.locked_task": via_celery_task,
    "tasks.locked_task": via_django_task,
}


def test_the_options_are_the_ones_lock_spec_parses() -> None:
    assert set(LockOptions.__annotations__) == set(VALUES) == set(OPTION_NAMES)


@pytest.mark.parametrize("option", list(LockOptions.__annotations__))
@pytest.mark.parametrize("surface", list(SURFACES))
def test_every_surface_takes_every_lock_option_or_says_what_to_do(
    surface: str, option: str, acquired: list[Lock]
) -> None:
    make = SURFACES[surface]
    refusal = REFUSED.get((surface, option))
    if refusal is not None:
        with pytest.raises(TypeError, match=refusal):
            make(with_option(option), acquired)
        return
    handle = make(with_option(option), acquired)
    assert VALUES[option][1](handle), f"{surface} dropped {option}={VALUES[option][0]!r}"


def test_the_mixin_has_an_attribute_for_every_lock_option() -> None:
    missing = [name for name in OPTION_NAMES if not hasattr(LockViewMixin, f"lock_{name}")]
    assert missing == []


@pytest.mark.parametrize("surface", [s for s in SURFACES if s != "LockViewMixin"])
def test_an_unknown_option_is_refused_naming_it_and_the_nearest_option(
    surface: str, acquired: list[Lock]
) -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'tiemout': did you mean"):
        SURFACES[surface]({"tiemout": 1}, acquired)


@pytest.mark.parametrize("surface", [s for s in SURFACES if s.endswith("locked_task")])
def test_a_task_names_its_locks_after_the_key_template_unless_given_a_name(
    surface: str, acquired: list[Lock]
) -> None:
    assert SURFACES[surface]({}, acquired).name == KEY


def test_the_declared_defaults_are_what_an_unset_option_means() -> None:
    assert set(OPTION_DEFAULTS) == set(OPTION_NAMES)
    assert LockSpec.of("test", OPTION_DEFAULTS) == LockSpec.of("test", {})
