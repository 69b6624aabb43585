"""Fencing you can enforce: a database row that refuses writes from a stale lock holder.

A lock can be lost without its holder knowing (a GC pause, a stopped VM, a partition outlasting
the ttl). The holder's `fence` tells writes apart: each acquisition of a key gets a larger one.
Store the highest fence that wrote a row next to it (`FenceField`), and write with
`fenced_update`, which lands only when the writer's fence is at least the stored one::

    class Invoice(FencedModel):
        status = models.CharField(max_length=20)

    with lock(f"invoice:{pk}") as held:
        charge()
        if not fenced_update(Invoice.objects.filter(pk=pk), fence=held.fence, status="charged"):
            ...  # a newer holder has written this row: our work is stale, undo or give up

The check and the write are one UPDATE, so no holder can slip in between.
"""

from __future__ import annotations

from typing import Any

from django.db import models


class FenceField(models.BigIntegerField):  # type: ignore[type-arg]
    """The highest lock fence that has written this row (0: none yet)."""

    description = "Highest lock fence that has written this row"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("default", 0)
        kwargs.setdefault("editable", False)
        super().__init__(*args, **kwargs)

    def deconstruct(self) -> Any:
        name, path, args, kwargs = super().deconstruct()
        if kwargs.get("default") == 0:
            del kwargs["default"]
        if kwargs.get("editable") is False:
            del kwargs["editable"]
        return name, path, args, kwargs


class FencedModel(models.Model):
    """Abstract base for rows written under a lock: adds `fence = FenceField()`."""

    fence = FenceField()

    class Meta:
        abstract = True


def fence_field_name(model: type[models.Model]) -> str:
    """The name of `model`'s one FenceField; raises TypeError when it has none or several."""
    names = [f.name for f in model._meta.get_fields() if isinstance(f, FenceField)]
    if len(names) == 1:
        return names[0]
    label = model._meta.label
    if not names:
        raise TypeError(
            f"{label} has no FenceField: add `fence = FenceField()` or subclass FencedModel"
        )
    raise TypeError(f"{label} has several FenceFields ({', '.join(names)}); pass field=")


def fenced_update(
    queryset: models.QuerySet[Any], *, fence: int, field: str | None = None, **updates: Any
) -> int:
    """Apply `updates` to the rows of `queryset` whose stored fence is <= `fence`, and record
    `fence` in them, in one UPDATE. The number of rows written; rows left out are refused.

    `fence` is the holder's `Lock.fence`; `field` names the FenceField when the model has
    several. A count lower than expected means a newer holder has written those rows.
    """
    if isinstance(fence, bool) or not isinstance(fence, int):
        hint = (
            " (is the lock held? a handle has a fence only while it holds)" if fence is None else ""
        )
        raise TypeError(f"fence must be an int, the holder's Lock.fence, got {fence!r}{hint}")
    if fence < 0:
        raise ValueError(f"fence must be >= 0, got {fence}")
    name = fence_field_name(queryset.model) if field is None else field
    if field is not None:
        found = queryset.model._meta.get_field(field)
        if not isinstance(found, FenceField):
            raise TypeError(f"field {field!r} of {queryset.model._meta.label} is not a FenceField")
    if name in updates:
        raise ValueError(f"do not set {name!r} yourself: fenced_update records the fence")
    return queryset.filter(**{f"{name}__lte": fence}).update(**{name: fence}, **updates)
