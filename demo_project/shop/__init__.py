"""The shop app: orders, their charges and e-mails, and the Celery tasks behind them."""
