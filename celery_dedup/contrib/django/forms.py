"""The confirmation forms of the admin's actions."""

from __future__ import annotations

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
