"""DedupTask: a Celery task whose calls are gated by their business key."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

import redis
from amqp import exceptions as amqp_exceptions
from celery import Task
from celery.utils.saferepr import saferepr
from kombu.exceptions import OperationalError

from . import decisions, runtime
from .config import check_debounce, check_mode, check_on_duplicate, check_on_locked, check_ttl
from .exceptions import (
    STORE_ERRORS,
    UNREACHABLE,
    DedupConfigError,
    DedupFollowerLimitError,
    DedupStoreError,
    DedupUnavailableError,
    DuplicateTaskError,
    server_reply,
    unreachable,
)
from .header import DEFERS_OPTION, HEADER, UNGATED, GateHeader
from .keys import KeyOption, KeySpec, member_for, new_nonce, new_task_id, split_member
from .modes import MODES, Mode
from .policy import LimitPolicy, TaskPolicy
from .policy import resolve as resolve_limits
from .publish.bulk import apply_async_many
from .publish.delay import delay_seconds
from .publish.result import DedupResult
from .publish.ticket import open_ticket, report
from .store.status import Status
from .store.store import DedupStore, Outcome
from .worker import relay
from .worker.guard import guarded_call, hand_over, lock_lost, replacing

logger = logging.getLogger("celery_dedup")

#: Every task option, as a DedupTask attribute or a keyword of ``@app.task``.
TASK_OPTIONS = (
    "dedup_key",
    "dedup_mode",
    "dedup_ttl",
    "dedup_on_duplicate",
    "dedup_lock_ttl",
    "dedup_on_locked",
    "dedup_window",
    "dedup_max_wait",
    "dedup_debounce",
)

#: Publish failures whose outcome ``_after_lost_reply`` finds out (an error reply is told apart there).
_RECOVERABLE: tuple[type[Exception], ...] = (*UNREACHABLE, redis.ResponseError)
_Publish = Callable[[dict[str, Any]], "DedupResult"]
#: A publish the broker refused: it has no message (py-amqp's negative confirm and channel errors).
_REFUSED: tuple[type[BaseException], ...] = (amqp_exceptions.MessageNacked, amqp_exceptions.ChannelError)


#: Options by which Celery hands a call something to resolve or continue.
_CONTINUATIONS = ("chain", "group_id", "chord")


def carries_continuation(link: Any, link_error: Any, options: Mapping[str, Any]) -> bool:
    """Whether a call carries something to resolve or continue: callbacks, its id in a group or chord, a chain.

    Such a call, as a duplicate, becomes a follower of the accepted run, so
    what it carries runs once that run ends (see the concepts doc).
    """
    return bool(link or link_error or any(options.get(name) for name in _CONTINUATIONS))


def check_bound_tasks(app: Any) -> None:
    """The checks that need an installed app, for the tasks bound before ``install`` (binding does them after)."""
    for task in list(app._tasks.values()):  # the registry as it is: app.tasks would finalize the app
        policy = type(task)._dedup_policy if isinstance(task, DedupTask) else None
        if policy is not None:
            type(task)._refuse_unparkable(app, policy.mode)


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
    - ``dedup_lock_ttl``: seconds the execution lock lives unrenewed (default ``dedup_lock_ttl``).
    - ``dedup_on_locked``: ``skip`` (default; ``reschedule`` for debounce) or
      ``reschedule`` a run that finds another run of its key executing.
    - ``limit_concurrency``, ``limit_rate`` (``"30/m"``), ``limit_key``: at most
      N bodies at once, R starts per period, per group (see :mod:`celery_dedup.worker.limits`).

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
    dedup_lock_ttl: ClassVar[float | None] = None
    dedup_on_locked: ClassVar[str | None] = None
    dedup_window: ClassVar[float | None] = None
    dedup_max_wait: ClassVar[float | None] = None
    dedup_debounce: ClassVar[str | None] = None
    limit_key: ClassVar[KeyOption] = None
    limit_concurrency: ClassVar[int | None] = None
    limit_rate: ClassVar[str | None] = None

    _dedup_policy: ClassVar[TaskPolicy | None] = None

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
            lock_ttl=check_ttl("dedup_lock_ttl", lock_ttl, task=name),
            on_locked=check_on_locked("dedup_on_locked", on_locked, task=name),
            limit=cls._resolve_limits(signature, config.max_key_length),
            **cls._resolve_window(mode),
        )

    @classmethod
    def _resolve_limits(cls, signature: inspect.Signature, max_key_length: int) -> LimitPolicy | None:
        """``limit_key``, ``limit_concurrency`` and ``limit_rate``, validated (see :mod:`celery_dedup.policy`)."""
        key = cls.__dict__.get("limit_key", cls.limit_key)
        if isinstance(key, staticmethod):
            key = key.__func__
        return resolve_limits(cls.name, key, cls.limit_concurrency, cls.limit_rate, signature, max_key_length)

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
        """Run the body under the execution guard (see :mod:`celery_dedup.worker.guard`).

        The key is settled here, before Celery stores the result: a caller who
        sees the result and calls again starts a new run, never the finished one.
        """
        return guarded_call(self, args, kwargs, lambda a, k: super(DedupTask, self).__call__(*a, **k))

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
    ) -> GateHeader:
        """The ``dedup`` header that gates a publish of ``member``, to run ``delay`` seconds from now.

        The key is held for ``dedup_ttl`` past the time the message is due
        (throttle: for ``dedup_window``; debounce: ``dedup_max_wait`` longer).
        ``continues``: the publish continues a run under its id (a retry, a
        deferred copy) instead of being a new call; ``defers``: it is a
        deferred copy (see ``guard.defer``). ``follows``: the call
        carries something to continue (see :func:`carries_continuation`), so
        as a duplicate it becomes a follower of the accepted run.
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
        # Celery would add the run to the calling task's children before the
        # gate's answer is known: done below, only for a run this call published.
        add_to_parent = bool(options.pop("add_to_parent", True))
        headers = dict(options.pop("headers", None) or {})
        defers = bool(options.pop(DEFERS_OPTION, False))
        previous = GateHeader.decode(headers)
        # Task.retry and deferred copies re-publish the run under its id: it
        # keeps its key, even if the arguments changed.
        continues = previous is not None and task_id is not None
        if previous is None or task_id is None:
            member = member_for(self.name, policy.spec.business_key(args, kwargs))
        else:
            member = previous.member
        continues = continues or self._goes_on(task_id, member, headers)
        business_key = split_member(member)[1]
        # A replacement carrying a replaced run's followers has them to resolve (see relay.py).
        follows = carries_continuation(link, link_error, options) or bool(relay.entries(headers))
        fresh = task_id is None and previous is None and not follows and not policy.mode.parks
        known = self._peek(member) if fresh else None
        if known is not None:
            report("", Outcome(False, known))  # answered before any gate: no publish of its own to report it
            return self._on_duplicate(policy, business_key, known, options)
        run_id = task_id or new_task_id(business_key)
        delay = delay_seconds(options.get("countdown"), options.get("eta"))
        gate = self.dedup_gate_header(member, delay, continues=continues, defers=defers and continues, follows=follows)
        headers[HEADER] = gate.encode()

        def publish(hdrs: dict[str, Any]) -> DedupResult:
            result = super(DedupTask, self).apply_async(
                args, kwargs, run_id, producer, link, link_error, shadow, headers=hdrs, add_to_parent=False, **options
            )
            if not isinstance(result, DedupResult):  # an EagerResult (task_always_eager)
                setattr(result, "deduplicated", False)  # noqa: B010 - not declared on EagerResult
            return cast(DedupResult, result)  # otherwise Celery built it with self.AsyncResult

        if atomic:
            try:
                with open_ticket(gate.nonce) as ticket:
                    result: DedupResult = publish(headers)
            except _RECOVERABLE as exc:
                return self._after_lost_reply(exc, gate, business_key, run_id)
            if ticket.outcome is None:
                logger.warning("%s[%s] was published without passing the gate (another transport?)", self.name, run_id)
            outcome = ticket.outcome or Outcome(True, run_id)
        else:
            reached, answer = self._two_phase(gate, run_id, args, kwargs, headers, publish)
            if reached is None:  # the store was unreachable, and dedup_on_redis_error answered
                return self._add_to_parent(answer, add_to_parent)
            outcome, result = reached, answer
            report(gate.nonce, outcome)  # no transport reports it: the gate ran before the publish
        if not outcome.collapsed:
            runtime.runtime_for(app).recent.saw(member, gate.hold_ms / 1000)
        if not outcome.accepted:
            return self._answer(outcome, business_key, run_id, options, follows=follows)
        decisions.log("accepted", self.name, business_key, run_id)
        return self._add_to_parent(result, add_to_parent)

    def _goes_on(self, task_id: str | None, member: str, headers: dict[str, Any]) -> bool:
        """Whether this publish is ``Task.replace`` under the run's own key: the replacement goes on as the run.

        The run's own ending then settles its followers: its key leaves the replacement's relay.
        """
        if not hand_over(task_id, member):
            return False
        relay.drop(headers, member)
        return True

    def _two_phase(
        self, gate: GateHeader, run_id: str, args: Any, kwargs: Any, headers: dict[str, Any], publish: _Publish
    ) -> tuple[Outcome | None, DedupResult]:
        """The gate for a broker apart from the store: hold with a lease, publish, confirm.

        Returns the outcome and the published run's result (for a duplicate,
        the result of nothing: only the outcome counts); outcome None when the
        store was unreachable and ``dedup_on_redis_error`` answered instead.
        """
        app = self.app
        config = runtime.config_for(app)
        eager = app.conf.task_always_eager
        try:
            store = runtime.store_for(app)  # a cluster's client connects as it is made
            outcome = store.gate(
                gate.member,
                run_id,
                gate.nonce,
                hold_ms=gate.hold_ms,
                grace_ms=gate.grace_ms,
                argsrepr=saferepr(args) if config.record_args and args else "",
                kwargsrepr=saferepr(kwargs) if config.record_args and kwargs else "",
                continues=gate.continues,
                defers=gate.defers,
                # Eager calls run inside their publish: nothing can be lost between.
                lease_ms=0 if eager else int(config.publish_lease * 1000),
            )
        except STORE_ERRORS as exc:
            key = split_member(gate.member)[1]
            if gate.continues and unreachable(exc):
                # A retry of a run accepted before (a worker that could not reach the store, say):
                # its delivery is guarded as any, so it goes on without the hold being stretched.
                logger.warning(
                    "%s[%s]: dedup store unreachable; the run goes on unconfirmed (%s)", self.name, run_id, exc
                )
                headers[HEADER] = dataclasses.replace(gate, held=True).encode()
                return None, publish(headers)
            return None, self._store_unreachable(exc, key, run_id, headers, publish)
        if not outcome.accepted:
            return outcome, self.AsyncResult(outcome.task_id)
        headers[HEADER] = dataclasses.replace(gate, held=True).encode()
        result = self._publish_or_unclaim(store, gate, run_id, headers, publish)
        return (outcome if eager else self._confirm(store, gate, run_id)), result

    def _answer(
        self, outcome: Outcome, key: str, run_id: str, options: dict[str, Any], *, follows: bool
    ) -> DedupResult:
        """What a call the gate did not accept gets: the accepted run, as a duplicate, a follower or a join."""
        if outcome.refused:
            limit = runtime.config_for(self.app).max_followers
            raise DedupFollowerLimitError(self.name, key, outcome.task_id, limit)
        if outcome.followed:
            decisions.log("followed", self.name, key, run_id, f"resolves as run {outcome.task_id} ends")
            return self._marked(outcome.task_id)
        if outcome.collapsed:
            decisions.log("collapsed", self.name, key, outcome.task_id, "joined the burst of its run")
            return self._marked(outcome.task_id)
        return self._on_duplicate(self.dedup_policy, key, outcome.task_id, options, follows=follows)

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

    def _peek(self, member: str) -> str | None:
        """The accepted run's id if ``member`` is held, asked before any message is built.

        Asked only for keys this process saw held lately (a hint, never
        trusted: the server answers); a key freed since costs this one extra
        round trip.
        """
        recent = runtime.runtime_for(self.app).recent
        if not recent.hint(member):
            return None
        try:
            known = runtime.store_for(self.app).peek(member)
        except STORE_ERRORS:
            return None  # the gate decides, with its own error handling
        if known is None:
            recent.forget(member)
        return known

    def _publish_or_unclaim(
        self, store: DedupStore, gate: GateHeader, run_id: str, headers: dict[str, Any], publish: _Publish
    ) -> DedupResult:
        """Second step of the two-phase gate: publish, and drop the key if nothing was published.

        An error raised after the broker took the message (a failed
        ``task-sent`` event), or after the run began (eager mode, where
        publishing runs the task and ``task_eager_propagates`` re-raises its
        error), is no failed publish: the key and record stay with the run,
        whose ending the guard records. A connection that broke mid-publish
        may have delivered the message: the key keeps its publish lease, so
        that message, if it arrives, runs once. A crash between holding and
        publishing leaves the key held until the lease ends.
        """
        member = gate.member
        with open_ticket(gate.nonce) as ticket:
            try:
                return publish(headers)
            except BaseException as exc:
                if ticket.sent:
                    logger.warning(
                        "%s[%s] was published, but publishing raised afterwards; key %r stays with the run",
                        self.name,
                        run_id,
                        member,
                    )
                    if not self.app.conf.task_always_eager:
                        self._confirm(store, gate, run_id)
                    raise
                if self._outcome_unknown(exc):
                    logger.warning(
                        "%s[%s]: the publish failed where the broker may have taken the message (%r); key %r "
                        "stays held until its publish lease ends",
                        self.name,
                        run_id,
                        exc,
                        member,
                    )
                    raise
                try:
                    store.unclaim(member, run_id)  # only while the run has not begun (see finish.lua)
                except STORE_ERRORS:
                    logger.exception("could not drop key %r after a failed publish; its lease frees it", member)
                raise

    def _outcome_unknown(self, exc: BaseException) -> bool:
        """Whether a failed publish may have reached the broker: the connection broke or timed out.

        Not when the broker said no (a negative publisher confirm, a channel
        error), however kombu wrapped that after its retries.
        """
        chain: list[BaseException] = []
        cause: BaseException | None = exc
        while cause is not None and cause not in chain:
            chain.append(cause)
            cause = cause.__cause__ or cause.__context__
        if any(isinstance(error, _REFUSED) for error in chain):
            return False
        broken: tuple[type[BaseException], ...] = (OSError, OperationalError)
        with contextlib.suppress(Exception):
            broken += tuple(self.app.connection_for_write().connection_errors)
        return isinstance(exc, broken)

    def _confirm(self, store: DedupStore, gate: GateHeader, run_id: str) -> Outcome:
        """Third step of the two-phase gate: the broker has the message, so the key gets its full hold.

        A run a worker began (or ended) before its confirm keeps its caller,
        even if a newer run has its key since. Only if the lease ended and
        another call took the key before this run began does that call's run
        stand for this one (the guard skips this run's message).
        """
        try:
            confirmed = store.confirm(gate.member, run_id, gate.nonce, hold_ms=gate.hold_ms, grace_ms=gate.grace_ms)
        except STORE_ERRORS:
            logger.exception(
                "%s[%s] was published, but its key %r could not be confirmed: it stays held until its publish "
                "lease ends",
                self.name,
                run_id,
                gate.member,
            )
            return Outcome(True, run_id)
        if confirmed.accepted or not confirmed.task_id:
            return Outcome(True, run_id)
        logger.warning(
            "%s[%s] was published after its publish lease ended; key %r belongs to run %s now, which stands for it",
            self.name,
            run_id,
            gate.member,
            confirmed.task_id,
        )
        return confirmed

    def _add_to_parent(self, result: DedupResult, add_to_parent: bool) -> DedupResult:
        """Add a run this call published to the calling task's children, as Celery's ``send_task`` does.

        Never a duplicate's: its id was not published, and the accepted run
        belongs to whichever call published it (naming it here could even make
        a task its own child). Eager runs are not added, as in Celery.
        """
        app = self.app
        parent = app.current_worker_task if add_to_parent and not app.conf.task_always_eager else None
        if parent is not None:
            parent.add_trail(result)
        return result

    def _after_lost_reply(self, exc: Exception, gate: GateHeader, key: str, run_id: str) -> DedupResult:
        """The gated publish failed on the Redis broker: find out whether the gate ran.

        A connection can break after the script ran but before its reply
        arrived. The record then carries this publish's nonce, and the caller
        gets the accepted run. The broker is the store here, so there is no
        ungated fallback (``dedup_on_redis_error`` governs a separate store).
        """
        reply = server_reply(exc)
        if reply is not None:  # not lost: the broker answered with an error (OOM, NOPERM...)
            raise DedupStoreError(self.name, key, reply) from exc
        store = runtime.store_for(self.app).with_prefix(gate.prefix)
        try:
            record = store.record(gate.member)
        except redis.RedisError:
            raise DedupUnavailableError(self.name, key, exc, published=None) from exc
        if record is not None and gate.nonce in (record.get("nonce"), *record.get("nonces", "").split()):
            logger.info("%s key %r: publish reply lost, but the gate accepted %s", self.name, key, run_id)
            report(gate.nonce, Outcome(True, run_id))
            return self.AsyncResult(run_id)
        if record is not None and gate.nonce == record.get("joined_nonce"):
            logger.info("%s key %r: publish reply lost; the call joined %s", self.name, key, record["task_id"])
            report(gate.nonce, Outcome(False, record["task_id"], collapsed=True))
            return self._marked(record["task_id"])
        raise DedupUnavailableError(self.name, key, exc, published=False) from exc

    def _store_unreachable(
        self, exc: Exception, key: str, run_id: str, headers: dict[str, Any], publish: _Publish
    ) -> DedupResult:
        """The separate dedup store is unreachable: ``dedup_on_redis_error`` decides.

        A store that answered with an error reply is not unreachable: that is a
        DedupStoreError under either policy, and nothing is published.
        """
        if not unreachable(exc):
            raise DedupStoreError(self.name, key, exc) from exc
        app = self.app
        if runtime.config_for(app).on_redis_error == "fail_closed":
            raise DedupUnavailableError(self.name, key, exc, published=False) from exc
        runtime.count_fail_open(app, self.name)
        decisions.log("fail_open", self.name, key, run_id, f"dedup store unreachable, published ungated ({exc})")
        headers[HEADER] = UNGATED  # not a gate header, and tells the publish hook to leave it alone
        return publish(headers)

    def AsyncResult(self, task_id: str, **kwargs: Any) -> DedupResult:
        """Results of this task are :class:`DedupResult`."""
        return DedupResult(task_id, backend=self.backend, task_name=self.name, app=self.app, **kwargs)

    def _on_duplicate(
        self, policy: TaskPolicy, key: str, existing_id: str, options: dict[str, Any], *, follows: bool = False
    ) -> DedupResult:
        # Canvas dispatch on a worker (chain/link callbacks) passes parent_id;
        # raising there would fail the parent task, so it gets the result instead.
        if policy.on_duplicate == "raise" and "parent_id" not in options:
            decisions.log("deduplicated", self.name, key, existing_id, "already accepted (raise)")
            raise DuplicateTaskError(self.name, key, existing_id)
        if follows:
            logger.warning(
                "duplicate %s key %r carries something to continue (a group or chord member, callbacks, a "
                "chain) but cannot follow run %s (no Redis broker, or dedup_max_followers=0): it will not run",
                self.name,
                key,
                existing_id,
            )
        decisions.log("deduplicated", self.name, key, existing_id, f"already accepted ({policy.on_duplicate})")
        return self._marked(existing_id)

    def _marked(self, existing_id: str) -> DedupResult:
        result = self.AsyncResult(existing_id)
        result.deduplicated = True
        return result
