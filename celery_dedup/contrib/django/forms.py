"""The confirmation forms of the admin's actions."""

from __future__ import annotations

import datetime
from typing import Any

from django import forms

from celery_dedup.store.status import ENDED_STATES


class ReleaseForm(forms.Form):
    """Release a key; ``token`` is the lock owner shown on the confirmation page."""

    force = forms.BooleanField(
        required=False,
        label="Force: delete the live execution lock",
        help_text="Only if the worker running it is surely gone. The lock is deleted only if it still "
        "belongs to the owner shown here.",
    )
    token = forms.CharField(required=False, widget=forms.HiddenInput)


class PurgeForm(forms.Form):
    """Which ended states to purge."""

    states = forms.MultipleChoiceField(
        choices=[(state, state) for state in ENDED_STATES],
        initial=list(ENDED_STATES),
        widget=forms.CheckboxSelectMultiple,
        label="Records in these states",
    )


#: The Limit groups page's actions: what each button does to a named group (or one key of it).
LIMIT_ACTIONS = {
    "set": "Set override",
    "clear": "Clear override",
    "pause": "Pause",
    "resume": "Resume",
}


class LimitActionForm(forms.Form):
    """A change to a named limit group at run time; the values are checked by ``celery_dedup.limits``."""

    action = forms.ChoiceField(choices=list(LIMIT_ACTIONS.items()))
    group = forms.CharField(label="Group")
    key = forms.CharField(
        required=False, strip=False, label="Key", help_text="One key of the group; empty: the whole group."
    )
    concurrency = forms.IntegerField(required=False, label="Concurrency")
    rate = forms.CharField(
        required=False, label="Rate", help_text="One or more of R/s, R/m, R/h, R/d, comma-separated."
    )
    seconds = forms.FloatField(required=False, label="Pause for (seconds)")
    until = forms.DateTimeField(required=False, label="Pause until", help_text="Empty, and no seconds: until resumed.")

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        action = data.get("action")
        if action == "set" and data.get("concurrency") is None and not self.rates():
            raise forms.ValidationError("Give a concurrency, a rate or both.")
        if action == "pause" and data.get("seconds") is not None and data.get("until") is not None:
            raise forms.ValidationError("Pause for some seconds or until a time, not both.")
        if action == "pause" and data.get("seconds") is not None and data["seconds"] <= 0:
            raise forms.ValidationError("Pause for more than 0 seconds.")
        return data

    def rates(self) -> list[str]:
        """The rates given, each as written."""
        return [part.strip() for part in (self.cleaned_data.get("rate") or "").split(",") if part.strip()]

    def target_key(self) -> str | None:
        """The key acted on; None: the whole group."""
        key: str = self.cleaned_data.get("key") or ""
        return key or None

    def pause_end(self) -> datetime.datetime | datetime.timedelta | None:
        """When a pause ends: a time, a time from now, or None (until resumed)."""
        seconds = self.cleaned_data.get("seconds")
        if seconds is not None:
            return datetime.timedelta(seconds=seconds)
        until: datetime.datetime | None = self.cleaned_data.get("until")
        return until
