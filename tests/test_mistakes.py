"""Mistakes a newcomer makes, each caught and named: what the user now reads."""

from __future__ import annotations

import io
import json
import pickle

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.core.management.base import SystemCheckError
from django.http import HttpRequest, HttpResponse
from django.test import Client, override_settings
from django.urls import include, path, re_path
from django.utils.decorators import method_decorator
from django.views import View

from django_keel_lock import (
    AlreadyQueued,
    LockStoreMisconfigured,
    LockStoreUnavailable,
    LockUnavailable,
    LockViewMixin,
    lock,
    lock_view,
    locked,
    semaphore,
)
from django_keel_lock.checks import check_stores, check_view_keys

from .conftest import DATABASE_STORES, database_of, empty_database, needs, serving, store_params

DB = "django_keel_lock.stores.DatabaseLockStore"
REDIS = "django_keel_lock.stores.RedisLockStore"


# -- errors survive pickling and Celery's JSON results ----------------------------------------
def _celery_round_trip(error: Exception) -> Exception:
    """`error` as a Celery result backend with the JSON serializer (the default) stores it and
    gives it back to AsyncResult.get()."""
    from celery import Celery
    from celery.backends.base import Backend

    backend = Backend(Celery(set_as_current=False), serializer="json")
    stored = json.loads(json.dumps(backend.prepare_exception(error)))
    return backend.exception_to_python(stored)


def test_lock_unavailable_round_trips_through_pickle_and_celery_with_its_message(key: str) -> None:
    held = lock(key, store="memory")
    assert held.acquire()
    try:
        with pytest.raises(LockUnavailable) as info, lock(key, store="memory"):
            pass
    finally:
        held.release()
    error = info.value
    assert str(error) == f"lock {key!r} is held by someone else (waited 0s)"
    error.remaining = 3.5  # an attribute set after it was made comes back through pickle too
    pickled = pickle.loads(pickle.dumps(error))
    assert type(pickled) is LockUnavailable
    assert (str(pickled), pickled.key, pickled.remaining) == (str(error), key, 3.5)
    from_celery = _celery_round_trip(error)
    assert type(from_celery) is LockUnavailable
    assert (str(from_celery), from_celery.key) == (str(error), key)  # not doubled


def test_already_queued_round_trips_through_pickle_and_celery() -> None:
    error = AlreadyQueued("export:1", "3f6c")
    assert str(error) == "a task with key 'export:1' is already queued: 3f6c"
    for again in (pickle.loads(pickle.dumps(error)), _celery_round_trip(error)):
        assert type(again) is AlreadyQueued
        assert (str(again), again.key, again.task_id) == (str(error), "export:1", "3f6c")


# -- a database store on a database that was never migrated ---------------------------------
@pytest.mark.parametrize("server", store_params(DATABASE_STORES))
def test_a_store_on_an_unmigrated_database_says_to_run_migrate(server: str, key: str) -> None:
    on_locks = {
        "default": {"BACKEND": DB},
        "locks": {"BACKEND": DB, "OPTIONS": {"DATABASE": "locks"}},
    }
    with (
        empty_database(database_of(server), "locks"),
        override_settings(KEEL_LOCK_STORES=on_locks),
    ):
        with pytest.raises(LockStoreMisconfigured) as taken:
            lock(key, store="locks").acquire()
        with pytest.raises(LockStoreMisconfigured) as limited:
            semaphore(key, limit=2, store="locks").acquire()
        with pytest.raises(CommandError) as listed:
            call_command("locks", "list", "--store", "locks", stdout=io.StringIO())
    for error in (taken.value, limited.value):
        message = str(error)
        assert "lock store 'locks': database 'locks' lacks the lock tables" in message
        assert message.endswith("run: python manage.py migrate django_keel_lock --database locks")
        assert isinstance(error, ImproperlyConfigured)
        assert not isinstance(error, LockStoreUnavailable)
    assert listed.value.returncode == 2
    assert "migrate django_keel_lock" in str(listed.value)


# -- a key template naming what the function or URL does not have ---------------------------
def test_locked_template_naming_a_missing_argument_fails_at_decoration() -> None:
    with pytest.raises(ValueError, match=r"names \{invoice\.pk\}") as info:

        @locked("charge:{invoice.pk}")
        def charge(invoce: object, amount: int) -> None: ...

    assert str(info.value) == (
        "key template 'charge:{invoice.pk}' names {invoice.pk}, which "
        "test_locked_template_naming_a_missing_argument_fails_at_decoration.<locals>.charge "
        "does not take (its parameters: invoce, amount); name one of them"
    )


