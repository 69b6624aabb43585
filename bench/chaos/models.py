"""The fenced resource: one row per key, written only through `fenced_update`."""

from __future__ import annotations

from django.db import models

from django_keel_lock.fencing import FencedModel

#: The resource and its audit log, created in the run's own database (the app has no
#: migrations).
#: The trigger appends each accepted UPDATE to the audit under the row's lock, so the audit's
#: ids of one key are the order in which PostgreSQL accepted its writes.
SCHEMA = """
CREATE TABLE keel_chaos_resource (
    key varchar(200) PRIMARY KEY, fence bigint NOT NULL DEFAULT 0,
    value bigint NOT NULL DEFAULT 0, writer varchar(100) NOT NULL DEFAULT '',
    step varchar(10) NOT NULL DEFAULT '');
CREATE TABLE keel_chaos_audit (
    id bigserial PRIMARY KEY, key varchar(200) NOT NULL, fence bigint NOT NULL,
    value bigint NOT NULL, writer varchar(100) NOT NULL, step varchar(10) NOT NULL);
CREATE INDEX keel_chaos_audit_key ON keel_chaos_audit (key);
CREATE FUNCTION keel_chaos_audit_row() RETURNS trigger AS $$
BEGIN
    INSERT INTO keel_chaos_audit (key, fence, value, writer, step)
    VALUES (NEW.key, NEW.fence, NEW.value, NEW.writer, NEW.step);
    RETURN NEW;
END $$ LANGUAGE plpgsql;
CREATE TRIGGER keel_chaos_audit_trigger AFTER UPDATE ON keel_chaos_resource
    FOR EACH ROW EXECUTE FUNCTION keel_chaos_audit_row();
"""


class Resource(FencedModel):
    """What the holders of one key write: `value` is read, then written back plus one."""

    key = models.CharField(max_length=200, primary_key=True)
    value = models.BigIntegerField(default=0)
    writer = models.CharField(max_length=100, default="")
    step = models.CharField(max_length=10, default="")

    class Meta:
        app_label = "chaos"
        db_table = "keel_chaos_resource"
        managed = False
