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
     +-- StateError             black journal / outbox disagree: stop, do not guess
     +-- TransportError         a transport could not move a file
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
