"""The shop's background work, each task deduplicated by the business key its arguments name.

- ``charge_payment``: one charge per order, however often "pay" is pressed.
  Two guards, because each covers what the other cannot: the dedup key
  (held until the charge ran) makes concurrent and repeated presses one run;
  the order's state, claimed by a conditional UPDATE, stops a run that comes
  after that one ended. Dedup windows end, business invariants don't.
  On success it sends the confirmation.
- ``send_confirmation_email``: never two e-mails for an order (held a day,
  even after it was sent), and at most 30 e-mails a minute, the mail
  provider's quota (a rate limit: the rest wait their turn).
- ``sync_inventory``: bursts of orders for a product make one sync, after the
  burst (debounce), at least every ten seconds while it lasts; at most one
  sync talks to the warehouse at a time (a concurrency limit).
- ``daily_sales_report``: at most one run per day's report a minute (throttle).
"""

from __future__ import annotations

import datetime
import logging
import time
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.core.mail import send_mail
from django.db import transaction
from django.db.models import Sum

from celery_dedup import DedupTask
from demo_project.celery import app

from .models import Charge, EmailLog, InventorySync, Order, OrderLine, SalesReport

logger = logging.getLogger(__name__)


def gateway_charge(order: Order, amount: Decimal) -> None:
    """The payment gateway, simulated: it takes ``DEMO_GATEWAY_SECONDS`` (default 1 s) and never declines."""
    time.sleep(getattr(settings, "DEMO_GATEWAY_SECONDS", 1.0))


@app.task(base=DedupTask, bind=True, dedup_key="order:{order_id}")
def charge_payment(self: Any, order_id: int) -> str:
    """Charge the order's total at the (simulated, slow) payment gateway, then confirm by e-mail.

    Charges only a new order: the run first claims it (``new`` -> ``paying``)
    with a conditional UPDATE, which one run at most can win, whatever the
    dedup key says by then. A run that finds the order paid, or being paid,
    charges nothing and says why. If the gateway call fails the claim is
    given back, so "pay" can be pressed again; a worker killed at the gateway
    leaves the order ``paying``, for someone to check with the gateway
    rather than charge blindly twice.
    """
    claimed = Order.objects.filter(pk=order_id, status=Order.Status.NEW).update(status=Order.Status.PAYING)
    order = Order.objects.get(pk=order_id)
    if not claimed:
        refusal: str = order.refusal()
        logger.info("not charging: %s", refusal)
        return refusal
    amount = order.total
    try:
        gateway_charge(order, amount)
    except Exception:  # declined or unreachable: nothing was charged, so the order may be paid again
        Order.objects.filter(pk=order_id, status=Order.Status.PAYING).update(status=Order.Status.NEW)
        raise
    with transaction.atomic():
        charge = Charge.objects.create(order=order, amount=amount, task_id=self.request.id)
        Order.objects.filter(pk=order_id).update(paid=True, status=Order.Status.PAID)
    logger.info("charged %s for order %s", amount, order.number)
    send_confirmation_email.delay(order_id)
    daily_sales_report.delay(order.created.date().isoformat())
    return f"charged {amount} (charge #{charge.pk})"


@app.task(
    base=DedupTask,
    bind=True,
    dedup_key="order:{order_id}",
    dedup_mode="until_expired",
    dedup_ttl=24 * 3600,
    limit_key="mail-provider",
    limit_rate="30/m",
)
def send_confirmation_email(self: Any, order_id: int) -> None:
    """Tell the customer their order is paid (console e-mail backend; logged in ``EmailLog``)."""
    order = Order.objects.get(pk=order_id)
    subject = f"Your order {order.number} is paid"
    send_mail(subject, f"Thank you! We charged {order.total}.", None, [order.email])
    EmailLog.objects.create(order=order, recipient=order.email, subject=subject, task_id=self.request.id)
    Order.objects.filter(pk=order_id).update(emailed=True)


@app.task(
    base=DedupTask,
    dedup_key="sku:{sku}",
    dedup_mode="debounce",
    dedup_window=2,
    dedup_max_wait=10,
    limit_key="warehouse:main",
    limit_concurrency=1,
)
def sync_inventory(sku: str) -> int:
    """Push the quantity ordered of ``sku`` to the warehouse, once per burst of orders."""
    ordered = OrderLine.objects.filter(sku=sku).aggregate(total=Sum("quantity"))["total"] or 0
    InventorySync.objects.create(sku=sku, ordered=ordered)
    return int(ordered)


@app.task(base=DedupTask, dedup_key="day:{day}", dedup_mode="throttle", dedup_window=60)
def daily_sales_report(day: str) -> str:
    """Total the paid orders of ``day`` (ISO date); repeated requests within a minute share one run."""
    date = datetime.date.fromisoformat(day)
    paid = Order.objects.filter(paid=True, created__date=date)
    revenue = sum((order.total for order in paid.prefetch_related("lines")), Decimal("0"))
    SalesReport.objects.create(day=date, orders=paid.count(), revenue=revenue)
    return str(revenue)
