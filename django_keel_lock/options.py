"""What every surface takes besides the key: parsed and checked once, into a `LockSpec`.

The options are declared once, as `LockOptions`: every surface (`Lock`, `lock()`,
`semaphore()`, `@locked`, `@lock_view`, `LockViewMixin`, `locked_task`) takes them as
`**options: Unpack[LockOptions]` beside the options of its own (`on_locked`, `countdown`, ...),
and turns them into a `LockSpec` where it is declared, so a mistake fails at decoration time
rather than on the first call, then asks the spec for a `Lock` per call. The rules for keys
and holders, and the key formatter the decorators share, live here too.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
import socket
import string
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol, TypedDict, Unpack, cast

from django.core.signals import setting_changed
from django.dispatch import receiver

from .conf import conf
from .durations import Duration, to_seconds
from .stores.base import EXCLUSIVE, MAX_KEYS, SHARED, Mode, semaphore_mode

if TYPE_CHECKING:
    from .core import Lock
    from .stores.base import LockStore

DEFAULT_RETRY_DELAY = 0.05
#: What a store keeps of a holder (the `holder` column of the database store is this wide).
MAX_HOLDER_LENGTH = 255
# Longer ttls would overflow some stores' interval arithmetic; a lock that must outlive a
# year wants a human, not a ttl.
MAX_TTL = 365 * 86400.0
# Shorter ttls fall below what the stores resolve (Redis PX and the database clocks count
# milliseconds at best): the lock would be expired as it is taken.
MIN_TTL = 0.001
#: The largest semaphore limit: what every store keeps (PostgreSQL takes it as a bigint).
MAX_LIMIT = 2**63 - 1
_HOSTNAME = socket.gethostname()

# -- on_locked: what a surface does when someone else holds the lock for the whole wait ----
#: Raise `LockUnavailable` (`@locked`'s default; `locked_task` too, when asked).
RAISE: Final = "raise"
#: Do not run; return None, logged at INFO (`locked_task`'s default; `@locked`, when asked).
SKIP: Final = "skip"
#: Retry the task later (`locked_task` only: only a task queue can run it again).
RETRY: Final = "retry"
# `@lock_view` and `LockViewMixin` answer a request: their on_locked is a callable
# `(request, key) -> response` that answers instead of the default 409.

OnLocked = Literal["raise", "skip", "retry"]

# -- on_lost: what happens when a lock is lost while its holder works ------------------------
# RAISE (the default): leaving the block (`with`, `run`, a decorated function, view or task)
# raises `LockNotHeldError`, so an enclosing `transaction.atomic()` rolls back; an async body
# kept alive by the watchdog is cancelled the moment the loss is found.
#: Only log a WARNING and send `lock_lost`; the block ends normally.
WARN: Final = "warn"
#: Or a callable `(lock) -> None`, called once when the loss is detected; the block then ends
#: normally: the callable decided what to do.
OnLost = Literal["raise", "warn"] | Callable[["Lock"], object]


def check_on_lost(value: object) -> OnLost:
    """`value` if it is "raise", "warn" or a callable `(lock) -> None`, else a ValueError."""
    if value in (RAISE, WARN):
        return value  # type: ignore[return-value]
    if callable(value):
        return value
    raise ValueError(f'on_lost must be "raise", "warn" or a callable (lock) -> None, got {value!r}')


def check_on_locked(value: object, allowed: tuple[OnLocked, ...]) -> OnLocked:
    """`value` if it is one of the markers this surface takes (`allowed`), else a ValueError."""
    for marker in allowed:
        if value == marker:
            return marker
    if len(allowed) == 2:
        expected = f'"{allowed[0]}" or "{allowed[1]}",'
    else:
        expected = f"one of {', '.join(allowed)};"
    raise ValueError(f"on_locked must be {expected} got {value!r}")


# -- keys -----------------------------------------------------------------------------------
class InvalidKey(ValueError):
    """A str that no lock can take as its key (what `validate_key` raises for one)."""


def validate_key(key: object, store: LockStore | None = None) -> str:
    """Return `key` if it is a usable lock key, else raise naming the argument."""
    if not isinstance(key, str):
        raise TypeError(f"key must be a str, got {type(key).__name__}")
    if not key:
        raise InvalidKey("key must be a non-empty string")
    if not (key.isascii() and key.isprintable()):  # else neither test below can fail
        _check_printable("key", key, InvalidKey)
        try:
            key.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidKey(f"key must be encodable as UTF-8 ({exc.reason})") from None
    limit = store.max_key_length if store is not None else None
    if limit is not None and len(key) > limit:
        raise InvalidKey(
            f"key is {len(key)} characters long; store {store.alias!r} "  # type: ignore[union-attr]
            f"accepts at most {limit}"
        )
    return key


def validate_keys(keys: object, store: LockStore | None = None) -> tuple[str, ...]:
    """The distinct keys of a multi-key lock, sorted (the order given does not matter), if
    `keys` is a list or tuple of at most MAX_KEYS usable keys; else raise naming the
    argument (and the item)."""
    if not isinstance(keys, list | tuple):
        raise TypeError(
            f"keys must be a list or tuple of str (the keys to take at once), got "
            f"{type(keys).__name__}; for one key pass the str itself"
        )
    if not keys:
        raise ValueError("keys must name at least one key, got an empty " + type(keys).__name__)
    distinct = set()
    for index, key in enumerate(keys):
        try:
            distinct.add(validate_key(key, store))
        except (TypeError, ValueError) as error:
            raise type(error)(f"keys[{index}] ({key!r:.60}): {error}") from None
    if len(distinct) > MAX_KEYS:
        raise ValueError(
            f"keys names {len(distinct)} distinct keys; a lock takes at most {MAX_KEYS} at "
            "once (split the work, or lock a key that stands for the group)"
        )
    return tuple(sorted(distinct))


KeyTemplate = str | Callable[..., str]

# Control characters (C0, DEL, C1): a key or holder is printed by `manage.py locks` and logs,
# where ESC, BEL or a newline would rewrite the operator's terminal or forge a line.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def _check_printable(name: str, value: str, error: type[ValueError] = ValueError) -> None:
    found = _CONTROL.search(value)
    if found is not None:
        raise error(
            f"{name} must not contain control characters, found {found.group()!r} at index "
            f"{found.start()} of {value!r:.80}"
        )


def printable(text: str) -> str:
    """`text` with every control character written as an escape (\\x1b): safe to print."""
    return _CONTROL.sub(lambda match: repr(match.group())[1:-1], text)


def check_key_template(template: object) -> None:
    """Raise unless `template` is something `format_key` can use."""
    if not (isinstance(template, str) or callable(template)):
        raise TypeError(f"key must be a str template or a callable, got {type(template).__name__}")


class Binder:
    """How one function's calls bind their arguments to its parameters, for a key template:
    its signature, worked out once, and (where every parameter is a plain one, neither
    positional-only, keyword-only nor gathering) a short cut past `inspect.Signature.bind`,
    which was a good part of what `@locked` itself cost per call."""

    __slots__ = ("__weakref__", "defaults", "names", "places", "signature")

    def __init__(self, signature: inspect.Signature) -> None:
        self.signature = signature
        parameters = signature.parameters.values()
        plain = all(each.kind is each.POSITIONAL_OR_KEYWORD for each in parameters)
        #: The parameters' names in order (empty where the short cut does not apply).
        self.names = tuple(signature.parameters) if plain else ()
        self.places = {name: at for at, name in enumerate(self.names)}
        self.defaults = {
            each.name: each.default for each in parameters if each.default is not each.empty
        }

    def arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Each parameter's value for a call with `args` and `kwargs`, defaults included, in
        the parameters' order (`BoundArguments.arguments` after `apply_defaults`); TypeError
        where the call does not fit the signature (from `bind`, with its words)."""
        names, places, count = self.names, self.places, len(args)
        if names and count <= len(names) and all(places.get(k, -1) >= count for k in kwargs):
            arguments = dict(zip(names, args, strict=False))
            for name in names[count:]:
                if name in kwargs:
                    arguments[name] = kwargs[name]
                elif name in self.defaults:
                    arguments[name] = self.defaults[name]
                else:
                    break  # a required argument missing: `bind` says so
            else:
                return arguments
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments


