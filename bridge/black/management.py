"""Black, mirror: a small client of the RabbitMQ management HTTP API (exchange discovery).

A 401 or 403 is :class:`ManagementRefused`, a ConfigError (exit 2: retrying with the same
user and password cannot help) that is also a :class:`ManagementApiError`, so callers that
fall back without the API (``discover = false``) or retry a running loop still do. A 404 is
told apart: ``black.management_url`` is not the management API (its
``/api/overview`` is not found either), the vhost does not exist, or only the object asked
for (a queue) does not. An ``https://`` API whose certificate a private CA signed is
verified against ``black.management_ca_file``.
"""

from __future__ import annotations

import ssl
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import requests

from bridge.config import BlackConfig
from bridge.errors import ConfigError, ManagementApiError
from bridge.protocol.exchange import ExchangeDecl

__all__ = ["ManagementClient", "ManagementRefused", "QueueBinding", "ENABLE_HINT"]

ENABLE_HINT = (
    "is the management plugin enabled and reachable? enable it: "
    "rabbitmq-plugins enable rabbitmq_management (and check black.management_url)"
)


@dataclass(frozen=True)
class QueueBinding:
    """One binding of a queue, as the management API lists it."""

    source: str
    routing_key: str
    arguments: dict[str, Any] = field(default_factory=dict)


def _q(part: str) -> str:
    return urllib.parse.quote(part, safe="")


def _vh(vhost: str) -> str:
    """``vhost`` quoted for a path; an empty one is refused (``/api/exchanges/`` would list
    the exchanges of every vhost)."""
    if not vhost:
        raise ConfigError(
            "vhost '' (empty) asked of the management API: the vhost of black.amqp_url is "
            "the part after host:port/ (URL-encoded: the default vhost '/' is %2F)"
        )
    return _q(vhost)


Missing = Literal["api", "vhost", "object"]

CREDENTIALS_HINT = (
    "check black.management_user / black.management_password (config file or "
    "DIODE__BLACK__MANAGEMENT_PASSWORD)"
)
"""Where the management login comes from: the environment overrides the file."""


class ManagementRefused(ManagementApiError, ConfigError):
    """The management API refused the user (401: login, 403: not allowed): the operator must
    fix the user, its password or its tags."""

    retryable = False


class _NotFound(ManagementApiError):
    """A 404; ``missing``: the management API itself (a wrong management_url), the vhost, or
    the object asked for."""

    def __init__(self, message: str, missing: Missing) -> None:
        super().__init__(message)
        self.missing = missing


def _reason(r: requests.Response) -> str:
    """The management API's own reason for an error answer (``{"reason": ...}``), or ""."""
    try:
        doc = r.json()
    except ValueError:
        return ""
    reason = doc.get("reason") if isinstance(doc, dict) else None
    return str(reason)[:200] if reason else ""


def _ssl_reason(e: BaseException) -> str:
    """The innermost ``ssl.SSLError``'s reason in an exception chain (requests wraps it in
    urllib3's errors), e.g. ``CERTIFICATE_VERIFY_FAILED: self-signed certificate``."""
    todo, seen = [e], set()
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, ssl.SSLError):
            detail = getattr(x, "verify_message", None) or x.strerror
            return ": ".join(str(p) for p in (x.reason, detail) if p) or str(x)
        inner = [*x.args, getattr(x, "reason", None), x.__cause__, x.__context__]
        todo += [a for a in inner if isinstance(a, BaseException)]
    return str(e)


