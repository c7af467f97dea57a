"""Both sides: the one exception hierarchy of the bridge.

Every error says whether retrying can help (``retryable``) and names the ids involved::

    DiodeError
     +-- ConfigError            terminal: the operator must fix the configuration
     +-- CryptoError            gpg / key problems
     |    +-- KeyMissingError   a configured fingerprint is not in the keyring
     |    +-- SignatureError    bad, missing or unpinned signature (hostile input)
     +-- ProtocolError          malformed wire data (hostile or buggy input)
     |    +-- SchemaVersionError   a version this reader does not know
     |    +-- ManifestError        manifest missing, malformed or inconsistent
     |    +-- BundleNameError      a wire file name that is not ours
     +-- BrokerError            RabbitMQ unreachable or refusing (transient)
     |    +-- ManagementApiError   the management HTTP API failed
     |    +-- AmqpConnectionError  could not connect, or the connection died (bridge.amqp)
     |    |    +-- AmqpAccessRefused   login or vhost refused: fix the URL or permissions
     |    |    +-- AmqpFrameError      the broker sent bytes that are not AMQP 0-9-1 frames
     |    +-- AmqpClosed           the broker closed a channel or the connection (reply code)
     +-- StateError             black journal / outbox disagree: stop, do not guess
     |    +-- SpoolGapError        spool positions asked for are not (or no longer) on disk
     +-- TransportError         a transport could not move a file
     +-- SpoolFull              black's spool has no room: the tap pauses (retryable)
"""

from __future__ import annotations

__all__ = [
    "DiodeError",
    "ConfigError",
    "CryptoError",
    "KeyMissingError",
    "SignatureError",
    "ProtocolError",
    "SchemaVersionError",
    "ManifestError",
    "BundleNameError",
    "BrokerError",
    "ManagementApiError",
    "StateError",
    "TransportError",
]


class DiodeError(Exception):
    """Base of every error the bridge raises on purpose."""

    retryable: bool = False


class ConfigError(DiodeError):
    """The configuration is wrong; the message says which key and how to fix it."""


class CryptoError(DiodeError):
    """gpg failed or a key is unusable."""


class KeyMissingError(CryptoError):
    """A fingerprint named in the configuration is not in the GnuPG home."""


class SignatureError(CryptoError):
    """A signature is bad, missing, or made by a key that is not pinned."""


class ProtocolError(DiodeError):
    """Wire data does not follow the contract (DESIGN.md section 3)."""


class SchemaVersionError(ProtocolError):
    """A schema or format version this reader does not know."""


class ManifestError(ProtocolError):
    """A bundle manifest is missing, malformed, or disagrees with its bundle."""


class BundleNameError(ProtocolError):
    """A file name that is not a well-formed bundle or heartbeat name."""


class BrokerError(DiodeError):
    """RabbitMQ is unreachable or refused an operation."""

    retryable = True


class ManagementApiError(BrokerError):
    """The RabbitMQ management HTTP API failed."""


class StateError(DiodeError):
    """Black's durable state and its outbox disagree; refusing to guess."""


class TransportError(DiodeError):
    """A transport could not move a file."""

    retryable = True


# -- AMQP client (bridge.amqp) ----------------------------------------------------------------
__all__ += [
    "AmqpConnectionError",
    "AmqpAccessRefused",
    "AmqpFrameError",
    "AmqpInterrupted",
    "AmqpClosed",
]


class AmqpConnectionError(BrokerError):
    """The AMQP connection could not be made or was lost; the message names host and vhost."""


class AmqpAccessRefused(AmqpConnectionError):
    """The broker refused the login or the vhost: retrying cannot help."""

    retryable = False


class AmqpFrameError(AmqpConnectionError):
    """The broker sent bytes that are not AMQP 0-9-1 frames; the connection is unusable."""


class AmqpInterrupted(AmqpConnectionError):
    """The caller's ``interrupt`` hook asked to stop while a send waited for the broker to read
    (a resource alarm blocks publishers): the connection was abandoned mid-frame."""


class AmqpClosed(BrokerError):
    """The broker closed a channel (``channel`` > 0) or the whole connection (``channel`` 0).

    Carries the broker's ``reply_code`` / ``reply_text`` and the ids of the method it refused
    (``class_id``, ``method_id``; 0 when none). Soft conditions a retry may cure (320
    connection-forced, 405 resource-locked, 506 resource-error, 541 internal-error) are
    retryable; the rest (404 not-found, 403 access-refused, 406 precondition-failed ...) are not.
    """

    RETRYABLE_CODES = frozenset({320, 405, 506, 541})

    def __init__(
        self,
        message: str,
        *,
        reply_code: int,
        reply_text: str,
        class_id: int = 0,
        method_id: int = 0,
        channel: int = 0,
    ) -> None:
        super().__init__(message)
        self.reply_code = reply_code
        self.reply_text = reply_text
        self.class_id = class_id
        self.method_id = method_id
        self.channel = channel
        self.retryable = reply_code in self.RETRYABLE_CODES


# -- black's spool (bridge.black.spool) --------------------------------------------------------
__all__ += ["SpoolFull", "SpoolGapError"]


class SpoolFull(DiodeError):
    """Black's spool has no room (quota, ``min_free_bytes`` or the file system is full).

    Nothing is lost: the records stay buffered and the broker keeps the backlog; retrying once
    space is back succeeds. ``errno`` is ENOSPC / EDQUOT when the file system refused a write,
    None when a configured limit was reached first.
    """

    retryable = True

    def __init__(
        self,
        message: str,
        *,
        errno: int | None = None,
        path: str | None = None,
        free_bytes: int | None = None,
    ) -> None:
        super().__init__(message)
        self.errno = errno
        self.path = path
        self.free_bytes = free_bytes


class SpoolGapError(StateError):
    """Spool positions asked for are not on disk: released already, not durable yet, or damaged."""