#: Each function's `Binder`, worked out once. Weakly held (a function made on the fly goes
#: with it); a callable that cannot be weakly referred to, or hashed, has its signature worked
#: out at each call.
_BINDERS: weakref.WeakKeyDictionary[Callable[..., Any], Binder] = weakref.WeakKeyDictionary()


def binder_of(fn: Callable[..., Any]) -> Binder:
    """`fn`'s `Binder` (its `inspect.signature`), once per function (`_BINDERS`)."""
    try:
        return _BINDERS[fn]
    except (KeyError, TypeError):
        pass
    binder = Binder(inspect.signature(fn))
    try:
        _BINDERS[fn] = binder
    except TypeError:
        pass
    return binder


def format_key(
    template: KeyTemplate, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str:
    """The key for one call of `fn`: `template` formatted with the call's bound arguments
    ("report:{date}", "{self.pk}" works too), or `template(*args, **kwargs)` if callable.

    `@locked` and `locked_task` name their keys with it, so both read templates alike.
    """
    if callable(template):
        return validate_key(template(*args, **kwargs))
    check_key_template(template)
    try:
        arguments = binder_of(fn).arguments(args, kwargs)
    except TypeError as exc:
        raise TypeError(
            f"cannot bind arguments of {fn.__qualname__} for key {template!r}: {exc}"
        ) from None
    try:
        return validate_key(template.format(**arguments))
    except (KeyError, AttributeError, IndexError) as exc:
        names = ", ".join(arguments) or "none"
        raise ValueError(
            f"key template {template!r} cannot be formatted for this call of "
            f"{fn.__qualname__}: {type(exc).__name__}: {exc} (its arguments: {names})"
        ) from None


def check_key_fields(template: KeyTemplate, fn: Callable[..., Any]) -> None:
    """Raise ValueError when the "{name}" template `template` names an argument `fn` does not
    take (`@locked`, `locked_task`: at decoration, not on every call). A function's **kwargs
    too: `format_key` formats with its parameters, where the keywords they gather are under
    their parameter's name ("{kwargs[invoice_id]}", not "{invoice_id}"). A callable key is
    not looked into."""
    if callable(template):
        return
    try:
        parameters = binder_of(fn).signature.parameters
    except (TypeError, ValueError):  # a builtin or the like: format_key says so per call
        return
    try:
        fields = [each for _, each, _, _ in string.Formatter().parse(template) if each is not None]
    except ValueError as exc:
        raise ValueError(f"key template {template!r} is not a format string: {exc}") from None
    for field in fields:
        name = re.split(r"[.\[]", field, maxsplit=1)[0]
        if name not in parameters:
            raise ValueError(
                f"key template {template!r} names {{{field}}}, which {fn.__qualname__} does not "
                f"take (its parameters: {', '.join(parameters) or 'none'}); name one of them"
            )


# -- names ---------------------------------------------------------------------------------
# A key's parts that differ from lock to lock: UUIDs, long hex (digests, tokens) and runs of
# digits (primary keys, dates). Metrics and traces show `*` in their place.
_VARYING = re.compile(
    r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{12,}|[0-9]+",
    re.IGNORECASE,
)


def lock_name(key: str) -> str:
    """The name metrics and traces show for a lock taken without one: `key` with its UUIDs,
    long hex and runs of digits as `*` ("invoice:42" -> "invoice:*"), so that many keys
    make few names."""
    return _VARYING.sub("*", key)


def check_name(name: object) -> str | None:
    """`name` if it is None or a usable lock name (what metrics and traces show), else a
    ValueError or TypeError naming the argument."""
    if name is None:
        return None
    if not isinstance(name, str):
        raise TypeError(f"name must be a str (what metrics show for the lock), got {name!r}")
    if not name or len(name) > MAX_HOLDER_LENGTH:
        raise ValueError(f"name must be 1 to {MAX_HOLDER_LENGTH} characters, got {name!r:.80}")
    _check_printable("name", name)
    return name


def template_name(template: object) -> str | None:
    """The name a surface gives the locks of a key template: the template itself when it is
    a string ("invoice:<pk>", "report:{date}"); None for a callable (the key is normalised)."""
    return template if isinstance(template, str) else None


# -- holders --------------------------------------------------------------------------------
def default_holder() -> str:
    """`<hostname>:<pid>`: a forked child names itself (see `_forked`)."""
    return _holder[0]


#: `default_holder()`, made again in a forked child.
_holder = [f"{_HOSTNAME}:{os.getpid()}"]


def _forked() -> None:
    _holder[0] = f"{_HOSTNAME}:{os.getpid()}"
    _labelled.clear()


#: `LockSpec.holder_for`'s holders of a label, made and checked once per label in a process
#: (a surface labels each call with its function's name); at most LABELS_KEPT of them (a
#: label may come from outside: a request's method).
_labelled: dict[str, str] = {}
LABELS_KEPT = 256


os.register_at_fork(after_in_child=_forked)


def labelled_holder(label: str) -> str:
    """`<hostname>:<pid> <label>`, cut to what a store keeps: tells people what holds a lock.

    The label may come from outside (a request's method): control characters are escaped."""
    return printable(f"{default_holder()} {label}")[:MAX_HOLDER_LENGTH]


def validate_holder(holder: object) -> str:
    """Return `holder` if a store can keep it as given, else raise naming the argument."""
    if not isinstance(holder, str):
        raise TypeError(f"holder must be a str, got {type(holder).__name__}")
    if not holder or len(holder) > MAX_HOLDER_LENGTH:
        raise ValueError(f"holder must be 1 to {MAX_HOLDER_LENGTH} characters, got {holder!r:.80}")
    _check_printable("holder", holder)
    try:
        holder.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"holder must be encodable as UTF-8 ({exc.reason})") from None
    return holder