class ManagementClient:
    """Read-only access to what black needs from the management API.

    Every failure is a :class:`ManagementApiError` naming the URL (never the password) and
    how to fix it; it is retryable (the API may be restarting).
    """

    def __init__(
        self,
        base_url: str,
        user: str,
        password: str,
        *,
        timeout: float = 10,
        ca_file: Path | None = None,
    ) -> None:
        """``ca_file``: PEM CA bundle an ``https://`` API's certificate is verified against
        (None: the system's CAs)."""
        self.base_url = base_url.rstrip("/")
        self._auth = (user, password)
        self._user = user
        self.timeout = timeout
        self.ca_file = ca_file
        # per request: a session's own verify loses to REQUESTS_CA_BUNDLE (requests #3829)
        self._verify: str | bool = str(ca_file) if ca_file is not None else True
        self._session = requests.Session()

    @classmethod
    def from_config(cls, black: BlackConfig, *, timeout: float = 10) -> ManagementClient:
        """The client of ``black.management_*`` (URL, user, password, CA file)."""
        return cls(
            black.management_url,
            black.management_user,
            black.management_password.get_secret_value(),
            timeout=timeout,
            ca_file=black.management_ca_file,
        )

    def __repr__(self) -> str:
        return f"ManagementClient({self.base_url!r}, user={self._user!r})"

    def close(self) -> None:
        self._session.close()

    def _call(
        self,
        path: str,
        *,
        what: str,
        params: dict[str, str] | None = None,
        vhost: str | None = None,
        thing: str = "",
        method: str = "GET",
        body: Any = None,
    ) -> Any:
        """One request; ``vhost`` and ``thing`` (what ``path`` names, e.g. "queue 'q'") say
        what a 404 may be missing."""
        url = f"{self.base_url}{path}"
        try:
            r = self._session.request(
                method,
                url,
                auth=self._auth,
                timeout=self.timeout,
                params=params,
                json=body,
                verify=self._verify,
            )
        except requests.exceptions.SSLError as e:
            raise ManagementApiError(
                f"management API at {url}: TLS failed ({_ssl_reason(e)}) while {what}: "
                f"{self._tls_hint()}"
            ) from None
        except requests.RequestException as e:
            raise ManagementApiError(
                f"management API unreachable at {url} ({type(e).__name__}) while {what}: "
                f"{ENABLE_HINT}"
            ) from None
        if r.status_code in (401, 403):
            raise self._refused(url, what, r)
        if r.status_code == 404:
            raise self._not_found(url, what, vhost, thing)
        if r.status_code >= 400:
            body = r.text[:200].replace("\n", " ")
            raise ManagementApiError(
                f"management API {url} answered HTTP {r.status_code} while {what}: {body}"
            )
        if method != "GET":
            return None
        try:
            return r.json()
        except ValueError:
            raise ManagementApiError(
                f"management API {url} did not answer JSON while {what}: is black.management_url "
                f"the management plugin (usually http://host:15672)? {ENABLE_HINT}"
            ) from None

    def _refused(self, url: str, what: str, r: requests.Response) -> ManagementRefused:
        """401 or 403 (RabbitMQ answers 401 for a wrong login, a user without a management
        tag and a vhost the user may not access alike; its reason tells them apart): a
        ConfigError naming the keys, the environment override and the broker's reason."""
        reason = _reason(r)
        said = f": {reason!r}" if reason else ""
        head = (
            f"management API {url} refused user {self._user!r} ({r.status_code}{said}) while {what}"
        )
        if "virtual host" in reason:
            fix = (
                "grant that user permissions on the vhost (rabbitmqctl set_permissions), or "
                f"{CREDENTIALS_HINT}"
            )
        elif "administrator" in reason:
            fix = f"this needs a user with the 'administrator' tag: {CREDENTIALS_HINT}"
        else:
            fix = (
                f"{CREDENTIALS_HINT}; the user needs the 'monitoring' or 'management' tag "
                "(rabbitmqctl set_user_tags)"
            )
        return ManagementRefused(f"{head}: {fix}; retrying cannot help")

    def _tls_hint(self) -> str:
        if self.ca_file is None:
            return (
                "if its certificate is signed by a private CA, set black.management_ca_file to "
                "that CA's PEM bundle (and check that the host name in black.management_url is "
                "one the certificate names)"
            )
        return (
            f"check that black.management_ca_file ({self.ca_file}) holds the CA that signed "
            "the API's certificate, and that the host name in black.management_url is one the "
            "certificate names"
        )

    def _status(self, path: str) -> int | None:
        """The HTTP status of ``GET path`` (None: no answer); a 200 that is not JSON counts
        as a 404 (another web server)."""
        try:
            r = self._session.get(
                f"{self.base_url}{path}", auth=self._auth, timeout=self.timeout, verify=self._verify
            )
        except requests.RequestException:
            return None
        if r.status_code == 200:
            try:
                r.json()
            except ValueError:
                return 404
        return r.status_code

    def _not_found(self, url: str, what: str, vhost: str | None, thing: str) -> _NotFound:
        """Why ``url`` answered 404: the API (its overview is not found either), the vhost
        (``/api/vhosts/<vhost>`` is not), or else only ``thing``."""
        head = f"management API {url}: not found (404) while {what}"
        if self._status("/api/overview") == 404:
            return _NotFound(
                f"{head}: black.management_url {self.base_url!r} is not the management API "
                f"({self.base_url}/api/overview is not found either); it is usually "
                f"http://host:15672, with no path. {ENABLE_HINT}",
                "api",
            )
        if vhost is not None and self._status(f"/api/vhosts/{_q(vhost)}") == 404:
            return _NotFound(
                f"{head}: vhost {vhost!r} does not exist; check the vhost at the end of "
                "black.amqp_url (URL-encoded: '/' is %2F)",
                "vhost",
            )
        where = f" in vhost {vhost!r}" if vhost is not None else ""
        detail = f": {thing} does not exist{where}" if thing else ""
        return _NotFound(head + detail, "object")

    def put_vhost(
        self,
        vhost: str,
        *,
        user: str | None = None,
        description: str | None = None,
        tags: str | None = None,
    ) -> None:
        """Create ``vhost`` (idempotent; with ``description`` and comma-separated ``tags`` if
        given) and give ``user`` (default: ours) full permissions."""
        q = _vh(vhost)
        body = {k: v for k, v in (("description", description), ("tags", tags)) if v is not None}
        self._call(
            f"/api/vhosts/{q}", what=f"creating vhost {vhost!r}", method="PUT", body=body or None
        )
        perms = {"configure": ".*", "write": ".*", "read": ".*"}
        who = urllib.parse.quote(user or self._user, safe="")
        self._call(
            f"/api/permissions/{q}/{who}", what=f"granting {vhost!r}", method="PUT", body=perms
        )

    def vhost_tags(self, vhost: str) -> list[str] | None:
        """The tags of ``vhost`` (``[]`` for none); None if there is no such vhost."""
        try:
            info = self._call(
                f"/api/vhosts/{_vh(vhost)}", what=f"reading vhost {vhost!r}", vhost=vhost
            )
        except _NotFound as e:
            if e.missing == "vhost":
                return None
            raise
        tags = info.get("tags") if isinstance(info, dict) else None
        if isinstance(tags, str):  # older brokers: one comma-separated string
            tags = tags.split(",")
        return [str(t).strip() for t in tags if str(t).strip()] if isinstance(tags, list) else []

    def delete_vhost(self, vhost: str) -> None:
        """Delete ``vhost`` and everything in it; a missing vhost is fine."""
        try:
            self._call(
                f"/api/vhosts/{_vh(vhost)}",
                what=f"deleting vhost {vhost!r}",
                vhost=vhost,
                method="DELETE",
            )
        except _NotFound as e:
            if e.missing != "vhost":
                raise

    def overview(self) -> dict[str, Any]:
        """``GET /api/overview``: broker version, cluster name, listeners."""
        data = self._call("/api/overview", what="reading the overview")
        if not isinstance(data, dict):
            raise ManagementApiError(f"management API {self.base_url}/api/overview: not an object")
        return data

    def list_exchanges(self, vhost: str) -> list[ExchangeDecl]:
        """Every exchange of ``vhost`` (including the default ``""`` and ``amq.*``), by name."""
        rows = self._call(
            f"/api/exchanges/{_vh(vhost)}",
            what=f"listing exchanges of vhost {vhost!r}",
            params={"columns": "name,type,durable,auto_delete,internal,arguments"},
            vhost=vhost,
        )
        if not isinstance(rows, list):
            raise ManagementApiError(
                f"management API {self.base_url}: exchange list of vhost {vhost!r} is not a list"
            )
        out = [
            ExchangeDecl(
                name=str(r.get("name", "")),
                type=str(r.get("type", "")),
                durable=bool(r.get("durable", True)),
                auto_delete=bool(r.get("auto_delete", False)),
                internal=bool(r.get("internal", False)),
                arguments=dict(r.get("arguments") or {}),
            )
            for r in rows
        ]
        return sorted(out, key=lambda d: d.name)

    def queue_info(self, vhost: str, queue: str) -> dict[str, Any]:
        """The management API's view of ``queue`` (policy, effective policy definition...)."""
        doc = self._call(
            f"/api/queues/{_vh(vhost)}/{_q(queue)}",
            what=f"reading queue {queue!r} in vhost {vhost!r}",
            vhost=vhost,
            thing=f"queue {queue!r}",
        )
        if not isinstance(doc, dict):
            raise ManagementApiError(
                f"management API {self.base_url}: queue {queue!r} is not an object"
            )
        return doc

    def list_queue_bindings(self, vhost: str, queue: str) -> list[QueueBinding]:
        """Bindings of ``queue`` (the implicit default-exchange binding included)."""
        rows = self._call(
            f"/api/queues/{_vh(vhost)}/{_q(queue)}/bindings",
            what=f"listing bindings of queue {queue!r} in vhost {vhost!r}",
            vhost=vhost,
            thing=f"queue {queue!r}",
        )
        if not isinstance(rows, list):
            raise ManagementApiError(
                f"management API {self.base_url}: bindings of {queue!r} is not a list"
            )
        return [
            QueueBinding(
                source=str(r.get("source", "")),
                routing_key=str(r.get("routing_key", "")),
                arguments=dict(r.get("arguments") or {}),
            )
            for r in rows
        ]
