"""Inputs refused clearly before any connection: enum tenants by value, key-name, lease and
wait-timeout limits (pure, no database; the database side is tests/integration/test_key_limits.py)."""

from __future__ import annotations

import datetime as dt
import enum
import sys
import uuid

import pytest

from airflow_pglock import keys, liveness, policy
from airflow_pglock.exceptions import InvalidLockKeyError, LockConfigurationError
from airflow_pglock.keys import MAX_KEY_NAME_BYTES, LockKey, slot_keys, tenant_text
from airflow_pglock.liveness import MAX_LEASE_SECONDS, MAX_TCP_KEEPALIVE_SECONDS, Liveness
from airflow_pglock.options import LockOptions, LockSpec
from airflow_pglock.policy import MAX_WAIT_TIMEOUT_SECONDS, LockPolicy
from tests.stable_keys import Perm, Plain, Region, Shop  # the same enums the key table pins


class Tenant(enum.IntEnum):
    ACME = 1
    GLOBEX = 2


class Odd(enum.Enum):
    FLOAT = 1.5
    TRUE = True
    PAIR = (1, 2)
    NESTED = Region.EU


# ---------------------------------------------------------------- row 5: enum tenants render by value


@pytest.mark.parametrize(
    ("tenant", "text"),
    [
        (Tenant.ACME, "1"),
        (Perm.WRITE, "2"),
        (Perm.READ | Perm.WRITE, "3"),
        (Shop.ACME, "acme"),
        (Region.EU, "eu-west"),
        (Region.US, "7"),
        (Plain.ONE, "1"),
    ],
    ids=lambda value: repr(value),
)
def test_an_enum_tenant_renders_its_value_on_every_python(tenant: enum.Enum, text: str) -> None:
    """Python 3.10 renders str(IntEnum) as 'Tenant.ACME', 3.11+ as '1'; a (str, Enum) renders its
    member name everywhere: the key must be its value's, the same on every Python."""
    assert tenant_text(tenant) == text
    assert LockKey.for_task("exports", "export_one", tenant) == LockKey.from_name(f"exports/export_one/{text}")


@pytest.mark.skipif(sys.version_info < (3, 11), reason="enum.StrEnum appeared in Python 3.11")
def test_a_str_enum_tenant_renders_its_value() -> None:
    color = enum.StrEnum("Color", {"RED": "red"})  # type: ignore[attr-defined,misc]
    assert tenant_text(color.RED) == "red"


def test_an_enum_tenant_is_the_same_lock_as_its_value() -> None:
    assert LockKey.for_task("d", "t", Tenant.GLOBEX) == LockKey.for_task("d", "t", 2)
    assert LockKey.for_task("d", "t", Shop.ACME) == LockKey.for_task("d", "t", "acme")


@pytest.mark.parametrize("member", [Odd.FLOAT, Odd.TRUE, Odd.PAIR, Odd.NESTED], ids=lambda value: value.name)
def test_an_enum_tenant_without_a_str_or_int_value_is_refused(member: Odd) -> None:
    with pytest.raises(InvalidLockKeyError) as error:
        LockKey.for_task("exports", "export_one", member)
    message = str(error.value)
    assert repr(member) in message and repr(member.value) in message
    assert "Enum" in message and "str, an int or a UUID" in message


def test_a_uuid_valued_enum_tenant_renders_the_uuid() -> None:
    tenant_id = uuid.UUID("12345678-1234-5678-1234-567812345678")
    account = enum.Enum("Account", {"MAIN": tenant_id})
    assert tenant_text(account.MAIN) == str(tenant_id)


def test_int_and_str_subclasses_render_their_value_not_their_str() -> None:
    class Loud(int):
        def __str__(self) -> str:
            return "LOUD"

    class Shout(str):
        def __str__(self) -> str:
            return "SHOUT"

    assert tenant_text(Loud(5)) == "5"
    assert tenant_text(Shout("acme")) == "acme"


# ---------------------------------------------------------------- row 8: key names


def test_a_name_with_a_lone_surrogate_is_refused_with_its_position() -> None:
    with pytest.raises(InvalidLockKeyError, match="UTF-8") as error:
        LockKey.from_name("a\ud800b")
    assert "'a\\ud800b'" in str(error.value) and "position 1" in str(error.value)


def test_a_tenant_with_a_lone_surrogate_is_refused() -> None:
    with pytest.raises(InvalidLockKeyError, match="UTF-8"):
        LockKey.for_task("d", "t", "x\udcff")


def test_the_longest_name_is_accepted_and_one_byte_more_refused() -> None:
    assert LockKey.from_name("k" * MAX_KEY_NAME_BYTES).name == "k" * MAX_KEY_NAME_BYTES
    with pytest.raises(InvalidLockKeyError) as error:
        LockKey.from_name("k" * (MAX_KEY_NAME_BYTES + 1))
    assert f"{MAX_KEY_NAME_BYTES + 1} bytes" in str(error.value) and f"at most {MAX_KEY_NAME_BYTES}" in str(error.value)


