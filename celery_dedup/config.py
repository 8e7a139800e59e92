"""Settings: read from ``app.conf`` once, validated once, kept on the app.

Every setting is read here and nowhere else. With Django's
``app.config_from_object("django.conf:settings", namespace="CELERY")`` each
``dedup_x`` below is spelled ``CELERY_DEDUP_X``.

===========================  ====================  ===============================================
setting                      default               effect
===========================  ====================  ===============================================
``dedup_redis_url``          the broker URL        where keys and status records live
``dedup_redis_options``      ``{}``                redis-py connection options of a store apart from
                                                   the broker (the broker's store connects as kombu)
``dedup_key_prefix``         ``"dedup"``           prefix of every Redis key celery-dedup writes (no
                                                   whitespace, control characters or braces)
``dedup_default_ttl``        ``3600``              seconds a key is held at most (plus countdown)
``dedup_default_mode``       ``"until_executed"``  mode of tasks that do not set ``dedup_mode``
``dedup_on_duplicate``       ``"return_existing"`` what duplicate callers get (or ``raise``/``drop``)
``dedup_on_mismatch``        ``"warn"``            a duplicate whose arguments differ from the accepted
                                                   run's: ``warn``, ``raise`` or ``ignore``
``dedup_on_redis_error``     ``"fail_closed"``     ``fail_closed`` raises, ``fail_open`` publishes
``dedup_max_key_length``     ``200``               longer business keys are hashed (prefix kept)
``dedup_record_ttl``         ``86400``             seconds a finished key's status record is kept
``dedup_lock_ttl``           ``60``                execution lock TTL (renewed at a third of it);
                                                   at least 1 second
``dedup_on_locked``          ``"skip"``            a run finding another run's lock: ``skip`` or
                                                   ``reschedule`` (after that lock's TTL)
``dedup_record_args``        ``True``              keep argument reprs and the message body in records
                                                   (re-enqueue from the admin needs them; PII: off)
``dedup_history_length``     ``10``                transitions kept per key
``dedup_reap_interval``      ``60``                seconds between a worker's reaper passes (0: off)
``dedup_reap_grace``         ``30``                seconds a pushed message may take to be fetched
                                                   and acknowledged before the reaper may judge it
                                                   lost by the transport
``dedup_dispatch_interval``  ``0.1``               seconds a worker's dispatcher of debounced runs
                                                   sleeps at most between looks for due runs
``dedup_max_followers``      ``1000``              duplicates with something to continue (a group or
                                                   chord member, callbacks, a chain) that one key's
                                                   run carries at most; 0: none
``dedup_publish_lease``      ``30``                seconds the two-phase gate (a broker apart from the
                                                   store) holds a key while its message is published;
                                                   at least 1 second
``dedup_cluster_wait_replicas``  ``1``             on a Redis Cluster store: replicas that must have
                                                   a decision's writes before it is answered (WAIT)
``dedup_step_result_limit``  ``65536``             bytes a step's return value may take, serialized
                                                   (``dedup_once``); a larger one fails the step
``dedup_limit_groups``       ``{}``                named limit groups tasks share (``limit_group``):
                                                   name -> ``{"concurrency": N, "rate": "R/u" or
                                                   a list of them}``, u one of s, m, h, d
===========================  ====================  ===============================================

Every time is in seconds, an int or a float, from 0.001 (Redis keeps times in
whole milliseconds: less would be 0 ms, which Redis refuses) to 1e9.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .exceptions import DedupConfigError
from .keys import STEP_NAME
from .modes import DEBOUNCE, MODES, ON_DOUBT, ON_DUPLICATE, ON_LOCKED, ON_MISMATCH, ON_REDIS_ERROR, STEP_SCOPES
from .policy import LimitGroup, check_group

_MISSING = object()


#: Redis keeps times in whole milliseconds; the largest keeps server-clock
#: deadlines (milliseconds, Lua doubles) exact.
MIN_SECONDS, MAX_SECONDS = 0.001, 1e9

#: Settings and task options (same names) with a larger minimum. The lock is
#: renewed every third of its TTL: a renewal must land within two thirds of
#: it despite a slow reply, a busy host or a GC pause, so below a second one
#: hiccup would lose the lock and let another delivery run the key.
#: A publish lease shorter than a second would end under a slow publisher
#: confirm, and let a second call's run through beside the first.
MINIMUM_SECONDS = {"dedup_lock_ttl": 1.0, "dedup_publish_lease": 1.0}


def _seconds(setting: str, value: Any, *, task: str | None = None) -> float:
    """A time setting or option: a number of seconds from its minimum to ``MAX_SECONDS``."""
    minimum = MINIMUM_SECONDS.get(setting, MIN_SECONDS)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not minimum <= value <= MAX_SECONDS:
        raise DedupConfigError(
            setting, value, f"must be a number of seconds from {minimum:g} to {MAX_SECONDS:g}", task=task
        )
    return float(value)


def _choice(choices: Mapping[str, Any] | frozenset[str]) -> Callable[..., str]:
    def check(setting: str, value: Any, *, task: str | None = None) -> str:
        if not isinstance(value, str) or value not in choices:
            allowed = ", ".join(sorted(choices))
            raise DedupConfigError(setting, value, f"must be one of: {allowed}", task=task)
        return str(value)

    return check


def _key_prefix(setting: str, value: Any, *, task: str | None = None) -> str:
    """Printable, without whitespace or braces: on a Redis Cluster the prefix sits inside each key's hash tag."""
    if (
        not isinstance(value, str)
        or not value
        or not value.isprintable()
        or any(c.isspace() or c in "{}" for c in value)
    ):
        raise DedupConfigError(
            setting, value, "must be a non-empty string without whitespace, control characters, '{' or '}'"
        )
    return value


