"""DedupTask: a Celery task whose calls are gated by their business key."""

from __future__ import annotations

import difflib
import inspect
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

from celery import Task

from . import runtime
from .config import (
    DedupConfig,
    check_debounce,
    check_mode,
    check_on_duplicate,
    check_on_locked,
    check_on_mismatch,
    check_ttl,
)
from .exceptions import (
    DedupConfigError,
)
from .header import GateHeader
from .keys import KeyOption, KeySpec, member_for, new_nonce
from .modes import MODES, Mode
from .policy import LimitPolicy, TaskPolicy
from .policy import resolve as resolve_limits
from .publish.bulk import apply_async_many
from .publish.call import apply_gated
from .publish.result import DedupResult
from .store.status import Status
from .worker import relay
from .worker.backoff import Backoff, backoff
from .worker.delivery import Participant, guarded_call, lock_lost, replacing
from .worker.limits import LIMITS
from .worker.steps import STEPS, once

T = TypeVar("T")

logger = logging.getLogger("celery_dedup")

#: Every task option, as a DedupTask attribute or a keyword of ``@app.task``.
TASK_OPTIONS = (
    "dedup_key",
    "dedup_mode",
    "dedup_ttl",
    "dedup_on_duplicate",
    "dedup_on_mismatch",
    "dedup_lock_ttl",
    "dedup_on_locked",
    "dedup_window",
    "dedup_max_wait",
    "dedup_debounce",
)


def check_bound_tasks(app: Any) -> None:
    """The checks that need an installed app, for the tasks bound before ``install`` (binding does them after)."""
    for task in list(app._tasks.values()):  # the registry as it is: app.tasks would finalize the app
        policy = type(task)._dedup_policy if isinstance(task, DedupTask) else None
        if policy is not None:
            type(task)._refuse_unparkable(app, policy.mode)


def _next_call_is_celerys(cls: type) -> bool:
    """Whether the ``__call__`` that ``DedupTask.__call__`` hands the body to in ``cls`` is Celery's ``Task.__call__``.

    Found once per class, and kept on it.
    """
    found: bool | None = vars(cls).get("_dedup_celery_call")
    if found is None:
        mro = cls.__mro__
        nexts = (vars(klass)["__call__"] for klass in mro[mro.index(DedupTask) + 1 :] if "__call__" in vars(klass))
        found = next(nexts, None) is Task.__call__
        setattr(cls, "_dedup_celery_call", found)  # noqa: B010 - a per-class cache, not a declared attribute
    return found


def _run_signature(cls: type) -> inspect.Signature:
    """The signature callers must match: ``run`` without ``self`` for methods."""
    for klass in cls.__mro__:
        if "run" in vars(klass):
            attr = vars(klass)["run"]
            break
    else:  # pragma: no cover - celery.Task always defines run
        raise TypeError(f"{cls!r} has no run method")
    if isinstance(attr, staticmethod):
        return inspect.signature(attr.__func__)
    signature = inspect.signature(attr)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


if TYPE_CHECKING:
    _TaskBase = Task[Any, Any]
else:
    _TaskBase = Task


