"""The key templates of a surface that names its keys from a call's arguments (`@locked`,
`locked_task`, Django's Tasks): one template for a lock of one key, or a list or tuple of
templates for a lock of several keys at once (`multi.MultiLock`), each rendered as one key
is (`options.format_key`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .core import Lock
from .multi import MultiLock
from .options import (
    KeyTemplate,
    LockOptions,
    LockSpec,
    check_key_fields,
    check_key_template,
    default_name,
    format_key,
    template_name,
)

__all__ = [
    "KeyTemplates",
    "check_each",
    "check_fields",
    "check_templates",
    "format_keys",
    "handle_for",
    "name_templates",
]

#: One key template, or a list or tuple of them (the keys of one multi-key lock).
KeyTemplates = KeyTemplate | list[KeyTemplate] | tuple[KeyTemplate, ...]


def check_templates(templates: object) -> None:
    """Raise unless `templates` is a key template or a non-empty list or tuple of them,
    naming the bad one."""
    check_each(templates, check_key_template)


def check_each(templates: object, check: Callable[[object], None], name: str = "key") -> None:
    """`check` on `templates`, or on each of a non-empty list or tuple of them: a TypeError
    names the bad one as `name[index]`, an empty list is a ValueError."""
    if not isinstance(templates, list | tuple):
        check(templates)
        return
    if not templates:
        raise ValueError(
            f"{name} must name at least one key template, got an empty {type(templates).__name__}"
        )
    for index, template in enumerate(templates):
        try:
            check(template)
        except TypeError as error:
            raise TypeError(f"{name}[{index}]: {error}") from None


def check_fields(templates: KeyTemplates, fn: Callable[..., Any]) -> None:
    """`options.check_key_fields` for each template."""
    for template in templates if isinstance(templates, list | tuple) else [templates]:
        check_key_fields(template, fn)


def name_templates(options: LockOptions, templates: KeyTemplates) -> None:
    """`options.default_name` for one template or several ("a:{x}+b:{y}": the templates
    joined as a multi-key lock joins its keys; none when one of them is a callable)."""
    if not isinstance(templates, list | tuple):
        default_name(options, templates)
        return
    names = [template_name(template) for template in templates]
    if options.get("name") is None and all(names):
        options["name"] = "+".join(sorted(set(names)))  # type: ignore[arg-type]


def format_keys(
    templates: KeyTemplates, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | list[str]:
    """The key (one template) or keys (several) for one call of `fn`."""
    if isinstance(templates, list | tuple):
        return [format_key(template, fn, args, kwargs) for template in templates]
    return format_key(templates, fn, args, kwargs)


def handle_for(
    spec: LockSpec, keys: str | Sequence[str], *, label: str | None, raises: bool
) -> Lock:
    """The handle on `keys` taken as `spec` says: a `MultiLock` for a list of keys."""
    if isinstance(keys, str):
        return spec.lock(keys, label=label, raises=raises)
    return MultiLock.from_spec(keys, spec, label=label, raises=raises)
