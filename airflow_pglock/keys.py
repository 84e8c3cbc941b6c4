"""Advisory lock keys: human names and numbers, mapped the same way everywhere.

Pure module: no I/O, no Airflow. A key is one of

* a *name* (any non-empty text) -> int64 = first 8 bytes of SHA-256(UTF-8 name),
  big-endian, signed. PostgreSQL computes the same value with :data:`NAME_TO_KEY_SQL`.
* an explicit int64, used unchanged (to share a lock with an application that already
  uses numeric keys);
* an (int32, int32) pair, used unchanged. PostgreSQL keeps the one-int64 and the
  two-int32 key spaces apart, so ``(0, 5)`` and ``5`` are different locks.
"""

from __future__ import annotations

import enum
import hashlib
import uuid
from dataclasses import dataclass
from typing import Any

from airflow_pglock.exceptions import InvalidLockKeyError

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1

#: SQL that computes a name's key in PostgreSQL; ``%s`` is the name (a bound parameter).
NAME_TO_KEY_SQL = "('x' || left(encode(sha256(convert_to(%s, 'UTF8')), 'hex'), 16))::bit(64)::bigint"

#: Separator between the parts of a derived name: DAG id, task id, tenant. Airflow ids
#: never contain it, so ``dag/task`` cannot be confused with another DAG's task.
NAME_SEPARATOR = "/"

#: Slot ``i`` (2..N) of a pool whose key is named ``P`` is the key named ``P#slot<i>``;
#: slot 1 is the pool's key itself, so ``slots=1`` is the plain mutex on the same key.
SLOT_SEPARATOR = "#slot"
#: The most slots a pool may have (one statement tries them in order: keep it cheap).
MAX_SLOTS = 1000

#: The longest key name, in UTF-8 bytes (a pool's slot names included). The key-name registry's
#: primary key (a btree on ``objsubid, classid, objid, name``) takes index rows of at most 2704
#: bytes with PostgreSQL's default 8 kB pages: 2668 bytes of a name that does not compress. A
#: longer name would fail the registry's write at every release, and the release's wake-up
#: NOTIFY with it; 2048 leaves a margin.
MAX_KEY_NAME_BYTES = 2048


def int64_from_name(name: str | bytes) -> int:
    """The int64 of a name: first 8 bytes of SHA-256(UTF-8 name), big-endian, signed.

    :param name: the key name (a string, hashed as UTF-8, or its UTF-8 bytes).
    """
    digest = hashlib.sha256(name.encode("utf-8") if isinstance(name, str) else name).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def name_bytes(name: str) -> bytes:
    """The UTF-8 bytes of a key name, refused when it is not UTF-8 text or longer than the maximum.

    :param name: the key name.
    :raises InvalidLockKeyError: a lone surrogate (no UTF-8 form), or more than
        :data:`MAX_KEY_NAME_BYTES` bytes.
    """
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidLockKeyError(
            f"lock key name must be UTF-8 text, got {_shortened(name)} with {name[error.start]!r} at position "
            f"{error.start} (a lone surrogate, e.g. from bytes decoded with errors='surrogateescape')"
        ) from None
    if len(encoded) > MAX_KEY_NAME_BYTES:
        raise InvalidLockKeyError(
            f"lock key name is {len(encoded)} bytes in UTF-8; a key name is at most {MAX_KEY_NAME_BYTES} bytes "
            f"(the key-name registry must be able to store it), got {_shortened(name)}"
        )
    return encoded


def _shortened(name: str) -> str:
    return repr(name) if len(name) <= 80 else f"{name[:60]!r}... ({len(name)} characters)"


def _sql_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


