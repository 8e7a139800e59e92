"""The Django admin over celery-dedup's status records.

Add ``"celery_dedup.contrib.django"`` to ``INSTALLED_APPS`` and, if the Celery
app is not ``celery.current_app``, point ``CELERY_DEDUP_APP`` at it
(``"proj.celery:app"``). The admin's "Celery dedup" section then lists the
records live from Redis: nothing is copied into the database.
"""
