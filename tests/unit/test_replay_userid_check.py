"""Red, replay (pure): rows whose user-id the replay user may not publish are named, with the fix.

RabbitMQ closes the channel (406) for a publish whose ``user-id`` is not the publishing user's
name unless that user has the ``impersonator`` tag; the replay checks the landed property bytes
before sending (the broker itself is in tests/integration/test_replay_userid_broker.py).
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from bridge.protocol.properties import Properties, encode_properties, field_table
from bridge.red.replay_check import USER_ID_FLAG, user_id_of, user_id_problem
from tests.unit.test_protocol_properties import properties


def _props(user_id: str | bytes | None) -> bytes:
    return encode_properties(
        Properties(headers=field_table({"k": "v"}), delivery_mode=2, user_id=user_id, app_id="a")
    )


def test_another_users_user_id_is_named_with_the_fix() -> None:
    assert user_id_problem(_props(None), "relay") is None
    assert user_id_problem(_props("relay"), "relay") is None  # its own name: the broker takes it
    why = user_id_problem(_props("alice"), "relay") or ""
    assert "'alice'" in why and "'relay'" in why and "406" in why
    assert "rabbitmqctl set_user_tags relay impersonator" in why and "Admin > Users" in why
    assert "restart the replay publisher" in why and "not changed" in why
    assert user_id_problem(_props(""), "relay") is not None  # present but empty: still another


def test_user_id_bytes_are_compared_as_the_broker_does() -> None:
    raw = _props(b"al\xffce")  # a shortstr need not be UTF-8
    assert user_id_of(raw) == b"al\xffce"
    assert "al\\xffce" in (user_id_problem(raw, "relay") or "")
    assert user_id_problem(_props("zoë"), "zoë") is None


def test_property_bytes_that_do_not_parse_are_left_to_row_problem() -> None:
    assert user_id_of(b"\x00\x10\x05ab") is None  # user-id flag, truncated value
    assert user_id_of(b"") is None and user_id_of(b"\x00") is None


@given(properties, st.one_of(st.none(), st.text(max_size=20)))
def test_user_id_of_reads_exactly_the_user_id(p: Properties, user_id: str | None) -> None:
    p = replace(p, user_id=user_id)
    raw = encode_properties(p)
    assert bool(raw[1] & USER_ID_FLAG) == (user_id is not None)
    assert user_id_of(raw) == (None if user_id is None else user_id.encode())
