"""Links into the dedup records admin (``celery_dedup.contrib.django``), when it is installed."""

from __future__ import annotations

from urllib.parse import urlencode

from django.apps import apps
from django.urls import NoReverseMatch, reverse

DEDUP_APP = "celery_dedup.contrib.django"


def dedup_admin_url(business_key: str) -> str | None:
    """The dedup admin's record list searched for ``business_key``, or None without that app."""
    if not apps.is_installed(DEDUP_APP):
        return None
    try:
        base = reverse("admin:celery_dedup_deduprecord_changelist")
    except NoReverseMatch:
        return None
    return f"{base}?{urlencode({'q': business_key})}"
