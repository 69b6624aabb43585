"""The HTTP side of idempotent requests: the key a request names, its fingerprint, and
responses kept and replayed byte for byte."""

from __future__ import annotations

import hashlib
import json
import string
from collections.abc import Callable, Mapping
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.utils.http import parse_header_parameters

from ..views import wants_json

#: The longest key a client may send (keys beside it: "idempotent:user:<pk>:" fit in 255).
MAX_KEY_LENGTH = 200
#: The header a replayed response carries.
REPLAYED_HEADER = "Idempotent-Replayed"
#: The response headers kept with a response and replayed: what describes its body and where
#: it points. Never Set-Cookie (a session of the first request's) nor hop-by-hop headers.
#: Content-Encoding goes with bytes kept encoded (the middleware outside GZipMiddleware).
SAFE_HEADERS = frozenset(
    {
        "cache-control",
        "content-disposition",
        "content-encoding",
        "content-language",
        "content-type",
        "etag",
        "expires",
        "last-modified",
        "link",
        "location",
        "vary",
    }
)

KeySource = str | Callable[..., "str | None"]


class BadKey(ValueError):
    """A request's idempotency key that cannot be used: answered with 400 and this text."""


def check_client_key(key: str, what: str) -> str:
    """`key` if it is 1 to MAX_KEY_LENGTH printable ASCII characters, else BadKey."""
    if not key:
        raise BadKey(f"{what} is empty")
    if len(key) > MAX_KEY_LENGTH:
        raise BadKey(f"{what} is {len(key)} characters long; at most {MAX_KEY_LENGTH}")
    for index, char in enumerate(key):
        if not " " <= char <= "~":
            raise BadKey(f"{what} must be printable ASCII; found {char!r} at index {index}")
    return key


def check_template(template: str) -> list[str]:
    """The {field}s of a key template ("stripe:{event_id}", "{data.object.id}"); a template
    that is not one raises ValueError naming it."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"idempotency key template {template!r}: {exc}") from None
    fields = [field for _, field, spec, conv in parsed if field is not None]
    for _, field, spec, conv in parsed:
        if field is not None and (not field or spec or conv):
            raise ValueError(
                f"idempotency key template {template!r}: write {{name}} or {{a.b}} (a URL "
                f"kwarg or a field of the JSON or form body), without format specs"
            )
    return fields


def render_template(template: str, request: HttpRequest, url_kwargs: Mapping[str, Any]) -> str:
    """The key `template` names for `request`: each {field} from the URL kwargs, else the
    request's JSON body (dotted: {data.object.id}), else its form body; BadKey if absent."""
    body: Any = None
    out = []
    for literal, field, _, _ in string.Formatter().parse(template):
        out.append(literal)
        if field is None:
            continue
        if field in url_kwargs:
            out.append(str(url_kwargs[field]))
            continue
        if body is None:
            body = _body_fields(request)
        value = _dig(body, field.split("."))
        if value is None or isinstance(value, (dict, list)):
            raise BadKey(f"this request has no {{{field}}} for its idempotency key {template!r}")
        out.append(str(value))
    return "".join(out)


def _media_type(request: HttpRequest) -> tuple[str, dict[str, str]]:
    """The body's media type (lower case) and its parameters, from the header itself: DRF's
    request.content_type is the whole header ("application/json; charset=utf-8")."""
    media_type, params = parse_header_parameters(request.META.get("CONTENT_TYPE", ""))
    return media_type.lower(), params


def _body_fields(request: HttpRequest) -> Any:
    content_type, _ = _media_type(request)
    if content_type == "application/json" or content_type.endswith("+json"):
        try:
            return json.loads(request.body or b"null")
        except ValueError:
            raise BadKey("the request body is not JSON") from None
    return request.POST


def _dig(value: Any, path: list[str]) -> Any:
    for part in path:
        if isinstance(value, Mapping) or hasattr(value, "getlist"):
            value = value.get(part)
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


def fingerprint(request: HttpRequest) -> str:
    """What a retry must repeat: sha256 over the method, the full path, the body's media type
    and charset (they decide what the view reads of it) and the body's digest."""
    media_type, params = _media_type(request)
    charset = params.get("charset", "").lower()
    if media_type == "multipart/form-data":
        body = _form_digest(request)
    else:
        body = hashlib.sha256(request.body).hexdigest()
    text = f"{request.method}\0{request.get_full_path()}\0{media_type}\0{charset}\0{body}"
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def _form_digest(request: HttpRequest) -> str:
    """A multipart body's digest, over its fields and files as parsed: the raw body holds a
    boundary each send picks anew, it may be read already (CsrfViewMiddleware reads
    request.POST, which consumes it), and a file is not held to DATA_UPLOAD_MAX_MEMORY_SIZE."""
    digest = hashlib.sha256()
    for name, values in request.POST.lists():
        digest.update(json.dumps(["field", name, values]).encode() + b"\n")
    for name, uploads in request.FILES.lists():
        for upload in uploads:
            about = ["file", name, upload.name, upload.content_type, upload.size]
            digest.update(json.dumps(about).encode() + b"\n")
            for chunk in upload.chunks():  # from its start
                digest.update(chunk)
            upload.seek(0)  # the view reads it from its start too
    return digest.hexdigest()


def dump_response(response: HttpResponse) -> bytes:
    """`response` as bytes: a JSON line of its status and safe headers, then its body."""
    headers = [[name, value] for name, value in response.items() if name.lower() in SAFE_HEADERS]
    head = {"status": response.status_code, "reason": response.reason_phrase, "headers": headers}
    return json.dumps(head, separators=(",", ":")).encode() + b"\n" + response.content


def load_response(data: bytes) -> HttpResponse:
    """The response `dump_response` kept, with `Idempotent-Replayed: true`."""
    head, _, body = data.partition(b"\n")
    meta = json.loads(head)
    response = HttpResponse(body, status=meta["status"], reason=meta.get("reason"))
    del response["Content-Type"]
    for name, value in meta["headers"]:
        response[name] = value
    response[REPLAYED_HEADER] = "true"
    return response


def problem(request: HttpRequest, status: int, detail: str) -> HttpResponse:
    """An error answer about the idempotency key: JSON when the client asks for it."""
    response: HttpResponse
    if wants_json(request):
        body = json.dumps({"detail": detail}).encode()
        response = HttpResponse(body, status=status, content_type="application/json")
    else:
        response = HttpResponse(
            f"{status} {detail}\n".encode(), status=status, content_type="text/plain; charset=utf-8"
        )
    return response
