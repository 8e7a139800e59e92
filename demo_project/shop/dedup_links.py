"""Links into the dedup records admin (``celery_dedup.contrib.django``), when it is installed."""

from __future__ import annotations

from urllib.parse import urlencode

from django.apps import apps
from django.urls import NoReverseMatch, reverse

DEDUP_APP = "celery_dedup.contrib.django"
DEDUP_LABEL = "celery_dedup"


def dedup_admin_url(business_key: str) -> str | None:
    """The dedup admin's record list searched for ``business_key``, or None without that app."""
    if not apps.is_installed(DEDUP_APP):
        return None
    for model in apps.get_app_config(DEDUP_LABEL).get_models():
        try:
            base = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")
        except NoReverseMatch:
            continue
        return f"{base}?{urlencode({'q': business_key})}"
    return None