@dataclass(frozen=True)
class LockKey:
    """An advisory lock key: what a person calls it and what PostgreSQL calls it.

    Build one with :meth:`from_name`, :meth:`from_int`, :meth:`from_pair` or
    :meth:`coerce`; the constructor is not meant to be called directly.

    :param name: the human name, or ``None`` for a bare numeric key.
    :param numbers: the arguments of ``pg_*advisory*`` functions: ``(int64,)`` or
        ``(int32, int32)``.
    """

    name: str | None
    numbers: tuple[int] | tuple[int, int]

    @classmethod
    def from_name(cls, name: str) -> LockKey:
        """A key from a human name (hashed with SHA-256, see the module docstring)."""
        if not isinstance(name, str):
            raise InvalidLockKeyError(f"lock key name must be a string, got {name!r} ({type(name).__name__})")
        if not name.strip():
            raise InvalidLockKeyError(f"lock key name must be non-empty text, got {name!r}")
        if "\x00" in name:
            raise InvalidLockKeyError(f"lock key name must not contain NUL characters, got {name!r}")
        name = str.__str__(name)  # a str subclass (a str-mixin Enum member) as its characters
        return cls(name=name, numbers=(int64_from_name(name_bytes(name)),))

    @classmethod
    def from_int(cls, value: int, name: str | None = None) -> LockKey:
        """An explicit int64 key, used unchanged."""
        _check_int("int64 lock key", value, INT64_MIN, INT64_MAX)
        return cls(name=name, numbers=(int(value),))  # an int subclass (an IntEnum member) as its number

    @classmethod
    def from_pair(cls, first: int, second: int, name: str | None = None) -> LockKey:
        """An explicit (int32, int32) key, used unchanged."""
        _check_int("first int32 of the lock key pair", first, INT32_MIN, INT32_MAX)
        _check_int("second int32 of the lock key pair", second, INT32_MIN, INT32_MAX)
        return cls(name=name, numbers=(int(first), int(second)))

    @classmethod
    def coerce(cls, value: Any) -> LockKey:
        """A key from whatever a DAG author may pass: a LockKey, str, int or (int, int)."""
        if isinstance(value, LockKey):
            return value
        if isinstance(value, str):
            return cls.from_name(value)
        if isinstance(value, bool):
            raise InvalidLockKeyError(f"lock key must be a name, an int64 or an (int32, int32) pair, got {value!r}")
        if isinstance(value, int):
            return cls.from_int(value)
        if isinstance(value, tuple | list) and len(value) == 2:
            return cls.from_pair(value[0], value[1])
        raise InvalidLockKeyError(
            f"lock key must be a name (str), an int64 or an (int32, int32) pair, got {value!r} ({type(value).__name__})"
        )

    @classmethod
    def from_pg_locks(cls, classid: int, objid: int, objsubid: int) -> LockKey:
        """The key at these ``pg_locks`` coordinates (the inverse of :attr:`pg_locks`); no name."""
        if objsubid == 2:
            first = classid - 2**32 if classid > INT32_MAX else classid
            second = objid - 2**32 if objid > INT32_MAX else objid
            return cls.from_pair(first, second)
        if objsubid != 1:
            raise InvalidLockKeyError(f"not an advisory lock key: objsubid {objsubid!r} (expected 1 or 2)")
        value = (classid << 32) | objid
        return cls.from_int(value - 2**64 if value > INT64_MAX else value)

    @classmethod
    def for_task(cls, dag_id: str, task_id: str, tenant: Any = None, base: str | None = None) -> LockKey:
        """The key of a task: ``base`` (default ``dag_id/task_id``), then ``/tenant`` if any.

        :param tenant: a str, an int or a UUID (see :func:`tenant_text`), or None.
        """
        name = base if base is not None else f"{dag_id}{NAME_SEPARATOR}{task_id}"
        if tenant is not None:
            name = f"{name}{NAME_SEPARATOR}{tenant_text(tenant, key=name)}"
        return cls.from_name(name)

    @property
    def is_pair(self) -> bool:
        return len(self.numbers) == 2

    @property
    def int64(self) -> int | None:
        """The int64 key, or ``None`` for a pair."""
        return None if self.is_pair else self.numbers[0]

    @property
    def pg_locks(self) -> tuple[int, int, int]:
        """``(classid, objid, objsubid)`` of this key in ``pg_locks`` (unsigned oids)."""
        if self.is_pair:
            first, second = self.numbers  # type: ignore[misc]
            return first & 0xFFFFFFFF, second & 0xFFFFFFFF, 2
        value = self.numbers[0] & 0xFFFFFFFFFFFFFFFF
        return value >> 32, value & 0xFFFFFFFF, 1

    @property
    def sql(self) -> str:
        """A standalone SQL expression for this key's arguments (for docs and other apps)."""
        if self.name is not None and not self.is_pair and self.numbers[0] == int64_from_name(self.name):
            return NAME_TO_KEY_SQL.replace("%s", _sql_literal(self.name))
        return ", ".join(str(number) for number in self.numbers)

    @property
    def numbers_text(self) -> str:
        return ", ".join(str(number) for number in self.numbers)

    def describe(self) -> str:
        """``'name' (int64 N)`` or ``(int32 pair A, B)``: how logs and errors name a key."""
        kind = "int32 pair" if self.is_pair else "int64"
        if self.name is None:
            return f"key ({kind} {self.numbers_text})"
        return f"key {self.name!r} ({kind} {self.numbers_text})"

    def __str__(self) -> str:
        return self.describe()


