"""System checks for KEEL_LOCK_STORES (ids django_keel_lock.E001... / W001...)."""

from __future__ import annotations