# -- durations ------------------------------------------------------------------------------
def ttl_seconds(ttl: object) -> float:
    """`ttl` as seconds: a duration of 1 ms to a year, else an error naming "ttl"."""
    seconds = to_seconds("ttl", ttl)
    if seconds < MIN_TTL:
        raise ValueError(
            f"ttl must be at least {MIN_TTL:g} seconds (1 ms: the finest expiry every store "
            f"keeps), got {ttl!r}"
        )
    if seconds > MAX_TTL:
        raise ValueError(f"ttl must be at most {MAX_TTL:g} seconds (a year), got {ttl!r}")
    return seconds


def mode_of(limit: object = None, shared: object = False) -> Mode:
    """The mode `limit=` and `shared=` ask for: a semaphore of `limit` permits, a shared
    (read) lock, or (neither) an exclusive lock; a bad value raises naming it."""
    if not isinstance(shared, bool):
        raise TypeError(f"shared must be True or False, got {shared!r}")
    if limit is None:
        return SHARED if shared else EXCLUSIVE
    if shared:
        raise ValueError(
            "pass limit= for a semaphore (at most N holders) or shared=True for a read lock "
            "(any number of readers, or one writer), not both"
        )
    if not isinstance(limit, int) or isinstance(limit, bool):
        raise TypeError(f"limit must be an int >= 1, got {limit!r}")
    if limit < 1:
        raise ValueError(f"limit must be >= 1 (the most holders at once), got {limit!r}")
    if limit > MAX_LIMIT:
        raise ValueError(
            f"limit must be at most 2**63 - 1 ({MAX_LIMIT}, the largest every store keeps), "
            f"got {limit!r}"
        )
    return semaphore_mode(limit)