#: What every ``key`` argument accepts: a :class:`LockKey`, a name, an int64 or an (int32, int32) pair.
AnyKey = LockKey | str | int | tuple[int, int]


def slot_keys(pool: LockKey, slots: int) -> list[LockKey]:
    """The keys of a pool of ``slots`` slots, slot 1 first: the pool's key, then ``<name>#slot2``...

    A pool of more than one slot needs a key *name* (its slots are named after it, so any
    client can compute them: ``NAME_TO_KEY_SQL`` of ``'<name>#slot<i>'``).

    :param pool: the pool's key (slot 1).
    :param slots: how many slots, 1 to :data:`MAX_SLOTS`.
    """
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
        raise InvalidLockKeyError(f"slots must be an integer from 1 to {MAX_SLOTS}, got {slots!r}")
    if slots == 1:
        return [pool]
    if pool.name is None or pool.is_pair or pool.numbers[0] != int64_from_name(pool.name):
        raise InvalidLockKeyError(
            f"slots={slots} needs a key name (the slot keys are named after it), got the numeric {pool.describe()}"
        )
    if names_a_slot(pool.name):
        raise InvalidLockKeyError(
            f"slots={slots} on {pool.describe()}: a pool's name may not end in '{SLOT_SEPARATOR}<number>', "
            f"which names a slot of another pool (its slots would be read as that pool's): rename the pool"
        )
    longest = f"{pool.name}{SLOT_SEPARATOR}{slots}"
    if len(longest.encode("utf-8")) > MAX_KEY_NAME_BYTES:
        raise InvalidLockKeyError(
            f"slots={slots} names its last slot {_shortened(longest)}, {len(longest.encode('utf-8'))} bytes in UTF-8; "
            f"a key name (slot names included) is at most {MAX_KEY_NAME_BYTES} bytes: shorten the pool's name"
        )
    return [pool] + [LockKey.from_name(f"{pool.name}{SLOT_SEPARATOR}{i}") for i in range(2, slots + 1)]


def names_a_slot(name: str) -> bool:
    """Whether ``name`` reads as slot 2 or above of some pool (``<pool>#slot<i>``)."""
    base, separator, number = name.rpartition(SLOT_SEPARATOR)
    numbered = number.isascii() and number.isdigit() and not number.startswith("0")
    return bool(separator and base) and numbered and int(number) >= 2


#: What a pool's size markers are derived from: SHA-256 of the pool's name followed by this.
POOL_MARKER_SUFFIX = "#pool-size"


