"""Migration operations of our own. The leading underscore keeps Django's migration loader from
taking this module for a migration; it is imported by path, so squashed migrations can name it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from django.db import router
from django.db.migrations.operations.base import Operation


class VendorSQL(Operation):
    """SQL that differs per database vendor, run through the schema editor.

    RunSQL runs the same SQL everywhere, and RunPython cannot be printed: `sqlmigrate` shows
    "THIS OPERATION CANNOT BE WRITTEN AS SQL" for it, so a DBA applying that output by hand
    would miss it. Here `schema_editor.execute` either runs each statement or, under
    `sqlmigrate`, collects it. A vendor missing from `forwards` / `backwards` runs nothing.
    """

    reduces_to_sql = True
    reversible = True

    def __init__(
        self,
        forwards: Mapping[str, Sequence[str]],
        backwards: Mapping[str, Sequence[str]] | None = None,
        description: str = "Vendor-specific SQL",
    ) -> None:
        self.forwards = {vendor: list(sql) for vendor, sql in forwards.items()}
        self.backwards = {vendor: list(sql) for vendor, sql in (backwards or {}).items()}
        self.description = description

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        kwargs: dict[str, Any] = {"forwards": self.forwards, "description": self.description}
        if self.backwards:
            kwargs["backwards"] = self.backwards
        return (self.__class__.__qualname__, [], kwargs)

    def state_forwards(self, app_label: str, state: Any) -> None:
        pass  # the schema only: models and fields are the other operations' business

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        self._run(self.forwards, app_label, schema_editor)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        self._run(self.backwards, app_label, schema_editor)

    def describe(self) -> str:
        return self.description

    @staticmethod
    def _run(sql: Mapping[str, Sequence[str]], app_label: str, schema_editor: Any) -> None:
        connection = schema_editor.connection
        # As RunPython and RunSQL do: a router that keeps this app off a database keeps this
        # off it too (there is no lock table there to alter or index).
        if not router.allow_migrate(connection.alias, app_label):
            return
        for statement in sql.get(connection.vendor, ()):
            schema_editor.execute(statement, params=None)