def check_store(store: object) -> str:
    """`store` if it is an alias, else a TypeError (the alias itself is looked up later)."""
    if not isinstance(store, str):
        raise TypeError(f"store must be an alias (str), got {type(store).__name__}")
    return store


# -- the options ----------------------------------------------------------------------------
class HandleOptions(TypedDict, total=False):
    """The lock options but the mode (`limit`, `shared`): what every surface takes, each
    meaning the same everywhere. Unset, an option has the default named here.

    - `ttl`: how long the lock lives once acquired unless extended (seconds or a timedelta;
      a duration string such as "2m"); default KEEL_LOCK_DEFAULT_TTL.
    - `timeout`: how long to wait for the lock before giving up; default 0 (do not wait).
    - `retry_delay`: the pause between attempts while waiting on a store without wake-ups
      (with jitter); default 0.05 s.
    - `store`: the alias of the store in KEEL_LOCK_STORES; default "default".
    - `holder`: the label people see for the holder; default `<hostname>:<pid>` (and the
      surface's own label: the task, the request's method and URL pattern).
    - `auto_extend`: True keeps the lock alive while held (extended every ttl/3); ttl then
      only bounds how long a crashed holder blocks the key. Default False.
    - `max_hold`: with `auto_extend`, the longest the lock is kept alive in all; default None
      (no cap).
    - `on_lost`: what happens when the lock is lost while held: "raise" (the default: leaving
      the block, function, view or task raises LockNotHeldError), "warn" (log only), or a
      callable `(lock) -> None` called once when the loss is found.
    - `name`: what metrics and traces call the locks ("invoice" for "invoice:42"); default:
      a surface's key template, else the key with its digits, UUIDs and long hex as `*`.
    """

    ttl: Duration | None
    timeout: Duration
    retry_delay: Duration
    store: str
    holder: str | None
    auto_extend: bool
    max_hold: Duration | None
    on_lost: OnLost
    name: str | None


