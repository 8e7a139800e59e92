"""Filters of the celery-dedup admin pages: times with their age, long dotted names that wrap."""

from __future__ import annotations

import datetime

from django import template
from django.utils import timezone
from django.utils.dateformat import format as format_date
from django.utils.html import escape, format_html
from django.utils.safestring import SafeString, mark_safe

from celery_dedup.store.status import to_ms

register = template.Library()


def age(moment: datetime.datetime, now: datetime.datetime | None = None) -> str:
    """``"12 s ago"``, ``"3 min ago"``, ``"5 h ago"``, ``"2 d ago"``; ``"in 40 s"`` for a time to come."""
    seconds = ((now or timezone.now()) - moment).total_seconds()
    future, seconds = seconds < 0, abs(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            amount = f"{int(seconds // size)} {unit}"
            break
    else:
        amount = f"{int(seconds)} s"
    return f"in {amount}" if future else f"{amount} ago"


def _title(moment: datetime.datetime) -> str:
    return f"{moment.isoformat(timespec='milliseconds')} ({to_ms(moment)} ms)"


@register.filter
def ago(moment: datetime.datetime | None) -> SafeString:
    """How long ago (or in how long), the exact time in the tooltip; ``-`` for no time."""
    if moment is None:
        return mark_safe("-")
    return format_html('<span class="when" title="{}">{}</span>', _title(moment), age(moment))


@register.filter
def when(moment: datetime.datetime | None) -> SafeString:
    """The date and time in the current time zone, with its age; ``-`` for no time."""
    if moment is None:
        return mark_safe("-")
    shown = format_date(timezone.localtime(moment), "Y-m-d H:i:s")
    markup = '<span class="when" title="{}">{} <small>({})</small></span>'
    return format_html(markup, _title(moment), shown, age(moment))


@register.filter
def breakable(name: str) -> SafeString:
    """A name that may wrap after each dot, underscore and "@", and before a run suffix.

    ``shop.<wbr>send_<wbr>email``, ``order:3<wbr>~x2``, ``celery@<wbr>vm-03.<wbr>example.<wbr>com`` (a
    browser breaks after hyphens by itself).
    """
    # Escaped first: the entities escape() writes hold none of ".", "_", "@", "~", so only break points are added.
    marked = str(escape(name))
    for after in (".", "_", "@"):
        marked = marked.replace(after, after + "<wbr>")
    return mark_safe(marked.replace("~", "<wbr>~"))


@register.filter
def run_id(task_id: str) -> SafeString:
    """A task id that wraps before its run suffix and, if it must, anywhere in its business key; never in the suffix."""
    key, tilde, suffix = task_id.rpartition("~")
    if not tilde:
        return format_html('<span class="run-key">{}</span>', breakable(task_id))
    markup = '<span class="run-key">{}</span><wbr><span class="run-suffix">~{}</span>'
    return format_html(markup, breakable(key), suffix)
