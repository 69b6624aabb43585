"""Invoices and the charges made against them (what the payment provider would record)."""

from __future__ import annotations

from django.db import models


class Invoice(models.Model):
    customer = models.CharField(max_length=100)
    amount = models.DecimalField(max_digits=10, decimal_places=2)
    created_at = models.DateTimeField(auto_now_add=True)
    # The provider's side of fencing: the highest lock fence that charged this invoice. A charge
    # carrying an older fence comes from a holder whose lock expired and was taken over.
    last_fence = models.BigIntegerField(default=0)

    class Meta:
        ordering = ("pk",)

    def __str__(self) -> str:
        return self.number

    @property
    def number(self) -> str:
        return f"INV-{self.pk:04d}"


class Charge(models.Model):
    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE, related_name="charges")
    amount = models.DecimalField(max_digits=10, decimal_places=2)
    charged_by = models.CharField(max_length=255)
    fence = models.BigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ("pk",)

    def __str__(self) -> str:
        return f"{self.amount} on {self.invoice} by {self.charged_by}"