class LockOptions(HandleOptions, total=False):
    """Every lock option: `HandleOptions` and the mode. `limit=N` makes the key a semaphore
    (at most N holders at once, each with a permit of its own); `shared=True` a shared (read)
    lock (any number of shared holders, no exclusive one meanwhile; an exclusive acquirer that
    waits keeps new shared ones out). Neither: an exclusive lock. Not both.

    `lock()` takes `shared` but not `limit` and `semaphore()` `limit` but not `shared`; every
    other surface takes them all."""

    limit: int | None
    shared: bool


#: The lock options' names, in their order of declaration.
OPTION_NAMES: Final = tuple(LockOptions.__annotations__)
#: Each lock option's default, as `HandleOptions` and `LockOptions` describe it (what an
#: option left unset means; `LockViewMixin` offers them as its `lock_<option>` attributes).
OPTION_DEFAULTS: Final[Mapping[str, object]] = MappingProxyType(
    {
        "ttl": None,
        "timeout": 0,
        "retry_delay": DEFAULT_RETRY_DELAY,
        "store": "default",
        "holder": None,
        "auto_extend": False,
        "max_hold": None,
        "on_lost": RAISE,
        "name": None,
        "limit": None,
        "shared": False,
    }
)


def default_name(options: LockOptions, template: object) -> None:
    """Name the locks of a surface's key template (`template_name`) in `options`, the
    surface's own `**options`, unless they give a name."""
    if options.get("name") is None:
        options["name"] = template_name(template)


def refuse_option(surface: str, option: str, instead: str) -> TypeError:
    """The error for a lock option `surface` does not take; `instead` says what to do."""
    return TypeError(f"{surface}() got an unexpected keyword argument {option!r}: {instead}")


