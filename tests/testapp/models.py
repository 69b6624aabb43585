"""Models the tests write to: rows guarded by lock fences."""

from __future__ import annotations

from django.db import models

from django_keel_lock.fencing import FencedModel, FenceField


class Invoice(FencedModel):
    """A row written only by the current holder of its lock (`fence` from FencedModel)."""

    status = models.CharField(max_length=20, default="new")
    writes = models.IntegerField(default=0)

    def __str__(self) -> str:
        return f"invoice {self.pk} ({self.status}, fence {self.fence})"


class Document(models.Model):
    """A FenceField under another name, next to an ordinary integer."""

    body = models.TextField(default="")
    version = models.IntegerField(default=0)
    writer_fence = FenceField()

    def __str__(self) -> str:
        return f"document {self.pk} v{self.version}"
