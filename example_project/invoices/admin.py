"""Invoices in the admin; the locks appear there too (django_keel_lock registers its own)."""

from __future__ import annotations

from django.contrib import admin

from .models import Charge, Invoice


class ChargeInline(admin.TabularInline):
    model = Charge
    extra = 0
    readonly_fields = ("amount", "charged_by", "fence", "created_at")
    can_delete = False


@admin.register(Invoice)
class InvoiceAdmin(admin.ModelAdmin):
    list_display = ("number", "customer", "amount", "last_fence", "created_at")
    inlines = (ChargeInline,)


@admin.register(Charge)
class ChargeAdmin(admin.ModelAdmin):
    list_display = ("invoice", "amount", "charged_by", "fence", "created_at")
    list_filter = ("charged_by",)
