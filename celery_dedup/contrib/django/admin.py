"""The "Celery dedup" admin: status records read live from Redis, and the operator's actions.

Viewing needs staff status and the ``view_record`` (or ``change_record``)
permission; releasing, purging, re-enqueueing and changing a named limit
group (override, clear, pause, resume) need ``change_record``.
Every action has a confirmation page (GET) and acts on a POST carrying the
CSRF token; what it did is written to Django's admin log (``LogEntry``). The
work itself is in :mod:`celery_dedup.operations`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from collections.abc import Callable
from typing import Any

from celery import Celery
from django.contrib import admin, messages
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.admin.utils import quote, unquote
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBase, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.views.generic import RedirectView
from kombu.exceptions import OperationalError

import celery_dedup
from celery_dedup import DedupTask, limits, operations, runtime
from celery_dedup.decisions import DECISIONS
from celery_dedup.exceptions import (
    STORE_ERRORS,
    DedupArgumentError,
    DedupConfigError,
    DedupOperationError,
    DedupStoreError,
    DedupUnavailableError,
)
from celery_dedup.keys import split_member, task_from_namespace
from celery_dedup.payloads import decode_payload
from celery_dedup.store.connection import masked_url
from celery_dedup.store.status import ENDED_STATES, STATE_HELP, STATES
from celery_dedup.store.store import KeyDetail, ReleaseResult

from . import limitgroups
from .conf import celery_app, store_url
from .detail import groups_of
from .forms import LIMIT_ACTIONS, LimitActionForm, PurgeForm, ReleaseForm
from .listing import PAGE_SIZE, Listing, Query, task_names
from .models import Record

TEMPLATES = "admin/celery_dedup/record"
logger = logging.getLogger("celery_dedup")

#: What the admin answers with its "unavailable" page: an unreachable or failing store (from the store, the
#: gate, a publish), and settings of the Celery app the store cannot be used with.
UNAVAILABLE: tuple[type[Exception], ...] = (
    *STORE_ERRORS,
    OperationalError,
    DedupUnavailableError,
    DedupStoreError,
    DedupConfigError,
)

#: A URL inside an error's text, to be shown masked.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"]+")


@admin.register(Record)
class RecordAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Lists, shows and acts on records in Redis; the model only carries the permissions."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_urls(self) -> list[URLPattern]:
        name = f"{self.opts.app_label}_{self.opts.model_name}"

        def wrap(view: Callable[..., HttpResponseBase]) -> Callable[..., HttpResponseBase]:
            return self.admin_site.admin_view(self._answering(view))

        return [
            path("", wrap(self.changelist_view), name=f"{name}_changelist"),
            path("purge/", wrap(self.purge_view), name=f"{name}_purge"),
            path("stats/", wrap(self.stats_view), name=f"{name}_stats"),
            path("limits/", wrap(self.limits_view), name=f"{name}_limits"),
            path("<path:object_id>/change/", wrap(self.change_view), name=f"{name}_change"),
            path("<path:object_id>/release/", wrap(self.release_view), name=f"{name}_release"),
            path("<path:object_id>/requeue/", wrap(self.requeue_view), name=f"{name}_requeue"),
            path(
                "<path:object_id>/",
                wrap(RedirectView.as_view(pattern_name=f"{self.admin_site.name}:{name}_change")),
            ),
        ]

    # --- helpers -------------------------------------------------------------------------------

    def _answering(self, view: Callable[..., HttpResponseBase]) -> Callable[..., HttpResponseBase]:
        """``view``, answering with a page that says the store is unreachable instead of a server error."""

        @functools.wraps(view)
        def answering(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            try:
                return view(request, *args, **kwargs)
            except UNAVAILABLE as exc:
                return self._unavailable(request, exc)

        return answering

    def _unavailable(self, request: HttpRequest, exc: Exception) -> HttpResponse:
        try:
            where = store_url(celery_app())
        except DedupConfigError:  # the app itself cannot be used: its error says why
            where = "(unknown)"
        error = _URL.sub(lambda url: masked_url(url.group()), f"{type(exc).__name__}: {exc}")
        logger.warning("celery-dedup admin: the dedup store at %s cannot be used (%s)", where, error)
        context = self._context(
            request,
            "Status records unavailable",
            store_url=where,
            error=error,
            posted=request.method == "POST",
            retry_url=request.get_full_path(),
        )
        return TemplateResponse(request, f"{TEMPLATES}/unavailable.html", context, status=503)

    def _require(self, request: HttpRequest, *, change: bool = False) -> None:
        allowed = self.has_change_permission(request) if change else self.has_view_or_change_permission(request)
        if not allowed:
            raise PermissionDenied

    def _url(self, view: str, member: str | None = None) -> str:
        name = f"{self.admin_site.name}:{self.opts.app_label}_{self.opts.model_name}_{view}"
        return reverse(name, args=[quote(member)] if member is not None else [])

    def _context(self, request: HttpRequest, title: str, **extra: Any) -> dict[str, Any]:
        return {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "app_label": self.opts.app_label,
            "title": title,
            "has_view_permission": self.has_view_permission(request),
            "has_change_permission": self.has_change_permission(request),
            "changelist_url": self._url("changelist"),
            **extra,
        }

    def _log(self, request: HttpRequest, member: str | None, message: str, *, about: str = "") -> None:
        """Note in the admin log who did what to ``member`` (None: to records in general, or to ``about``)."""
        record = Record.standing_for(member)
        if member is not None:
            self.log_change(request, record, message)
            return
        # Django before 5.1 stores str(object_id): an entry about no one record would name "None".
        LogEntry.objects.create(
            user_id=request.user.pk,
            content_type_id=ContentType.objects.get_for_model(Record, for_concrete_model=False).pk,
            object_id=None,
            object_repr=(about or str(record))[:200],
            action_flag=CHANGE,
            change_message=message,
        )

    def _detail(self, app: Celery, object_id: str) -> KeyDetail:
        found = operations.detail(app, unquote(object_id))
        if found.record is None and not found.held and found.lock_token is None:
            raise Http404(f"No status record, hold or lock for {found.member!r}")
        return found

    # --- views ---------------------------------------------------------------------------------

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        self._require(request)
        app = celery_app()
        store = runtime.store_for(app)
        query = Query.parse(request.GET)
        try:
            page = store.records(
                state=query.state or None,
                task=query.task or None,
                prefix=query.search or None,
                cursor=query.cursor or None,
                limit=PAGE_SIZE,
            )
        except DedupArgumentError:  # a cursor of another store's layout: the first page
            query = dataclasses.replace(query, cursor="", trail=())
            page = store.records(
                state=query.state or None, task=query.task or None, prefix=query.search or None, limit=PAGE_SIZE
            )
        names = task_names(app.tasks, DedupTask)
        sizes = store.index_sizes(states=STATES)
        listing = Listing.build(
            query,
            page,
            states=sizes.states,
            tasks=dict.fromkeys(names, -1),  # no per-task index to count: the choices go without counts
            link=lambda member: self._url("change", member),
        )
        context = self._context(
            request,
            "Status records",
            listing=listing,
            total=sizes.total,
            page_size=PAGE_SIZE,
            purge_url=self._url("purge"),
            stats_url=self._url("stats"),
            limits_url=self._url("limits"),
            **(extra_context or {}),
        )
        return TemplateResponse(request, f"{TEMPLATES}/change_list.html", context)

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        self._require(request)
        app = celery_app()
        found = self._detail(app, object_id)
        namespace, key = split_member(found.member)
        status = found.status
        context = self._context(
            request,
            f"Status record {key}",
            detail=found,
            status=status,
            task=status.task if status is not None else task_from_namespace(namespace),
            key=key,
            state_help=STATE_HELP.get(status.state, "") if status is not None else "",
            groups=groups_of(status) if status is not None else [],
            history=(status.history or ()) if status is not None else (),
            lock_ttl_s=found.lock_ttl_ms / 1000,
            release_url=self._url("release", found.member) if _holds_something(found) else None,
            requeue_url=self._url("requeue", found.member) if operations.can_requeue(found.record) else None,
            **(extra_context or {}),
        )
        return TemplateResponse(request, f"{TEMPLATES}/change_form.html", context)

    def release_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        self._require(request, change=True)
        app = celery_app()
        found = self._detail(app, object_id)
        detail_url = self._url("change", found.member)
        if request.method == "POST":
            form = ReleaseForm(request.POST)
            if form.is_valid():
                force = form.cleaned_data["force"]
                result = operations.release(
                    app,
                    found.member,
                    force_token=form.cleaned_data["token"] if force else "",
                    by=request.user.get_username(),
                )
                if result.released:
                    self._log(request, found.member, _released_log(result))
                    self.message_user(request, _released_message(found.member, result), messages.SUCCESS)
                    return HttpResponseRedirect(detail_url)
                self.message_user(request, _refused_message(result), messages.ERROR)
                if result.code == ReleaseResult.NOTHING:
                    return HttpResponseRedirect(detail_url)
                return HttpResponseRedirect(self._url("release", found.member))
        else:
            form = ReleaseForm(initial={"token": found.lock_token or ""})
        context = self._context(
            request,
            "Release this key?",
            detail=found,
            key=found.member.partition(":")[2],
            state=(found.record or {}).get("state", ""),
            ended=(found.record or {}).get("state") in ENDED_STATES,
            holds_something=_holds_something(found),
            lock_ttl_s=found.lock_ttl_ms / 1000,
            form=form,
            detail_url=detail_url,
        )
        return TemplateResponse(request, f"{TEMPLATES}/release.html", context)

    def requeue_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        self._require(request, change=True)
        app = celery_app()
        found = self._detail(app, object_id)
        detail_url = self._url("change", found.member)
        if request.method == "POST":
            earlier = (found.record or {}).get("task_id", "?")
            try:
                result = operations.requeue(app, found.member, by=request.user.get_username())
            except DedupOperationError as exc:
                self.message_user(request, f"Not re-enqueued: {exc.reason}.", messages.ERROR)
                return HttpResponseRedirect(detail_url)
            if result.deduplicated:
                text = f"Nothing enqueued: the key is held by run {result.task_id}."
                self.message_user(request, text, messages.WARNING)
            else:
                self._log(request, found.member, f"Re-enqueued as task id {result.task_id} (was {earlier}).")
                self.message_user(request, f"Re-enqueued as task id {result.task_id}.", messages.SUCCESS)
            return HttpResponseRedirect(detail_url)
        record = found.record or {}
        try:
            arguments = decode_payload(app, record["payload"]) if operations.can_requeue(record) else None
        except Exception as exc:  # shown, not raised: the POST reports it as a typed error
            arguments = None
            self.message_user(request, f"The payload cannot be decoded: {exc}", messages.ERROR)
        context = self._context(
            request,
            "Re-enqueue this run?",
            detail=found,
            key=found.member.partition(":")[2],
            state=record.get("state", ""),
            arguments=arguments,
            requeue_states=operations.REQUEUE_STATES,
            detail_url=detail_url,
        )
        return TemplateResponse(request, f"{TEMPLATES}/requeue.html", context)

    def stats_view(self, request: HttpRequest) -> HttpResponse:
        self._require(request)
        counts = celery_dedup.stats(celery_app())
        rows = [(task, [by.get(decision, 0) for decision in DECISIONS]) for task, by in sorted(counts.items())]
        context = self._context(request, "Decision counters", decisions=DECISIONS, rows=rows)
        return TemplateResponse(request, f"{TEMPLATES}/stats.html", context)

    def limits_view(self, request: HttpRequest) -> HttpResponse:
        """Named limit groups and the group keys used in the last day; a POST changes a named group.

        Its actions (override, clear, pause, resume) need ``change_record``
        and are written to the admin log.
        """
        self._require(request, change=request.method == "POST")
        app = celery_app()
        if request.method == "POST":
            form = LimitActionForm(request.POST)
            if not form.is_valid():
                errors = "; ".join(str(error) for errors in form.errors.values() for error in errors)
                self.message_user(request, f"Nothing changed: {errors}", messages.ERROR)
                return HttpResponseRedirect(self._url("limits"))
            group, key = form.cleaned_data["group"], form.target_key()
            try:
                changed, text = limitgroups.apply(
                    app,
                    form.cleaned_data["action"],
                    group,
                    key,
                    concurrency=form.cleaned_data["concurrency"],
                    rates=form.rates(),
                    until=form.pause_end(),
                    by=request.user.get_username(),
                )
            except DedupArgumentError as exc:
                self.message_user(request, f"Nothing changed: {exc}", messages.ERROR)
                return HttpResponseRedirect(self._url("limits"))
            if changed:
                self._log(request, None, text, about=limitgroups.scope_text(group, key))
            self.message_user(request, text, messages.SUCCESS if changed else messages.WARNING)
            return HttpResponseRedirect(self._url("limits"))
        store = runtime.store_for(app)
        named = limits.describe(app)
        now_ms = limitgroups.server_ms(store.client)
        context = self._context(
            request,
            "Limit groups",
            named=limitgroups.conf_rows(named, now_ms),
            groups=limitgroups.key_rows(limits.groups(store), named, now_ms),
            group_names=[info.name for info in named],
            actions=LIMIT_ACTIONS,
        )
        return TemplateResponse(request, f"{TEMPLATES}/limits.html", context)

    def purge_view(self, request: HttpRequest) -> HttpResponse:
        self._require(request, change=True)
        app = celery_app()
        if request.method == "POST":
            form = PurgeForm(request.POST)
            if form.is_valid():
                states = form.cleaned_data["states"]
                report = operations.purge(app, states=states)
                if report.purged:
                    self._log(request, None, f"Purged {report.purged} records in states {', '.join(states)}.")
                text = f"Purged {report.purged} finished records."
                if report.kept:
                    text += f" Kept {report.kept} whose key is still held or whose lock is alive."
                if report.more:
                    text += " More remain: purge again."
                self.message_user(request, text, messages.SUCCESS)
                return HttpResponseRedirect(self._url("changelist"))
        else:
            form = PurgeForm()
        sizes = runtime.store_for(app).index_sizes(states=ENDED_STATES)
        context = self._context(request, "Purge finished records?", form=form, counts=sizes.states)
        return TemplateResponse(request, f"{TEMPLATES}/purge.html", context)


def _holds_something(found: KeyDetail) -> bool:
    """Whether a release would free anything: the key is held, or an execution lock is alive."""
    return found.held or found.lock_token is not None


def _released_log(result: ReleaseResult) -> str:
    text = "Released the key"
    if result.forced:
        text += ", deleting its live execution lock"
    return text + (f"; its run's state is now {result.detail}." if result.detail else "; it had no record.")


def _released_message(member: str, result: ReleaseResult) -> str:
    text = f"Released {member}"
    if result.forced:
        text += " (its execution lock was deleted)"
    if result.detail:
        text += f"; its record says {result.detail}"
    return text + "."


def _refused_message(result: ReleaseResult) -> str:
    if result.code == ReleaseResult.REFUSED_LOCKED:
        return (
            f"Not released: a worker holds the execution lock ({int(result.detail) / 1000:.1f} s left). "
            "Tick force only if that worker is gone."
        )
    if result.code == ReleaseResult.REFUSED_LOCK_CHANGED:
        return f"Not released: the lock now belongs to {result.detail}, not the owner you confirmed. Review again."
    if result.detail:
        return (
            "Nothing to release: the key is not held and no execution lock is alive "
            f"(the run's state is {result.detail}). Nothing was changed."
        )
    return "Nothing to release: the key has no record, hold or lock any more."