def _refuse_unknown(surface: str, names: Iterable[str]) -> None:
    for name in names:
        if name not in OPTION_NAMES:
            close = difflib.get_close_matches(name, OPTION_NAMES, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise refuse_option(
                surface, name, f"{hint}the lock options are {', '.join(OPTION_NAMES)}"
            )


# -- the spec -------------------------------------------------------------------------------
@dataclass(frozen=True)
class LockSpec:
    """How to take a lock, checked: durations in seconds, the store alias, the holder.

    Build one with `LockSpec.parse`; `spec.lock(key)` makes a handle. `ttl` None means
    KEEL_LOCK_DEFAULT_TTL, read each time a handle is made. The holder is checked when a
    handle is made, as `lock()` checks it; the store alias is looked up then too.
    """

    ttl: float | None = None
    timeout: float = 0.0
    retry_delay: float = DEFAULT_RETRY_DELAY
    store: str = "default"
    holder: str | None = None
    auto_extend: bool = False
    max_hold: float | None = None
    on_lost: OnLost = RAISE
    mode: Mode = EXCLUSIVE
    #: What metrics and traces call the locks (None: each key normalised, see `lock_name`).
    name: str | None = None

    @classmethod
    def parse(cls, surface: str = "LockSpec.parse", /, **options: Unpack[LockOptions]) -> LockSpec:
        """Check and convert the `LockOptions` a surface was given; a bad value raises
        naming it, an unknown option naming the `surface` too."""
        return cls.of(surface, options)

    @classmethod
    def of(cls, surface: str, options: Mapping[str, object]) -> LockSpec:
        """`parse` for the options in a dict (a surface's own `**options`, not copied again).

        A handle is often made per call with the same options (`with lock(key):`): the spec
        they give is kept (it is frozen), keyed by the options and their types, so True is
        not taken for 1 nor 0 for False."""
        if cls is not LockSpec:
            return cls._parse(surface, options)
        # The options of the last spec found of strings and None alone, the usual run of
        # `with lock(key, store="memory"):`, compared as they are: a third of the cost of
        # building the key below. (A value equal to a string is one, as below; one thread's
        # snapshot: another may replace it meanwhile.)
        last = last_plain[0]
        if options == last[0]:
            return last[1]
        try:
            given = tuple(options.items())
            # Options of strings and None alone (`store="memory"`) need not their types: no
            # other type's value is equal to a string (and hashes as it does) but a str's.
            found = _parsed_plain.get(given)
            if found is not None:
                # The options it was made of, not these: a value merely equal to a string
                # now (a lazy translation) may equal another by the next call.
                last_plain[0] = found
                return found[1]
            known = (given, tuple(map(type, options.values())))
            return _parsed[known]
        except KeyError:
            pass
        except TypeError:  # an unhashable option (a bad one, or a callable's)
            return cls._parse(surface, options)
        spec = cls._parse(surface, options)
        if len(_parsed) >= PARSED_KEPT or len(_parsed_plain) >= PARSED_KEPT:
            _parsed.clear()  # a program makes a few kinds of handle: a rare reset
            _parsed_plain.clear()
        _parsed[known] = spec
        if all(kind is str or kind is type(None) for kind in known[1]):
            _parsed_plain[given] = last_plain[0] = (dict(given), spec)
        return spec

    @classmethod
    def _parse(cls, surface: str, options: Mapping[str, object]) -> LockSpec:
        _refuse_unknown(surface, options)
        alias = check_store(options.get("store", "default"))
        auto_extend = options.get("auto_extend", False)
        if not isinstance(auto_extend, bool):
            raise TypeError(f"auto_extend must be True or False, got {auto_extend!r}")
        max_hold = options.get("max_hold")
        hold = None if max_hold is None else to_seconds("max_hold", max_hold)
        if hold is not None and not auto_extend:
            raise ValueError(
                "max_hold caps how long auto_extend keeps a lock alive; pass auto_extend=True "
                "with it, or drop max_hold"
            )
        ttl = options.get("ttl")
        retry_delay = options.get("retry_delay", DEFAULT_RETRY_DELAY)
        return cls(
            ttl=None if ttl is None else ttl_seconds(ttl),
            timeout=to_seconds("timeout", options.get("timeout", 0), allow_zero=True),
            retry_delay=to_seconds("retry_delay", retry_delay, allow_zero=True),
            store=alias,
            holder=cast("str | None", options.get("holder")),  # checked with each handle
            auto_extend=auto_extend,
            max_hold=hold,
            on_lost=check_on_lost(options.get("on_lost", RAISE)),
            mode=mode_of(options.get("limit"), options.get("shared", False)),
            name=check_name(options.get("name")),
        )

    def resolved_ttl(self) -> float:
        """The ttl in seconds: the spec's own, else KEEL_LOCK_DEFAULT_TTL as it is now (read
        and converted once each time the setting changes: reading a setting that is not set
        costs Django an exception, a microsecond a handle)."""
        if self.ttl is not None:
            return self.ttl
        if not _default_ttl:
            _default_ttl.append(ttl_seconds(conf.DEFAULT_TTL))
        return _default_ttl[0]

    def holder_for(self, label: str | None = None) -> str:
        """The holder a handle gets: the spec's, else `<hostname>:<pid>` and `label` if any."""
        if self.holder is not None:
            return validate_holder(self.holder)
        if label is None:
            return default_holder()
        holder = _labelled.get(label)
        if holder is None:
            holder = validate_holder(labelled_holder(label))
            if len(_labelled) >= LABELS_KEPT:
                _labelled.clear()
            _labelled[label] = holder
        return holder

    def lock(self, key: str, *, label: str | None = None, raises: bool = False) -> Lock:
        """A handle on `key` taken as this spec says; `label` names the caller in its holder
        when the spec has no holder of its own. `raises`: the surface raises LockUnavailable
        when the lock is not acquired (traces then mark the refusal an error)."""
        return _handles[0](key, self, label=label, raises=raises)


class HandleMaker(Protocol):
    """`Lock.from_spec`: how `LockSpec.lock` makes a handle."""

    def __call__(self, key: str, spec: LockSpec, *, label: str | None, raises: bool) -> Lock: ...


#: The one `HandleMaker`, handed in by `core` as it loads (`make_handles_with`): `core`
#: builds on this module, which therefore does not import it.
_handles: list[HandleMaker] = []


def make_handles_with(maker: HandleMaker) -> None:
    """Have `LockSpec.lock` make its handles with `maker` (`core` passes `Lock.from_spec`)."""
    _handles[:] = [maker]


#: Specs parsed, by their arguments and the arguments' types (which keep 1 and True, equal
#: and of one hash, apart); at most PARSED_KEPT of them.
_parsed: dict[tuple[tuple[Any, ...], tuple[type, ...]], LockSpec] = {}
PARSED_KEPT = 256
#: The specs of `_parsed` whose arguments are all strings or None, by the arguments alone:
#: each with those arguments (a dict of their own, of str and None only).
_parsed_plain: dict[tuple[tuple[str, Any], ...], tuple[object, LockSpec]] = {}
#: The one of `_parsed_plain` `LockSpec.of` last found (at first, an object no options are
#: equal to), in a list of one: `core.lock` looks at it first, a call less per handle.
last_plain: list[tuple[object, LockSpec]] = [(object(), LockSpec())]


#: KEEL_LOCK_DEFAULT_TTL in seconds once read; emptied whenever the setting changes.
_default_ttl: list[float] = []


@receiver(setting_changed)
def _on_setting_changed(setting: str, **kwargs: Any) -> None:
    if setting == "KEEL_LOCK_DEFAULT_TTL":
        _default_ttl.clear()
