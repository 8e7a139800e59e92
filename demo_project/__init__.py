"""A small Django shop whose payments, e-mails, stock syncs and reports run as deduplicated Celery tasks.

Run it with ``python3 run-demo`` from the repository root. Settings:
``demo_project.settings``; Celery app: ``demo_project.celery``.
"""
