"""Filters of the celery-dedup admin pages: times with their age, long dotted names that wrap."""

from __future__ import annotations

import datetime

from django import template
from django.utils import timezone
from django.utils.dateformat import format as format_date
from django.utils.html import escape, format_html
from django.utils.safestring import SafeString, mark_safe

from celery_dedup.status import to_ms

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
    """A name that may wrap after each dot and before a run suffix (``shop.<wbr>charge``, ``order:3<wbr>~x2``)."""
    # Escaped first: the entities escape() writes hold neither "." nor "~", so only break points are added.
    return mark_safe(escape(name).replace(".", ".<wbr>").replace("~", "<wbr>~"))
