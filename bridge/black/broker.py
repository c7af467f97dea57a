"""Black, broker: one fail-fast AMQP connection to the black RabbitMQ, errors without secrets."""

from __future__ import annotations

import urllib.parse

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingConnection

from bridge.amqp.client import AmqpParams, parse_url
from bridge.config import BlackConfig
from bridge.errors import BrokerError, ConfigError, DiodeError

__all__ = [
    "broker_refused",
    "check_amqp_url",
    "connect",
    "connect_url",
    "connection_parameters",
    "describe_broker",
    "tap_vhost",
]


def check_amqp_url(url: str, key: str = "black.amqp_url") -> AmqpParams:
    """``url`` read by the parser the tap (``bridge.amqp``) connects with, so that what
    ``diode check`` and the mirror accept the tap accepts too; ConfigError naming ``key``."""
    try:
        return parse_url(url)
    except ConfigError as e:
        raise ConfigError(f"{key}: {e}") from None


def tap_vhost(url: str) -> str:
    """The vhost of ``url`` as the tap reads it (:func:`bridge.amqp.client.parse_url`): pika's
    own reading differs (``amqp://host//`` is ``''`` for pika, ``'/'`` for the tap; ``/a/b`` is
    ``'a'`` for pika). Query and fragment (pika options) and an ``amqps`` scheme do not change
    the vhost; anything else parse_url refuses is a ConfigError."""
    u = urllib.parse.urlsplit(url)
    bare = urllib.parse.urlunsplit(u._replace(scheme="amqp", query="", fragment=""))
    return check_amqp_url(bare).vhost


def connection_parameters(black: BlackConfig | str, purpose: str) -> pika.URLParameters:
    """pika parameters from black.amqp_url (or a URL): one attempt, short timeouts; the
    vhost read by the tap's parser (:func:`tap_vhost`), so the mirror binds the queues the
    tap drains."""
    url = black if isinstance(black, str) else black.amqp_url.get_secret_value()
    if not isinstance(black, str):
        check_amqp_url(url)  # the tap's rules: refused here, not after Spark started
    vhost = tap_vhost(url)
    try:
        params = pika.URLParameters(url)
    except Exception as e:  # pika raises assorted types on malformed URLs
        raise ConfigError(
            f"black.amqp_url is not a valid AMQP URL ({type(e).__name__}); expected "
            "amqp://user:password@host:5672/vhost (vhost URL-encoded, '/' is %2F)"
        ) from None
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
    defaults = {
        "connection_attempts": 1,
        "retry_delay": 0,
        "socket_timeout": 5,
        "stack_timeout": 10,
        "blocked_connection_timeout": 60,
    }
    for k, v in defaults.items():
        if k not in query:
            setattr(params, k, v)
    params.virtual_host = vhost
    params.client_properties = {"connection_name": f"diode-black-{purpose}"}
    return params


def describe_broker(params: pika.ConnectionParameters) -> str:
    """``amqp://host:port/vhost`` without credentials, for messages and logs."""
    vhost = urllib.parse.quote(params.virtual_host, safe="")
    return f"amqp://{params.host}:{params.port}/{vhost}"


def _scrub(text: str, params: pika.ConnectionParameters) -> str:
    secret = getattr(params.credentials, "password", "")
    return text.replace(secret, "***") if secret else text


def connect(black: BlackConfig, *, purpose: str = "mirror") -> BlockingConnection:
    """A blocking connection to the black broker that fails fast (one attempt, short timeouts)."""
    return connect_url(black.amqp_url.get_secret_value(), purpose=purpose)


def connect_url(url: str, *, purpose: str) -> BlockingConnection:
    """:func:`connect` for a URL (credentials never appear in errors or logs)."""
    params = connection_parameters(url, purpose)
    where = describe_broker(params)
    try:
        return pika.BlockingConnection(params)
    except (
        pika.exceptions.ProbableAuthenticationError,
        pika.exceptions.ProbableAccessDeniedError,
    ) as e:
        raise ConfigError(
            f"RabbitMQ at {where} refused the login or the vhost {params.virtual_host!r} "
            f"({type(e).__name__}): check user and password in black.amqp_url (config file or "
            "DIODE__BLACK__AMQP_URL), that the vhost "
            "exists and that the user has permissions on it (rabbitmqctl set_permissions)"
        ) from None
    except (pika.exceptions.AMQPError, OSError) as e:
        raise BrokerError(
            f"RabbitMQ unreachable at {where} ({type(e).__name__}: {_scrub(str(e), params)}): "
            "is the broker running and black.amqp_url right? retrying may help"
        ) from None


def broker_refused(e: pika.exceptions.ChannelClosedByBroker, what: str, vhost: str) -> DiodeError:
    if e.reply_code == 403:
        return ConfigError(
            f"RabbitMQ refused {what} in vhost {vhost!r}: {e.reply_text}; grant the black user "
            "configure/write/read permissions on the vhost (rabbitmqctl set_permissions)"
        )
    return BrokerError(f"RabbitMQ refused {what} in vhost {vhost!r}: {e.reply_code} {e.reply_text}")
