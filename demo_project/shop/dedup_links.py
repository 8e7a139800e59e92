"""What the dedup records say about an order's tasks, linked to the dedup admin (``celery_dedup.contrib.django``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.apps import apps
from django.contrib.admin.utils import quote
from django.urls import NoReverseMatch, reverse

from celery_dedup import DedupTask
from celery_dedup.keys import member_for
from celery_dedup.store.status import Status

DEDUP_APP = "celery_dedup.contrib.django"
DEDUP_LABEL = "celery_dedup"


@dataclass(frozen=True)
class DedupRecord:
    """One task's status record for one business key, and the admin page that shows exactly it."""

    task: str
    key: str
    record: Status | None
    url: str | None

    @property
    def task_label(self) -> str:
        return self.task.rpartition(".")[2]

    @property
    def state(self) -> str:
        return self.record.state if self.record else "no record"


def dedup_record(task: DedupTask, *args: Any) -> DedupRecord:
    """``task``'s record for the call ``task(*args)``; linked only when there is one to show."""
    key = task.dedup_business_key(*args)
    record = task.dedup_status(*args)
    url = record_admin_url(member_for(task.name, key)) if record else None
    return DedupRecord(task.name, key, record, url)


def record_admin_url(member: str) -> str | None:
    """The dedup admin's page of this one record, or None without that app.

    Its own page, not the record list searched for the key: that search
    matches by prefix, so ``order:1`` would list ``order:10`` too.
    """
    if not apps.is_installed(DEDUP_APP):
        return None
    for model in apps.get_app_config(DEDUP_LABEL).get_models():
        try:
            return reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_change", args=[quote(member)])
        except NoReverseMatch:
            continue
    return None