def test_locked_template_whose_argument_lacks_the_attribute_says_so_per_call() -> None:
    # "{obj.pk}" names an argument the function takes, so decoration passes; a call with an
    # int there cannot be formatted: the error says which template, what is missing, and
    # the call's arguments (it said "names 'int' object has no attribute 'pk' which ...").
    @locked(["account:{src}", "account:{obj.pk}"], store="memory")
    def transfer(src: int, obj: object) -> None: ...

    with pytest.raises(ValueError) as info:
        transfer(1, 5)
    assert str(info.value) == (
        "key template 'account:{obj.pk}' cannot be formatted for this call of "
        "test_locked_template_whose_argument_lacks_the_attribute_says_so_per_call.<locals>."
        "transfer: AttributeError: 'int' object has no attribute 'pk' (its arguments: src, obj)"
    )


def test_locked_template_names_keywords_of_kwargs_through_its_name() -> None:
    # The keywords **kwargs gathers are formatted under its name: "{invoice_id}" would fail on
    # every call, so it fails at decoration too.
    with pytest.raises(ValueError, match=r"names \{invoice_id\}.*\(its parameters: kwargs\)"):

        @locked("charge:{invoice_id}", store="memory")
        def wrong(**kwargs: object) -> None: ...

    @locked("charge:{kwargs[invoice_id]}", store="memory")
    def charge(**kwargs: object) -> object:
        return kwargs["invoice_id"]

    assert charge(invoice_id=7) == 7


def test_locked_task_template_naming_a_missing_argument_fails_at_decoration() -> None:
    from django_keel_lock.contrib.celery import locked_task

    with pytest.raises(ValueError, match=r"names \{date\}.*\(its parameters: self, day\)"):

        @locked_task("report:{date}")
        def report(self: object, day: str) -> None: ...


def _sync(account_id: int) -> None:
    """A task function (Django's tasks must be defined at module level)."""


@needs(settings.HAS_TASKS_DB, "django-tasks (the test extra)")
def test_django_tasks_locked_task_template_naming_a_missing_argument_fails_at_decoration() -> None:
    from django_keel_lock.contrib.tasks import locked_task

    try:
        from django.tasks import task
    except ImportError:  # Django 5.2: the backport
        from django_tasks import task

    with pytest.raises(ValueError, match=r"names \{account\}.*\(its parameters: account_id\)"):
        locked_task("sync:{account}")(task(_sync))


# -- a @lock_view key naming a URL kwarg its route does not capture -------------------------
@lock_view("invoice:<id>", store="memory")
def charge_invoice(request: HttpRequest, pk: int) -> HttpResponse:
    return HttpResponse("charged")


@lock_view("account:<account>:invoice:<pk>", store="memory")
async def refund_invoice(request: HttpRequest, account: int, pk: int) -> HttpResponse:
    return HttpResponse("refunded")


class ExportView(LockViewMixin, View):
    lock_key = "export:<report>"
    lock_store = "memory"

    def get(self, request: HttpRequest, **kwargs: object) -> HttpResponse:
        return HttpResponse("exported")


@method_decorator(lock_view("import:<batch>", store="memory"), name="dispatch")
class ImportView(View):
    def get(self, request: HttpRequest, **kwargs: object) -> HttpResponse:
        return HttpResponse("imported")


@lock_view(["account:<source>", "account:<destination>"], store="memory")
def move_money(request: HttpRequest, source: int, target: int) -> HttpResponse:
    return HttpResponse("moved")


#: The URLconf of the E012 tests (ROOT_URLCONF="tests.test_mistakes").
urlpatterns = [
    path("invoices/<int:pk>/charge", charge_invoice),
    path("accounts/<int:account>/", include([path("invoices/<int:pk>/refund", refund_invoice)])),
    path("reports/<str:name>/export", ExportView.as_view()),
    path("reports/daily/export", ExportView.as_view(), {"report": "daily"}),
    re_path(r"^imports/(?P<batch>[0-9]+)$", ImportView.as_view()),
    re_path(r"^imports/latest$", ImportView.as_view()),
    path("moves/<int:source>/<int:target>", move_money),
]


@override_settings(ROOT_URLCONF="tests.test_mistakes")
def test_e012_lock_view_key_naming_a_kwarg_the_url_does_not_capture() -> None:
    found = check_view_keys()
    assert [m.id for m in found] == ["django_keel_lock.E012"] * 4
    charge, export, imports, move = found
    assert charge.msg == (
        "tests.test_mistakes.charge_invoice locks key 'invoice:<id>', but URL "
        "'invoices/<int:pk>/charge' has no kwarg <id> (its kwargs: <pk>): every request "
        "there fails."
    )
    assert (
        charge.hint
        == "Write a kwarg the route captures in the key template, or capture <id> in the route."
    )
    assert (
        "URL 'reports/<str:name>/export' has no kwarg <report> (its kwargs: <name>)" in export.msg
    )
    assert "URL '^imports/latest$' has no kwarg <batch> (its kwargs: none)" in imports.msg
    # A list of templates (several keys at once): each template's <name>s.
    assert "has no kwarg <destination> (its kwargs: <source>, <target>)" in move.msg
    # What it saves the user from: the request fails only when it comes.
    response = Client(raise_request_exception=False).get("/invoices/7/charge")
    assert response.status_code == 500


