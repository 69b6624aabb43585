from __future__ import annotations

from django.urls import path

from . import views

urlpatterns = [
    path("", views.index, name="index"),
    path("invoices/<int:pk>/charge/", views.charge, name="charge"),
    path("invoices/<int:pk>/charge-later/", views.charge_later, name="charge-later"),
    path("exports/invoices.csv", views.export, name="export"),
]
