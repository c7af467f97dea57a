"""Black, mirror: a small client of the RabbitMQ management HTTP API (exchange discovery)."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import requests

from bridge.errors import ManagementApiError
from bridge.protocol.exchange import ExchangeDecl

__all__ = ["ManagementClient", "QueueBinding", "ENABLE_HINT"]

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


class ManagementClient:
    """Read-only access to what black needs from the management API.

    Every failure is a :class:`ManagementApiError` naming the URL (never the password) and
    how to fix it; it is retryable (the API may be restarting).
    """

    def __init__(self, base_url: str, user: str, password: str, *, timeout: float = 10) -> None:
        self.base_url = base_url.rstrip("/")
        self._auth = (user, password)
        self._user = user
        self.timeout = timeout
        self._session = requests.Session()

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
        not_found: str = "",
        method: str = "GET",
        body: Any = None,
    ) -> Any:
        url = f"{self.base_url}{path}"
        try:
            r = self._session.request(
                method, url, auth=self._auth, timeout=self.timeout, params=params, json=body
            )
        except requests.RequestException as e:
            raise ManagementApiError(
                f"management API unreachable at {url} ({type(e).__name__}) while {what}: "
                f"{ENABLE_HINT}"
            ) from None
        if r.status_code == 401:
            raise ManagementApiError(
                f"management API {url} refused user {self._user!r} (401) while {what}: check "
                "black.management_user / black.management_password; the user needs the "
                "'monitoring' or 'management' tag"
            )
        if r.status_code == 404:
            hint = f": {not_found}" if not_found else ""
            raise ManagementApiError(f"management API {url}: not found (404) while {what}{hint}")
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
        q = urllib.parse.quote(vhost, safe="")
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
        q = urllib.parse.quote(vhost, safe="")
        try:
            info = self._call(f"/api/vhosts/{q}", what=f"reading vhost {vhost!r}")
        except ManagementApiError as e:
            if "(404)" in str(e):
                return None
            raise
        tags = info.get("tags") if isinstance(info, dict) else None
        if isinstance(tags, str):  # older brokers: one comma-separated string
            tags = tags.split(",")
        return [str(t).strip() for t in tags if str(t).strip()] if isinstance(tags, list) else []

    def delete_vhost(self, vhost: str) -> None:
        """Delete ``vhost`` and everything in it; a missing vhost is fine."""
        q = urllib.parse.quote(vhost, safe="")
        try:
            self._call(f"/api/vhosts/{q}", what=f"deleting vhost {vhost!r}", method="DELETE")
        except ManagementApiError as e:
            if "(404)" not in str(e):
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
            f"/api/exchanges/{_q(vhost)}",
            what=f"listing exchanges of vhost {vhost!r}",
            params={"columns": "name,type,durable,auto_delete,internal,arguments"},
            not_found=f"vhost {vhost!r} does not exist; check the vhost at the end of "
            "black.amqp_url (URL-encoded: '/' is %2F)",
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
            f"/api/queues/{_q(vhost)}/{_q(queue)}",
            what=f"reading queue {queue!r} in vhost {vhost!r}",
            not_found="the queue or vhost does not exist",
        )
        if not isinstance(doc, dict):
            raise ManagementApiError(
                f"management API {self.base_url}: queue {queue!r} is not an object"
            )
        return doc

    def list_queue_bindings(self, vhost: str, queue: str) -> list[QueueBinding]:
        """Bindings of ``queue`` (the implicit default-exchange binding included)."""
        rows = self._call(
            f"/api/queues/{_q(vhost)}/{_q(queue)}/bindings",
            what=f"listing bindings of queue {queue!r} in vhost {vhost!r}",
            not_found="the queue or vhost does not exist",
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
