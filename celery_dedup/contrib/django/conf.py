"""Which Celery app the admin shows: ``settings.CELERY_DEDUP_APP``, read on every request."""

from __future__ import annotations

from importlib import import_module

from celery import Celery
from celery.app import app_or_default
from django.conf import settings

from celery_dedup import runtime
from celery_dedup.exceptions import DedupConfigError
from celery_dedup.store.connection import masked_url

SETTING = "CELERY_DEDUP_APP"


def celery_app() -> Celery:
    """The Celery app named by ``CELERY_DEDUP_APP``, or ``celery.current_app`` when unset.

    The setting is a dotted path, ``"proj.celery:app"`` or ``"proj.celery.app"``
    (an app object is accepted too). Read lazily, so ``override_settings`` and
    apps configured after Django starts work.

    Raises:
        DedupConfigError: the path does not import, names no Celery app, or
            names one ``celery_dedup.install`` was not called on.
    """
    value = getattr(settings, SETTING, None)
    if value is None:
        app = app_or_default()
    elif isinstance(value, Celery):
        app = value
    elif isinstance(value, str) and value:
        app = _import(value)
    else:
        raise DedupConfigError(SETTING, value, 'must be a dotted path to a Celery app, like "proj.celery:app"')
    if not runtime.runtime_for(app).installed:
        raise DedupConfigError(SETTING, value, f"celery_dedup.install(app) was not called on Celery app {app.main!r}")
    return app


def _import(path: str) -> Celery:
    module_name, colon, attribute = path.partition(":")
    if not colon:
        module_name, _, attribute = path.rpartition(".")
    if not module_name or not attribute:
        raise DedupConfigError(SETTING, path, 'must be "module:attribute" or "module.attribute"')
    try:
        module = import_module(module_name)
    except ImportError as exc:
        raise DedupConfigError(SETTING, path, f"cannot import {module_name!r}: {exc}") from exc
    found: object = module
    for part in attribute.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise DedupConfigError(SETTING, path, f"{module_name!r} has no attribute {attribute!r}") from None
    if not isinstance(found, Celery):
        raise DedupConfigError(SETTING, path, f"names a {type(found).__name__}, not a Celery app")
    return found


def store_url(app: Celery) -> str:
    """The address of ``app``'s dedup store with passwords masked, for a page saying it cannot be reached."""
    return masked_url(runtime.config_for(app).redis_url or runtime._broker_url(app))