def test_the_name_limit_counts_utf8_bytes_not_characters() -> None:
    name = "é" * (MAX_KEY_NAME_BYTES // 2 + 1)  # fewer characters than the limit, more bytes
    assert len(name) < MAX_KEY_NAME_BYTES
    with pytest.raises(InvalidLockKeyError, match=f"{len(name.encode())} bytes"):
        LockKey.from_name(name)
    with pytest.raises(InvalidLockKeyError, match="bytes"):  # a tenant can push a name over too
        LockKey.for_task("d", "t", "x" * MAX_KEY_NAME_BYTES)


def test_a_pool_name_leaves_room_for_its_slot_names() -> None:
    longest = f"{keys.SLOT_SEPARATOR}{keys.MAX_SLOTS}"
    fits = LockKey.from_name("p" * (MAX_KEY_NAME_BYTES - len(longest)))
    assert len(slot_keys(fits, keys.MAX_SLOTS)) == keys.MAX_SLOTS
    tight = LockKey.from_name("p" * MAX_KEY_NAME_BYTES)
    assert slot_keys(tight, 1) == [tight]
    with pytest.raises(InvalidLockKeyError) as error:
        slot_keys(tight, 3)
    assert "slots=3" in str(error.value) and f"at most {MAX_KEY_NAME_BYTES}" in str(error.value)


def test_a_literal_key_name_is_checked_when_the_dag_is_parsed() -> None:
    with pytest.raises(InvalidLockKeyError, match="bytes"):
        LockSpec.from_options({"key": "k" * (MAX_KEY_NAME_BYTES + 1)}, declaration=LockOptions, caller="t")
    with pytest.raises(InvalidLockKeyError, match="UTF-8"):
        LockSpec.from_options({"key": "a\ud800b"}, declaration=LockOptions, caller="t")
    # a template is checked when rendered (its text is not the name)
    LockSpec.from_options({"key": "{{ params.k }}" + "k" * MAX_KEY_NAME_BYTES}, declaration=LockOptions, caller="t")


# ---------------------------------------------------------------- row 8: the lease


def test_the_longest_lease_fits_every_setting_it_derives() -> None:
    assert MAX_LEASE_SECONDS == 3 * MAX_TCP_KEEPALIVE_SECONDS == 98301
    for lease in (MAX_LEASE_SECONDS, MAX_LEASE_SECONDS - 0.5, liveness.MIN_LEASE_SECONDS):
        live = Liveness(lease)
        assert 1 <= live.keepalive_idle <= MAX_TCP_KEEPALIVE_SECONDS
        assert 1 <= live.keepalive_interval <= MAX_TCP_KEEPALIVE_SECONDS
        assert live.lease_ms <= liveness.MAX_SETTING_MS
        assert live.keepalive_interval * 1000 <= liveness.MAX_SETTING_MS


@pytest.mark.parametrize(
    "bad", [MAX_LEASE_SECONDS + 0.001, 100_000, 3e6, float("inf"), float("-inf"), float("nan"), -1]
)
def test_a_lease_out_of_range_is_refused_with_the_range(bad: float) -> None:
    with pytest.raises(LockConfigurationError) as error:
        Liveness(bad)
    assert repr(bad) in str(error.value) and f"at most {MAX_LEASE_SECONDS:,} s" in str(error.value)


def test_a_too_long_lease_is_refused_when_the_dag_is_parsed_even_with_on_error_skip() -> None:
    with pytest.raises(LockConfigurationError, match="lease"):
        LockSpec.from_options({"lease": 100_000, "on_error": "skip"}, declaration=LockOptions, caller="t")
    with pytest.raises(LockConfigurationError, match="lease"):
        LockSpec.from_options({"lease": dt.timedelta(days=2)}, declaration=LockOptions, caller="t")


# ---------------------------------------------------------------- row 8: wait_timeout


@pytest.mark.parametrize(
    "bad", [float("inf"), float("nan"), -1, 0, 3e6, MAX_WAIT_TIMEOUT_SECONDS + 1, dt.timedelta(days=30)]
)
@pytest.mark.parametrize("on_busy", ["wait", "defer"])
def test_a_wait_timeout_out_of_range_is_refused_with_the_range(bad: object, on_busy: str) -> None:
    with pytest.raises(LockConfigurationError) as error:
        LockSpec.from_options({"on_busy": on_busy, "wait_timeout": bad}, declaration=LockOptions, caller="t")
    assert "wait_timeout" in str(error.value) and f"{MAX_WAIT_TIMEOUT_SECONDS:,}" in str(error.value)


def test_the_longest_wait_timeout_fits_lock_timeout() -> None:
    LockPolicy(on_busy="wait", wait_timeout=MAX_WAIT_TIMEOUT_SECONDS)
    assert policy.lock_timeout_ms(MAX_WAIT_TIMEOUT_SECONDS) <= policy.MAX_LOCK_TIMEOUT_MS == 2**31 - 1
    assert policy.lock_timeout_ms(0.0001) == 1


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -1, 3e6, True])
def test_the_hooks_wait_timeout_check_names_the_range(bad: object) -> None:
    from airflow_pglock.pg.statements import check_wait_timeout

    with pytest.raises(LockConfigurationError, match=f"{MAX_WAIT_TIMEOUT_SECONDS:,}"):
        check_wait_timeout(bad)


def test_an_int_tenant_too_long_for_a_name_is_refused_as_a_key_error() -> None:
    """Not Python's ValueError of an int past its str() digit limit."""
    for tenant in (10**4500, 10**2100):
        with pytest.raises(InvalidLockKeyError):
            LockKey.for_task("d", "t", tenant)


def test_enum_options_are_stored_as_their_values_before_any_template_rendering() -> None:
    """A template field renders a (str, Enum) member with str(): its name. The options keep its value."""
    spec = LockSpec.from_options({"key": Shop.ACME, "tenant": Tenant.GLOBEX}, declaration=LockOptions, caller="t")
    assert spec.templated["key"] == "acme" and type(spec.templated["key"]) is str
    assert spec.templated["tenant"] == "2" and type(spec.templated["tenant"]) is str
    assert type(LockKey.from_name(Shop.ACME).name) is str