class DedupTask(_TaskBase):
    """A task whose calls are deduplicated by a business key derived from its arguments.

    Options (class attributes, or keywords of ``@app.task``):

    - ``dedup_key``: format string over argument names (``"order:{order_id}"``),
      a list of argument names, a callable, or ``None`` (all arguments).
    - ``dedup_mode``: ``until_executed`` (default), ``until_executing``,
      ``until_expired``, ``while_executing``, ``debounce`` or ``throttle``.
    - ``dedup_window``: seconds; required by (and only for) ``debounce`` (quiet
      time before the run) and ``throttle`` (one run per window).
    - ``dedup_max_wait``: debounce: the longest a burst postpones its run
      (default 10 x ``dedup_window``).
    - ``dedup_debounce``: debounce: run with the ``latest`` call's arguments
      (default) or the ``first``.
    - ``dedup_ttl``: seconds a key stays held at most (default ``dedup_default_ttl``).
    - ``dedup_on_duplicate``: ``return_existing`` (default), ``raise`` or ``drop``.
    - ``dedup_on_mismatch``: a duplicate whose arguments differ from the accepted
      run's: ``warn`` (default), ``raise`` (:class:`~celery_dedup.DedupArgumentsMismatch`) or ``ignore``.
    - ``dedup_lock_ttl``: seconds the execution lock lives unrenewed (default ``dedup_lock_ttl``).
    - ``dedup_on_locked``: ``skip`` (default; ``reschedule`` for debounce) or
      ``reschedule`` a run that finds another run of its key executing.
    - ``limit_concurrency``, ``limit_rate`` (``"30/m"`` or a list of windows), ``limit_key``: at most
      N bodies at once, R starts per period, per group (see :mod:`celery_dedup.worker.limits`).
    - ``limit_group``: a named group of ``dedup_limit_groups`` the task draws on with other
      tasks (``limit_key``: the key inside the group; without it, one quota for the group).

    Example:
        >>> @app.task(base=DedupTask, dedup_key="order:{order_id}")
        ... def charge(order_id, amount): ...
        >>> r1, r2 = charge.delay(42, 10), charge.delay(42, 10)
        >>> (r2.id == r1.id, r1.deduplicated, r2.deduplicated)
        (True, False, True)
    """

    abstract = True
    dedup_key: ClassVar[KeyOption] = None
    dedup_mode: ClassVar[str | None] = None
    dedup_ttl: ClassVar[float | None] = None
    dedup_on_duplicate: ClassVar[str | None] = None
    dedup_on_mismatch: ClassVar[str | None] = None
    dedup_lock_ttl: ClassVar[float | None] = None
    dedup_on_locked: ClassVar[str | None] = None
    dedup_window: ClassVar[float | None] = None
    dedup_max_wait: ClassVar[float | None] = None
    dedup_debounce: ClassVar[str | None] = None
    limit_key: ClassVar[KeyOption] = None
    limit_concurrency: ClassVar[int | None] = None
    limit_rate: ClassVar[str | list[str] | None] = None
    limit_group: ClassVar[str | None] = None

    _dedup_policy: ClassVar[TaskPolicy | None] = None
    #: What takes part in every delivery of the task on a worker besides its guard: its limits, and its
    #: steps (see :class:`celery_dedup.worker.delivery.Participant`).
    worker_participants: ClassVar[tuple[Participant, ...]] = (LIMITS, STEPS)

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Validate the task's dedup options when Celery binds it, i.e. at start-up."""
        super().on_bound(app)
        cls._dedup_policy = None
        if cls.__dict__.get("abstract") or not getattr(cls, "name", None):
            return
        cls._dedup_policy = cls._resolve_policy(app)
        cls._refuse_unparkable(app, cls._dedup_policy.mode)

    @classmethod
    def _resolve_policy(cls, app: Any) -> TaskPolicy:
        cls._refuse_unknown_options()
        config = runtime.config_for(app)
        name = cls.name
        mode_name = cls.dedup_mode if cls.dedup_mode is not None else config.default_mode
        on_duplicate = cls.dedup_on_duplicate if cls.dedup_on_duplicate is not None else config.on_duplicate
        on_mismatch = cls.dedup_on_mismatch if cls.dedup_on_mismatch is not None else config.on_mismatch
        ttl = cls.dedup_ttl if cls.dedup_ttl is not None else config.default_ttl
        lock_ttl = cls.dedup_lock_ttl if cls.dedup_lock_ttl is not None else config.lock_ttl
        mode = MODES[check_mode("dedup_mode", mode_name, task=name)]
        cls._refuse_options_of_other_modes(mode)
        on_locked = cls.dedup_on_locked
        if on_locked is None:
            on_locked = mode.on_locked or config.on_locked
        option = cls.__dict__.get("dedup_key", cls.dedup_key)
        if isinstance(option, staticmethod):
            option = option.__func__
        try:
            signature = _run_signature(cls)
        except (TypeError, ValueError) as exc:
            raise DedupConfigError("dedup_key", option, f"cannot read the task's signature: {exc}", task=name) from exc
        return TaskPolicy(
            spec=KeySpec(name, option, signature, config.max_key_length),
            mode=mode,
            ttl=check_ttl("dedup_ttl", ttl, task=name),
            on_duplicate=check_on_duplicate("dedup_on_duplicate", on_duplicate, task=name),
            on_mismatch=check_on_mismatch("dedup_on_mismatch", on_mismatch, task=name),
            lock_ttl=check_ttl("dedup_lock_ttl", lock_ttl, task=name),
            on_locked=check_on_locked("dedup_on_locked", on_locked, task=name),
            limit=cls._resolve_limits(signature, config),
            **cls._resolve_window(mode),
        )

    @classmethod
    def _resolve_limits(cls, signature: inspect.Signature, config: DedupConfig) -> LimitPolicy | None:
        """``limit_key``, ``limit_concurrency``, ``limit_rate`` and ``limit_group``, validated (see :mod:`.policy`)."""
        key = cls.__dict__.get("limit_key", cls.limit_key)
        if isinstance(key, staticmethod):
            key = key.__func__
        return resolve_limits(
            cls.name,
            key,
            cls.limit_concurrency,
            cls.limit_rate,
            signature,
            config.max_key_length,
            cls.limit_group,
            config.limit_groups,
        )

    @classmethod
    def _refuse_unknown_options(cls) -> None:
        """A ``dedup_*`` attribute that is no option (``dedup_keys=``) is a typo, not a setting to ignore."""
        for klass in cls.__mro__:
            if klass is DedupTask:
                return
            for attribute in vars(klass):
                # (Only dedup_* names are looked up on DedupTask: Task.app, for one,
                # would bind the abstract base to whichever app is current.)
                if attribute.startswith("dedup_") and not (attribute in TASK_OPTIONS or hasattr(DedupTask, attribute)):
                    close = difflib.get_close_matches(attribute, TASK_OPTIONS, n=1)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                    raise DedupConfigError(
                        attribute,
                        vars(klass)[attribute],
                        f"unknown celery-dedup task option{hint} (dedup_* attributes of a DedupTask are its options)",
                        task=cls.name,
                    )

    @classmethod
    def _refuse_options_of_other_modes(cls, mode: type[Mode]) -> None:
        """An option the task's mode does not honour (``Mode.options``) would silently do nothing: refuse it."""
        for option in TASK_OPTIONS:
            value = getattr(cls, option)
            if value is None or option in mode.options:
                continue
            honouring = [other for other, klass in MODES.items() if option in klass.options]
            hint = ": set dedup_window" if option == "dedup_ttl" and mode.windowed else ""
            raise DedupConfigError(
                option,
                value,
                f"does not apply to dedup_mode={mode.name!r}{hint} (it applies to {', '.join(honouring)})",
                task=cls.name,
            )

    @classmethod
    def _refuse_unparkable(cls, app: Any, mode: type[Mode]) -> None:
        """A debounced task on an app whose broker cannot park its runs fails at start-up, not at its first call.

        Checked once the app is installed (``install`` checks the tasks bound before it). Eager
        apps run every call inline, so nothing is parked there.
        """
        if not mode.parks or app.conf.task_always_eager or not runtime.runtime_for(app).installed:
            return
        why = runtime.not_atomic_reason(app)
        if why is not None:
            raise DedupConfigError(
                "dedup_mode",
                mode.name,
                f"needs its keys in the Redis broker's database, where a debounced run's message is parked "
                f"until due, but {why}",
                task=cls.name,
            )

    @classmethod
    def _resolve_window(cls, mode: type[Mode]) -> dict[str, Any]:
        """``dedup_window``, ``dedup_max_wait`` and ``dedup_debounce``, for the modes that honour them."""
        name = cls.name
        given = {
            option: getattr(cls, option)
            for option in ("dedup_window", "dedup_max_wait", "dedup_debounce")
            if getattr(cls, option) is not None
        }
        if not mode.windowed:
            return {}
        if "dedup_window" not in given:
            raise DedupConfigError("dedup_window", None, f"is required with dedup_mode={mode.name!r}", task=name)
        window = check_ttl("dedup_window", given["dedup_window"], task=name)
        if not mode.parks:
            return {"window": window}
        max_wait = check_ttl("dedup_max_wait", given.get("dedup_max_wait", 10 * window), task=name)
        if max_wait < window:
            raise DedupConfigError(
                "dedup_max_wait", max_wait, f"must be at least dedup_window ({window:g}s)", task=name
            )
        debounce = check_debounce("dedup_debounce", given.get("dedup_debounce", "latest"), task=name)
        return {"window": window, "max_wait": max_wait, "debounce": debounce}

    @property
    def dedup_policy(self) -> TaskPolicy:
        """This task's resolved options (resolved on first use if Celery has not bound it yet)."""
        policy = type(self)._dedup_policy
        if policy is None:
            policy = type(self)._dedup_policy = self._resolve_policy(self.app)
        return policy

    def dedup_business_key(self, *args: Any, **kwargs: Any) -> str:
        """The business key of a call with these arguments."""
        return self.dedup_policy.spec.business_key(args, kwargs)

    def dedup_status(self, *args: Any, **kwargs: Any) -> Status | None:
        """The status of the key these arguments map to (state, run, times, counters, history), or None."""
        member = member_for(self.name, self.dedup_business_key(*args, **kwargs))
        return runtime.store_for(self.app).status(member)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the body as a delivery under the execution guard (see :mod:`celery_dedup.worker.delivery`).

        The key is settled here, before Celery stores the result: a caller who
        sees the result and calls again starts a new run, never the finished one.
        """
        return guarded_call(self, args, kwargs, self._dedup_body)

    def _dedup_body(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The body, as the ``__call__`` after this class's would run it.

        Celery's own ``Task.__call__`` only pushes a copy of the request its
        tracer pushed already, for a run the tracer started: such a run calls
        ``run`` at once, as Celery's tracer does for a task without a ``__call__``.
        """
        if not self.request.called_directly and _next_call_is_celerys(type(self)):
            return self.run(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def on_replace(self, sig: Any) -> Any:
        """``Task.replace``: a replacement under this run's key goes on as the same run.

        The run's lock is handed over and its record set back to ``queued``, so
        the replacement starts at once and the key stays held; a replacement
        under another key (or a plain task) ends this run as ``replaced``, and
        its followers then resolve as the replacement ends (see :mod:`celery_dedup.worker.relay`).
        """
        own = replacing(self, getattr(sig, "name", None) or type(sig).__name__)
        relay.carry(self.request, sig, own)
        return super().on_replace(sig)

    def dedup_once(self, name: str, fn: Callable[[str], T], *, scope: str = "run", on_doubt: str = "retry") -> T:
        """Call ``fn(idempotency_key)`` once for this run, whatever redelivers it; return its value.

        For the body of a keyed task (``base=DedupTask, bind=True``). The key
        is the same for every delivery, retry and redelivery of the run:
        pass it to the provider (``idempotency_key=key``). A step that
        completed is not called again by a later delivery of the run: its
        stored value is returned (serialized with the task's serializer, at
        most ``dedup_step_result_limit`` bytes). A step whose executor died
        inside it is *in doubt*: ``on_doubt="retry"`` (default) calls ``fn``
        again with the same key, ``"raise"`` raises :class:`~celery_dedup.DedupStepInDoubt`.
        ``scope="key"`` keeps the step for the key's record, across its runs.
        See docs/steps.md.

        Raises:
            DedupStepError: outside a keyed task's body, a bad or reused name, or a value that cannot be kept.
            DedupStepInDoubt: in doubt, with ``on_doubt="raise"``.
            DedupLockLostError: this delivery lost its execution lock; the body stands down (the run's
                ending is another delivery's to record).

        Example:
            >>> @app.task(base=DedupTask, bind=True, dedup_key="order:{order_id}", acks_late=True)
            ... def charge(self, order_id, amount):
            ...     return self.dedup_once("charge-card", lambda key: provider.charge(amount, idempotency_key=key))
        """
        return once(self, name, fn, scope=scope, on_doubt=on_doubt)

    def dedup_backoff(self, retry_after: float) -> Backoff:
        """The exception to raise to back off for ``retry_after`` seconds (an HTTP 429's ``Retry-After``).

        For the body of a task of a named limit group (``limit_group``): the
        run's group key is paused for ``retry_after`` seconds (no run of it
        starts, on any worker, nor any ``limits.acquire`` of it), this run goes
        first in the key's waiting line and is re-published to come back then.
        It costs no Celery retry (``request.retries`` and ``max_retries`` are
        untouched). Its slot is given back as it ends; its start stays counted.
        Like ``Task.retry``, the run is re-published by the time it returns:
        call it only to raise it. See :mod:`celery_dedup.worker.backoff`.

        Raises:
            DedupArgumentError: ``retry_after`` is not a number of seconds above 0.
            DedupConfigError: the task names no limit group.

        Example:
            >>> @app.task(base=DedupTask, bind=True, dedup_mode="off", limit_group="partner-api")
            ... def push(self, order_id):
            ...     response = partner.post(order_id)
            ...     if response.status_code == 429:
            ...         raise self.dedup_backoff(retry_after=float(response.headers["Retry-After"]))
        """
        return backoff(self, retry_after)

    @property
    def dedup_lock_lost(self) -> bool:
        """True once the running delivery has lost its execution lock.

        Long tasks should check it between steps: another delivery may be
        running the same key now.
        """
        return lock_lost(self.request.id)

    def dedup_gate_header(
        self,
        member: str,
        delay: float = 0.0,
        *,
        continues: bool = False,
        defers: bool = False,
        follows: bool = False,
        fingerprint: str = "",
    ) -> GateHeader:
        """The ``dedup`` header that gates a publish of ``member``, to run ``delay`` seconds from now.

        The key is held for ``dedup_ttl`` past the time the message is due
        (throttle: for ``dedup_window``; debounce: ``dedup_max_wait`` longer).
        ``continues``: the publish continues a run under its id (a retry, a
        deferred copy) instead of being a new call; ``defers``: it is a
        deferred copy (see ``Delivery.defer``). ``follows``: the call
        carries something to continue (see :func:`carries_continuation`), so
        as a duplicate it becomes a follower of the accepted run. ``fingerprint``:
        the call's arguments fingerprint, for the gate to keep (a new run) or
        compare (a duplicate); "" for none (see ``dedup_on_mismatch``).
        """
        config = runtime.config_for(self.app)
        policy = self.dedup_policy
        hold = policy.ttl
        window_ms = max_wait_ms = 0
        if policy.mode.parks and policy.window and policy.max_wait:
            hold += policy.max_wait
            window_ms, max_wait_ms = int(policy.window * 1000), int(policy.max_wait * 1000)
        elif policy.window:
            hold = policy.window
        return GateHeader(
            prefix=config.key_prefix,
            member=member,
            nonce=new_nonce(),
            hold_ms=int((hold + delay) * 1000),
            grace_ms=config.record_ms,
            history=config.history_length,
            record_args=config.record_args,
            window_ms=window_ms,
            max_wait_ms=max_wait_ms,
            latest=policy.debounce == "latest",
            continues=continues,
            defers=defers,
            follow=config.max_followers if follows else 0,
            fingerprint=fingerprint,
        )

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> DedupResult:
        """Publish the task unless its business key is already held.

        Returns the accepted run's result; ``result.deduplicated`` is True when
        this call was a duplicate (no message published).

        Raises:
            DuplicateTaskError: a duplicate, with ``dedup_on_duplicate="raise"``.
            DedupKeyError: the key cannot be derived from these arguments.
            DedupUnavailableError: the dedup store is unreachable (``fail_closed``).
        """
        policy = self.dedup_policy
        app = self.app
        atomic = runtime.is_atomic(app)  # also refuses an app that was never installed
        if policy.limit is not None and policy.limit.spec is not None and task_id is None:
            policy.limit.spec.business_key(args, kwargs)  # a bad limit group fails here, not on the worker
        if not self._gated(atomic):
            policy.spec.business_key(args, kwargs)  # a bad key fails here, not on the worker
            plain = super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)
            return cast(DedupResult, plain)

        def send(run_id: str, headers: dict[str, Any]) -> Any:
            return super(DedupTask, self).apply_async(
                args,
                kwargs,
                run_id,
                producer,
                link,
                link_error,
                shadow,
                headers=headers,
                add_to_parent=False,
                **options,
            )

        return apply_gated(self, args, kwargs, task_id, link, link_error, options, send, atomic=atomic)

    def _gated(self, atomic: bool) -> bool:
        """Whether a call goes through the gate (else it is published as Celery would)."""
        mode = self.dedup_policy.mode
        if not mode.gates_enqueue or (mode.parks and self.app.conf.task_always_eager):
            return False
        if mode.parks and not atomic:  # eager at binding, but no longer (refused at binding otherwise)
            type(self)._refuse_unparkable(self.app, mode)
        return True

    def delay(self, *args: Any, **kwargs: Any) -> DedupResult:
        """``apply_async(args, kwargs)``, typed to return a :class:`DedupResult`."""
        return self.apply_async(args, kwargs)

    def apply_async_many(
        self, calls: Iterable[tuple[Sequence[Any], Mapping[str, Any]]], *, chunk: int = 1000, **options: Any
    ) -> list[DedupResult]:
        """Enqueue many ``(args, kwargs)`` calls, each gated atomically, in pipelined round trips.

        One result per call, in order; duplicates (held before, or repeated in
        the batch) are marked ``deduplicated``. See :mod:`celery_dedup.publish.bulk`.

        Example:
            >>> results = notify.apply_async_many([((customer_id,), {}) for customer_id in customers])
            >>> sent = sum(not r.deduplicated for r in results)
        """
        return apply_async_many(self, calls, chunk=chunk, **options)

    def delay_many(self, argument_tuples: Iterable[Sequence[Any]], **options: Any) -> list[DedupResult]:
        """:meth:`apply_async_many` for positional arguments only: ``notify.delay_many([(1,), (2,)])``."""
        return self.apply_async_many(((args, {}) for args in argument_tuples), **options)

    def delay_on_commit(self, *args: Any, **kwargs: Any) -> None:
        """Django: :meth:`delay` once the current database transaction commits; nothing if it rolls back.

        Celery's ``DjangoTask`` method, which ``base=DedupTask`` would
        otherwise lose. Returns None, as Celery's does: the gate runs at
        commit. The key is derived now, so a bad key raises inside the
        transaction; see :mod:`celery_dedup.contrib.django.commit`.
        """
        self.apply_async_on_commit(args, kwargs)

    def apply_async_on_commit(
        self, args: Any = None, kwargs: Any = None, *, using: str | None = None, **options: Any
    ) -> None:
        """Django: :meth:`apply_async` once the transaction on database ``using`` (default: the default) commits.

        See :meth:`delay_on_commit`.
        """
        from .contrib.django.commit import publish_on_commit  # noqa: PLC0415 - Django is optional

        publish_on_commit(self, args, kwargs, options, using=using)

    def AsyncResult(self, task_id: str, **kwargs: Any) -> DedupResult:
        """Results of this task are :class:`DedupResult`."""
        return DedupResult(task_id, backend=self.backend, task_name=self.name, app=self.app, **kwargs)

    def _marked(self, existing_id: str) -> DedupResult:
        result = self.AsyncResult(existing_id)
        result.deduplicated = True
        return result