@override_settings(ROOT_URLCONF="tests.test_mistakes", SILENCED_SYSTEM_CHECKS=[])
def test_e012_stops_manage_py_check() -> None:
    with pytest.raises(SystemCheckError, match=r"django_keel_lock\.E012"):
        call_command("check", stdout=io.StringIO(), stderr=io.StringIO())


def test_e012_finds_the_one_bad_placeholder_the_test_urls_route_on_purpose() -> None:
    (found,) = check_view_keys()
    assert found.msg.startswith("tests.testapp.views.bad_placeholder locks key '<nope>', but URL")


# -- settings ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "meant"),
    [("KEEL_LOCK_STORE", "KEEL_LOCK_STORES"), ("KEEL_LOCKS_DEFAULT_TTL", "KEEL_LOCK_DEFAULT_TTL"),
     ("KEEL_LOCK_METRIC", "KEEL_LOCK_METRICS")],
)  # fmt: skip
def test_w010_a_misspelled_setting_is_named_with_the_one_meant(name: str, meant: str) -> None:
    with override_settings(**{name: {"default": {"BACKEND": REDIS}}}):
        found = [m for m in check_stores() if m.id == "django_keel_lock.W010"]
    (message,) = found
    assert (
        message.msg
        == f"{name} is not a django-keel-lock setting, so it is ignored: did you mean {meant}?"
    )
    assert (
        message.hint
        == "The settings are KEEL_LOCK_STORES, KEEL_LOCK_DEFAULT_TTL, KEEL_LOCK_METRICS, "
        "KEEL_LOCK_IDEMPOTENT_PATHS."
    )


def test_w010_a_keel_lock_setting_like_none_of_ours_is_named_without_a_guess() -> None:
    with override_settings(KEEL_LOCKSMITH_HOME="/srv"):
        (message,) = [m for m in check_stores() if m.id == "django_keel_lock.W010"]
    assert message.msg == "KEEL_LOCKSMITH_HOME is not a django-keel-lock setting, so it is ignored."


def test_w010_not_for_our_settings_nor_for_environment_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The example project reads the environment variable KEEL_LOCK_STORE: not a setting.
    monkeypatch.setenv("KEEL_LOCK_STORE", "redis")
    with override_settings(KEEL_LOCK_METRICS=None, KEEL_LOCK_DEFAULT_TTL=5):
        assert [m for m in check_stores() if m.id == "django_keel_lock.W010"] == []


# -- Redis stores -----------------------------------------------------------------------------
def test_redis_store_down_names_host_and_port_and_no_password(key: str) -> None:
    from django_keel_lock.stores import RedisLockStore

    # Nothing listens on port 1: refused at once.
    store = RedisLockStore("down", {"URL": "redis://:s3cret@127.0.0.1:1/0"})
    with serving(store) as alias, pytest.raises(LockStoreUnavailable) as info:
        lock(key, store=alias).acquire()
    message = str(info.value)
    assert message.startswith("lock store 'down' cannot use Redis (URL 127.0.0.1:1): ")
    assert "s3cret" not in message


def test_redis_store_on_a_cache_that_does_not_exist_names_it_and_the_caches() -> None:
    stores = {"default": {"BACKEND": DB},
              "jobs": {"BACKEND": REDIS, "OPTIONS": {"CONNECTION": "lcoks"}}}  # fmt: skip
    caches = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
              "locks": {"BACKEND": "django_redis.cache.RedisCache",
                        "LOCATION": "redis://127.0.0.1:6379/3"}}  # fmt: skip
    with override_settings(KEEL_LOCK_STORES=stores, CACHES=caches):
        (checked,) = check_stores()
        with pytest.raises(ImproperlyConfigured) as info:
            lock("report:1", store="jobs").acquire()
    # At check time (runserver and migrate stop on it):
    assert checked.id == "django_keel_lock.E008"
    assert (
        checked.msg == "KEEL_LOCK_STORES['jobs'] OPTIONS CONNECTION 'lcoks' is not a CACHES alias."
    )
    assert (
        checked.hint == "Name a django-redis cache (CACHES has: default, locks) or use URL instead."
    )
    # And where checks do not run (a worker, a shell): not Django's bare
    # "The connection 'lcoks' doesn't exist."
    assert str(info.value) == (
        "KEEL_LOCK_STORES['jobs'] OPTIONS CONNECTION 'lcoks' is not a CACHES alias (CACHES has: "
        "default, locks); name a django-redis cache, or use URL"
    )
