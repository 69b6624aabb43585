"""The etcd store's settings check for TLS files beside http:// endpoints (E013): the store
would send those calls in clear text, certificate unchecked, while the settings say TLS."""

from __future__ import annotations

from pathlib import Path

from django_keel_lock.stores import EtcdLockStore


def test_tls_files_with_an_http_endpoint_are_check_e013_naming_it(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("not read by the check\n")
    endpoints = ["https://10.0.0.1:2379", "http://10.0.0.2:2379"]
    options = {"ENDPOINTS": endpoints, "CA_FILE": str(ca)}
    (message,) = EtcdLockStore.check_config("locks", options)
    assert message.id == "django_keel_lock.E013"
    assert "CA_FILE" in message.msg and "'http://10.0.0.2:2379'" in message.msg
    assert "https://10.0.0.1" not in message.msg
    options["ENDPOINTS"] = endpoints[:1]  # every member on https: nothing to say
    assert EtcdLockStore.check_config("locks", options) == []
