"""The SQL of each database the store supports, one module per vendor: adding a vendor is a
module here and its entry below. The vendors supported are exactly these."""

from __future__ import annotations

from .base import Dialect
from .mysql import MySQLDialect
from .postgresql import PostgresDialect
from .schema import SEQUENCE, TABLE
from .sqlite import SQLiteDialect

DIALECTS: dict[str, type[Dialect]] = {
    dialect.vendor: dialect for dialect in (PostgresDialect, MySQLDialect, SQLiteDialect)
}

__all__ = [
    "DIALECTS",
    "SEQUENCE",
    "TABLE",
    "Dialect",
    "MySQLDialect",
    "PostgresDialect",
    "SQLiteDialect",
]