#: URL schemes a dedup store can be reached by.
STORE_SCHEMES = ("redis", "rediss", "unix", "sentinel", "redis+cluster", "rediss+cluster")


def _optional_url(setting: str, value: Any, *, task: str | None = None) -> str | None:
    if value is None:
        return None
    scheme = value.partition("://")[0].lower() if isinstance(value, str) and "://" in value else None
    if scheme not in STORE_SCHEMES:
        raise DedupConfigError(
            setting, value, "must be a redis:// rediss:// unix:// sentinel:// or redis+cluster:// URL"
        )
    return str(value)


def _key_length(setting: str, value: Any, *, task: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 64:
        raise DedupConfigError(setting, value, "must be an integer of at least 64")
    return value


def _flag(setting: str, value: Any, *, task: str | None = None) -> bool:
    if not isinstance(value, bool):
        raise DedupConfigError(setting, value, "must be True or False", task=task)
    return value


def _replicas(setting: str, value: Any, *, task: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 16:
        raise DedupConfigError(setting, value, "must be an integer from 0 (do not wait) to 16", task=task)
    return value


def _count(setting: str, value: Any, *, task: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1000:
        raise DedupConfigError(setting, value, "must be an integer from 0 to 1000", task=task)
    return value


def _followers(setting: str, value: Any, *, task: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1_000_000:
        raise DedupConfigError(setting, value, "must be an integer from 0 (no followers) to 1000000", task=task)
    return value


#: The largest value Redis keeps (512 MiB), less room for what a step's entry holds besides its result.
MAX_STEP_RESULT = 512 * 1024 * 1024 - 4096


def _result_limit(setting: str, value: Any, *, task: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_STEP_RESULT:
        raise DedupConfigError(setting, value, f"must be a number of bytes from 1 to {MAX_STEP_RESULT}", task=task)
    return value


def check_step_name(setting: str, value: Any, *, task: str | None = None) -> str:
    """A step's name: 1 to 64 of ``A-Z a-z 0-9 _ . -``, starting with a letter or digit."""
    if not isinstance(value, str) or not STEP_NAME.fullmatch(value):
        raise DedupConfigError(
            setting, value, "must be 1 to 64 of A-Z a-z 0-9 _ . -, starting with a letter or a digit", task=task
        )
    return value


def _limit_groups(setting: str, value: Any, *, task: str | None = None) -> dict[str, LimitGroup]:
    """Named limit groups: a dict of name -> ``{"concurrency": N, "rate": ...}`` (see ``policy.check_group``)."""
    if not isinstance(value, Mapping):
        raise DedupConfigError(setting, value, 'must be a dict of group name -> {"concurrency": N, "rate": "R/u"}')
    return {name: check_group(setting, name, group) for name, group in value.items()}


def _interval(setting: str, value: Any, *, task: str | None = None) -> float:
    if value == 0 and not isinstance(value, bool):
        return 0.0
    try:
        return _seconds(setting, value, task=task)
    except DedupConfigError:
        reason = f"must be 0 (off) or a number of seconds from {MIN_SECONDS:g} to {MAX_SECONDS:g}"
        raise DedupConfigError(setting, value, reason, task=task) from None


def _options(setting: str, value: Any, *, task: str | None = None) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(name, str) for name in value):
        raise DedupConfigError(setting, value, "must be a dict of redis-py connection options (names are strings)")
    return dict(value)


check_mode = _choice(MODES)
check_on_duplicate = _choice(ON_DUPLICATE)
check_on_mismatch = _choice(ON_MISMATCH)
check_on_locked = _choice(ON_LOCKED)
check_ttl = _seconds
check_debounce = _choice(DEBOUNCE)
check_on_doubt = _choice(ON_DOUBT)
check_step_scope = _choice(STEP_SCOPES)

#: setting name -> (default, validator)
SETTINGS: dict[str, tuple[Any, Callable[..., Any]]] = {
    "dedup_redis_url": (None, _optional_url),
    "dedup_redis_options": ({}, _options),
    "dedup_key_prefix": ("dedup", _key_prefix),
    "dedup_default_ttl": (3600, _seconds),
    "dedup_default_mode": ("until_executed", check_mode),
    "dedup_on_duplicate": ("return_existing", check_on_duplicate),
    "dedup_on_mismatch": ("warn", check_on_mismatch),
    "dedup_on_redis_error": ("fail_closed", _choice(ON_REDIS_ERROR)),
    "dedup_max_key_length": (200, _key_length),
    "dedup_record_ttl": (86400, _seconds),
    "dedup_lock_ttl": (60, _seconds),
    "dedup_on_locked": ("skip", check_on_locked),
    "dedup_record_args": (True, _flag),
    "dedup_history_length": (10, _count),
    "dedup_max_followers": (1000, _followers),
    "dedup_reap_interval": (60, _interval),
    "dedup_reap_grace": (30, _seconds),
    "dedup_dispatch_interval": (0.1, _seconds),
    "dedup_publish_lease": (30, _seconds),
    "dedup_cluster_wait_replicas": (1, _replicas),
    "dedup_step_result_limit": (65536, _result_limit),
    "dedup_limit_groups": ({}, _limit_groups),
}


@dataclass(frozen=True)
class DedupConfig:
    """The validated app-wide settings."""

    redis_url: str | None
    redis_options: dict[str, Any]
    key_prefix: str
    default_ttl: float
    default_mode: str
    on_duplicate: str
    on_mismatch: str
    on_redis_error: str
    max_key_length: int
    record_ttl: float
    lock_ttl: float
    on_locked: str
    record_args: bool
    history_length: int
    max_followers: int
    reap_interval: float
    reap_grace: float
    dispatch_interval: float
    publish_lease: float
    cluster_wait_replicas: int
    step_result_limit: int
    #: Named limit groups, by name (``dedup_limit_groups``).
    limit_groups: dict[str, LimitGroup]

    @property
    def record_ms(self) -> int:
        """``dedup_record_ttl`` in milliseconds, as the Lua scripts take it."""
        return int(self.record_ttl * 1000)

    @classmethod
    def from_conf(cls, conf: Mapping[str, Any]) -> DedupConfig:
        """Read and validate every ``dedup_*`` setting; reject unknown ones."""
        _reject_unknown(conf)
        values = {}
        for setting, (default, check) in SETTINGS.items():
            value = _lookup(conf, setting)
            # Defaults go through their check too, which copies the mutable ones.
            values[setting.removeprefix("dedup_")] = check(setting, default if value is _MISSING else value)
        return cls(**values)


def _lookup(conf: Mapping[str, Any], setting: str) -> Any:
    """A setting's value under its name, or as a plain config module spells it, upper case.

    Celery reads a plain module's upper-case names as its own settings (its
    pre-4.0 style), so ``DEDUP_DEFAULT_TTL`` there means ``dedup_default_ttl``;
    one setting given both ways with different values is refused, as Celery
    refuses mixing the two styles.
    """
    lower = conf.get(setting, _MISSING)
    upper = conf.get(setting.upper(), _MISSING)
    if lower is not _MISSING and upper is not _MISSING and lower != upper:
        raise DedupConfigError(
            setting, lower, f"is also set as {setting.upper()}={upper!r}: both spellings name one setting, set it once"
        )
    return upper if lower is _MISSING else lower


#: Django settings that share the ``CELERY_DEDUP_`` prefix but configure the
#: admin (``celery_dedup.contrib.django``), not the Celery app.
DJANGO_ONLY = frozenset({"dedup_app"})


def _reject_unknown(conf: Mapping[str, Any]) -> None:
    for name in list(conf.keys()):
        lowered = str(name).lower()
        for prefix in ("dedup_", "celery_dedup_"):
            if lowered.startswith(prefix):
                setting = "dedup_" + lowered.removeprefix(prefix)
                if setting not in SETTINGS and setting not in DJANGO_ONLY:
                    close = difflib.get_close_matches(setting, SETTINGS, n=1)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                    raise DedupConfigError(name, conf[name], f"unknown celery-dedup setting{hint}")
