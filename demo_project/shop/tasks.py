"""The shop's background work, each task deduplicated by the business key its arguments name.

- ``charge_payment``: one charge per order, however often "pay" is pressed.
  Two guards, because each covers what the other cannot: the dedup key
  (held until the charge ran) makes concurrent and repeated presses one run;
  the order's state, claimed by a conditional UPDATE, stops a run that comes
  after that one ended. Dedup windows end, business invariants don't. A
  third covers the run itself: the provider call is a step (``dedup_once``),
  so a redelivery after its worker died does not charge again.
  On success it sends the confirmation.
- ``send_confirmation_email``: never two e-mails for an order (held a day,
  even after it was sent). It draws on the mail provider's quota, the named
  limit group ``mail-provider`` (``CELERY_DEDUP_LIMIT_GROUPS``): at most 2
  sends at a time, 5 a second and 200 an hour, shared with
  ``mail_sales_report`` and the order page's "resend confirmation" view (the
  rest wait their turn).
- ``sync_inventory``: bursts of orders for a product make one sync, after the
  burst (debounce), at least every ten seconds while it lasts; at most one
  sync talks to the warehouse at a time (a concurrency limit).
- ``daily_sales_report``: at most one run per day's report a minute (throttle);
  each report is mailed to the shop (``mail_sales_report``, once per report,
  through the same mail quota).
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.core.mail import send_mail
from django.db.models import Sum

from celery_dedup import DedupTask
from demo_project.celery import app

from . import provider
from .models import ChargeDelivery, EmailLog, InventorySync, Order, OrderLine, SalesReport

logger = logging.getLogger(__name__)

#: The named limit group (``CELERY_DEDUP_LIMIT_GROUPS``) every e-mail the shop sends goes through.
MAIL_PROVIDER = "mail-provider"


@app.task(base=DedupTask, bind=True, dedup_key="order:{order_id}", acks_late=True, reject_on_worker_lost=True)
def charge_payment(self: Any, order_id: int) -> str:
    """Charge the order's total at the (simulated, slow) payment provider, once, then confirm by e-mail.

    Charges only a new order: the run first claims it (``new`` -> ``paying``,
    naming itself) with a conditional UPDATE, which one run at most can win,
    whatever the dedup key says by then; a later delivery of the same run (a
    redelivery after its worker died) goes on with its own claim. A run that
    finds the order paid, or being paid by another run, charges nothing and
    says why. The charge is a step (``dedup_once``): a delivery that reaches
    it once it is done gets the stored charge id instead of calling the
    provider, and a delivery whose worker died inside it calls the provider
    again with the same idempotency key, which answers with the charge that
    key made. If the provider call fails the claim is given back, so "pay"
    can be pressed again.

    With the order's ``kill_after_charge`` set, the delivery SIGKILLs its own
    process right after the charge step (once: it clears the flag first).
    ``acks_late`` and ``reject_on_worker_lost`` put the message back at once,
    and the redelivered run skips the charge.
    """
    run = self.request.id
    claimed = Order.objects.filter(pk=order_id, status=Order.Status.NEW).update(
        status=Order.Status.PAYING, payment_run=run
    )
    order = Order.objects.get(pk=order_id)
    if not claimed and not (order.status == Order.Status.PAYING and order.payment_run == run):
        refusal: str = order.refusal()
        logger.info("not charging: %s", refusal)
        return refusal
    amount = order.total
    called: list[provider.Receipt] = []

    def charge_card(key: str) -> int:
        receipt = provider.charge(order_id, amount, idempotency_key=key, task_id=run)
        called.append(receipt)
        return receipt.charge_id

    try:
        charge_id: int = self.dedup_once("charge-card", charge_card)
    except Exception:  # declined or unreachable: nothing was charged, so the order may be paid again
        Order.objects.filter(pk=order_id, status=Order.Status.PAYING, payment_run=run).update(
            status=Order.Status.NEW, payment_run=""
        )
        raise
    step = ChargeDelivery.Step.SKIPPED
    if called:
        step = ChargeDelivery.Step.REPLAYED if called[-1].replayed else ChargeDelivery.Step.CHARGED
    ChargeDelivery.objects.create(order=order, task_id=run, pid=os.getpid(), step=step, charge_id=charge_id)
    if Order.objects.filter(pk=order_id, kill_after_charge=True).update(kill_after_charge=False):
        logger.warning("charged order %s: killing this worker process (pid %s), as asked", order.number, os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)
    Order.objects.filter(pk=order_id).update(paid=True, status=Order.Status.PAID)
    logger.info("charged %s for order %s", amount, order.number)
    send_confirmation_email.delay(order_id)
    daily_sales_report.delay(order.created.date().isoformat())
    return f"charged {amount} (charge #{charge_id})"


@app.task(
    base=DedupTask,
    bind=True,
    dedup_key="order:{order_id}",
    dedup_mode="until_expired",
    dedup_ttl=24 * 3600,
    limit_group=MAIL_PROVIDER,
)
def send_confirmation_email(self: Any, order_id: int) -> None:
    """Tell the customer their order is paid (console e-mail backend; logged in ``EmailLog``)."""
    send_confirmation(Order.objects.get(pk=order_id), sent_by=self.request.id)


def send_confirmation(order: Order, *, sent_by: str) -> EmailLog:
    """Mail ``order``'s confirmation and log it; ``sent_by``: the task id, or what else sent it.

    The caller holds a place in the mail provider's quota: the task by its
    ``limit_group``, the "resend" view with ``celery_dedup.limits.acquire``.
    """
    subject = f"Your order {order.number} is paid"
    send_mail(subject, f"Thank you! We charged {order.total}.", None, [order.email])
    sent: EmailLog = EmailLog.objects.create(order=order, recipient=order.email, subject=subject, task_id=sent_by)
    Order.objects.filter(pk=order.pk).update(emailed=True)
    return sent


@app.task(base=DedupTask, dedup_key="report:{report_id}", limit_group=MAIL_PROVIDER)
def mail_sales_report(report_id: int) -> str:
    """Mail a sales report to the shop (console e-mail backend), through the mail provider's quota."""
    report = SalesReport.objects.get(pk=report_id)
    subject = f"Sales of {report.day}: {report.orders} orders, {report.revenue}"
    send_mail(subject, subject, None, [settings.DEFAULT_FROM_EMAIL])
    return subject


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
    report = SalesReport.objects.create(day=date, orders=paid.count(), revenue=revenue)
    mail_sales_report.delay(report.pk)
    return str(revenue)