def _pool_marker_class(pool: LockKey) -> int:
    """The high 32 bits of a pool's markers (pg_locks ``classid``): the first 4 bytes of
    SHA-256(UTF-8 ``<name>#pool-size``), read as an unsigned integer. In SQL:
    ``('x' || left(encode(sha256(convert_to(name || '#pool-size', 'UTF8')), 'hex'), 8))::bit(32)::bigint``."""
    assert pool.name is not None
    digest = hashlib.sha256(f"{pool.name}{POOL_MARKER_SUFFIX}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def _int64_of(high: int, low: int) -> int:
    value = (high << 32) | low
    return value - 2**64 if value > INT64_MAX else value


def pool_size_marker(pool: LockKey, slots: int) -> LockKey:
    """The key every holder of a pool of ``slots`` slots holds in shared mode with its slot: in
    ``pg_locks`` classid = :func:`_pool_marker_class` of the name, objid = ``slots`` (objsubid 1).
    A holder of the same pool with another size is seen there, and refused, before any slot is taken.

    :param pool: the pool's key (a name; see :func:`slot_keys`).
    :param slots: the pool's size, 2 to :data:`MAX_SLOTS`.
    """
    return LockKey(
        name=f"{pool.name}{POOL_MARKER_SUFFIX}={slots}", numbers=(_int64_of(_pool_marker_class(pool), slots),)
    )


def pool_presence_marker(pool: LockKey) -> LockKey:
    """The key every holder of a pool of that name holds in shared mode, whatever its size (objid 0):
    a plain key of the pool's name tries it exclusively (and gives it back at once) to learn that
    a pool is in use."""
    return LockKey(name=f"{pool.name}{POOL_MARKER_SUFFIX}", numbers=(_int64_of(_pool_marker_class(pool), 0),))


def is_named_key(key: LockKey) -> bool:
    """Whether ``key`` is the int64 of its name (the keys a pool of that name can share)."""
    return key.name is not None and not key.is_pair and key.numbers[0] == int64_from_name(key.name)


def tenant_text(tenant: Any, key: str | None = None) -> str:
    """The text a tenant adds to a key name: its value, spelled the same on every Python.

    * a str as is; an int in decimal; a UUID in its usual form (subclasses by their value,
      not by an overridden ``__str__``);
    * an Enum member by its value: an ``IntEnum`` / ``IntFlag`` / int-mixin member as its int
      (``Tenant.ACME = 1`` -> ``1``), a ``StrEnum`` / str-mixin member as its str, a plain
      ``Enum`` member whose value is a str, an int or a UUID as that value. So a member is the
      same lock as its value. ``str()`` of an enum is not used: it changed in Python 3.11
      (``str(IntEnum)`` was ``'Tenant.ACME'``, is ``'1'``) and gives a str-mixin member's name.

    Anything else (a dict, a list, a float, a bool, an object, an Enum member with another
    value) is refused: its text form is not a stable identity (``{'a': 1}`` and ``{'a': 1.0}``
    are one tenant spelled two ways, an object's repr changes between runs), so two runs could
    hold different locks for one tenant.

    :param tenant: the tenant value.
    :param key: the key name the tenant is appended to (for the error message).
    """
    where = f" for key {key!r}" if key is not None else ""
    value = tenant.value if isinstance(tenant, enum.Enum) and not isinstance(tenant, int | str) else tenant
    if isinstance(value, bool) or not isinstance(value, str | int | uuid.UUID):
        if isinstance(tenant, enum.Enum):
            raise InvalidLockKeyError(
                f"tenant must be a str, an int or a UUID, or an Enum member whose value is one; got {tenant!r} "
                f"({type(tenant).__name__}) whose value {tenant.value!r} is a {type(tenant.value).__name__}{where}"
            )
        raise InvalidLockKeyError(
            f"tenant must be a str, an int or a UUID (a value with one stable text form), got {tenant!r} "
            f"({type(tenant).__name__}){where}; pass the tenant's id, e.g. tenant['id']"
        )
    if isinstance(value, int):
        if value.bit_length() > 4 * MAX_KEY_NAME_BYTES:  # more digits than a key name holds (and than str() allows)
            raise InvalidLockKeyError(f"tenant is an int of {value.bit_length()} bits, too long for a key name{where}")
        text = int.__repr__(value)  # the digits, whatever the class's __str__ says (IntEnum on 3.10)
    elif isinstance(value, str):
        text = str.__str__(value)  # the characters, not a str-mixin Enum member's name
    else:
        text = str(uuid.UUID(int=value.int))
    if not text.strip():
        raise InvalidLockKeyError(f"tenant must be non-empty, got {tenant!r}{where}")
    return text


def _check_int(what: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidLockKeyError(f"{what} must be an integer, got {value!r} ({type(value).__name__})")
    if not low <= value <= high:
        raise InvalidLockKeyError(f"{what} must be between {low} and {high}, got {value}")
