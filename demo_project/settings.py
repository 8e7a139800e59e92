"""Django settings of the demo shop.

Environment: ``DEMO_DATA_DIR`` (where the SQLite database lives, default
``demo_project/var/``, which git ignores) and ``REDIS_URL`` (broker, result
backend and dedup store). Without ``REDIS_URL``, the server of the
``run-demo`` running on the same data directory, so that ``manage.py``
commands in another terminal reach it; without that, the default port.
"""

from __future__ import annotations

import os
from pathlib import Path

from demo_project import REDIS_URL_FILE

BASE_DIR = Path(__file__).resolve().parent
DATA_DIR = Path(os.environ.get("DEMO_DATA_DIR", BASE_DIR / "var"))


def _redis_url(default: str = "redis://127.0.0.1:6379/0") -> str:
    """``REDIS_URL``; else the URL a running ``run-demo`` wrote into the data directory; else ``default``."""
    url = os.environ.get("REDIS_URL")
    if url:
        return url
    try:
        return (DATA_DIR / REDIS_URL_FILE).read_text().strip() or default
    except OSError:
        return default


REDIS_URL = _redis_url()

SECRET_KEY = os.environ.get("DEMO_SECRET_KEY", "demo-only-not-secret")
DEBUG = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "[::1]"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "celery_dedup.contrib.django",
    "demo_project.shop",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "demo_project.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]
WSGI_APPLICATION = "demo_project.wsgi.application"

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": DATA_DIR / "db.sqlite3",
        # the web server and the worker processes write at once: wait for the lock
        "OPTIONS": {"timeout": 30},
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"

EMAIL_BACKEND = "django.core.mail.backends.console.EmailBackend"
DEFAULT_FROM_EMAIL = "shop@example.com"

CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = REDIS_URL
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_TASK_SERIALIZER = "json"
CELERY_DEDUP_REAP_INTERVAL = 30
# The mail provider's quota, one for the whole shop: both mail tasks and the order page's "resend
# confirmation" view draw from it (at most 2 sends at a time, 5 a second and 200 an hour).
CELERY_DEDUP_LIMIT_GROUPS = {"mail-provider": {"concurrency": 2, "rate": ["5/s", "200/h"]}}
# the Celery app whose status records the dedup admin shows
CELERY_DEDUP_APP = "demo_project.celery:app"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {
        "celery_dedup": {"handlers": ["console"], "level": "INFO"},
        "demo_project": {"handlers": ["console"], "level": "INFO"},
    },
}
