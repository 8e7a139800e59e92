"""The storefront, an order page with a deliberately double-clickable "pay" button (and one that kills the
worker right after the charge), a "resend confirmation" button that draws on the mail tasks' quota, and a JSON
view."""

from __future__ import annotations

from django.contrib import messages
from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from celery_dedup import DedupLimitTimeout, HistoryEntry, StepStatus, limits, operations
from celery_dedup.keys import member_for

from .catalog import BY_SKU, PRODUCTS
from .dedup_links import DedupRecord, dedup_record
from .forms import OrderForm
from .models import Order, OrderLine
from .tasks import MAIL_PROVIDER, charge_payment, send_confirmation, send_confirmation_email, sync_inventory

#: How long the "resend" view waits for a place in the mail provider's quota before it says "try again".
RESEND_WAIT_SECONDS = 5.0


def storefront(request: HttpRequest) -> HttpResponse:
    """List the products; a valid POST places an order and shows it."""
    form = OrderForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        with transaction.atomic():
            order = Order.objects.create(email=form.cleaned_data["email"])
            for sku, quantity in form.quantities().items():
                OrderLine.objects.create(order=order, sku=sku, quantity=quantity, price=BY_SKU[sku].price)
        for sku in form.quantities():
            sync_inventory.delay(sku)
        return redirect("shop:order", order_id=order.pk)
    recent = Order.objects.all()[:10]
    return render(request, "shop/storefront.html", {"form": form, "products": PRODUCTS, "recent": recent})


def order_records(order: Order) -> list[DedupRecord]:
    """The dedup records of the order's tasks, keyed by its id."""
    return [dedup_record(task, order.pk) for task in (charge_payment, send_confirmation_email)]


def last_charge_result(order: Order) -> str | None:
    """What the last charge run of the order returned (charged, or why not), once it succeeded."""
    record = charge_payment.dedup_status(order.pk)
    if not record or record.state != "succeeded":
        return None
    result = charge_payment.AsyncResult(record.task_id).result
    return result if isinstance(result, str) else None


def charge_key_detail(order: Order) -> tuple[list[StepStatus], list[HistoryEntry]]:
    """The charge key's steps and its record's history (oldest first), as the dedup admin's record page shows them."""
    member = member_for(charge_payment.name, charge_payment.dedup_business_key(order.pk))
    detail = operations.detail(charge_payment.app, member)
    history = [HistoryEntry.parse(entry) for entry in reversed(detail.history)]
    return list(detail.steps), history


def order_page(request: HttpRequest, order_id: int) -> HttpResponse:
    order = get_object_or_404(Order.objects.prefetch_related("lines"), pk=order_id)
    records = order_records(order)
    steps, history = charge_key_detail(order)
    context = {
        "order": order,
        "charge": order.charge(),
        "charges": order.charges.count(),
        "charge_list": order.charges.order_by("pk"),
        "deliveries": order.deliveries.all(),
        "steps": steps,
        "history": history,
        "emails": order.emails.count(),
        "key": charge_payment.dedup_business_key(order.pk),
        "records": records,
        "in_flight": any(item.state in ("queued", "started", "retry") for item in records),
        "charge_result": last_charge_result(order),
    }
    return render(request, "shop/order.html", context)


@require_POST
def pay(request: HttpRequest, order_id: int) -> HttpResponse:
    """Ask for the charge: a press while it is held joins the same run; a paid order is not charged again.

    The check here only spares a pointless run; what guarantees one charge is the
    task's claim on the order, since this order may be paid between the check and the call.
    ``kill=1`` (the second button) sets the order's kill switch first: the run's worker
    process is SIGKILLed right after the charge step, and its redelivery finishes the run.
    """
    order = get_object_or_404(Order, pk=order_id)
    if order.paid:
        record = charge_payment.dedup_status(order.pk)
        last = f"its charge key's last run, {record.task_id}, {record.state}" if record else "no charge record"
        messages.info(request, f"{order.refusal()}: nothing was sent or charged ({last}).")
        return redirect("shop:order", order_id=order.pk)
    kill = request.POST.get("kill") == "1"
    if kill:
        Order.objects.filter(pk=order.pk, paid=False).update(kill_after_charge=True)
    result = charge_payment.delay(order.pk)
    if result.deduplicated:
        messages.info(request, f"Already being paid: this press joined run {result.id}.")
    else:
        messages.success(request, f"Payment accepted as run {result.id}.")
    if kill:
        messages.warning(
            request,
            "Its worker process will be killed right after the charge (SIGKILL): watch the run delivered again "
            "skip the charge step.",
        )
    return redirect("shop:order", order_id=order.pk)


@require_POST
def resend_confirmation(request: HttpRequest, order_id: int) -> HttpResponse:
    """Mail a paid order's confirmation again, now, from the web process, within the mail provider's quota.

    The view takes a place in the named limit group the mail tasks use
    (``celery_dedup.limits.acquire``): a slot while it sends and a start in
    each rate window, so tasks and presses together never go past the
    provider's limits. When no place frees within a few seconds it sends
    nothing and says so.
    """
    order = get_object_or_404(Order, pk=order_id)
    if not order.paid:
        messages.info(request, "Not paid yet: there is no confirmation to send.")
        return redirect("shop:order", order_id=order.pk)
    try:
        with limits.acquire(charge_payment.app, MAIL_PROVIDER, timeout=RESEND_WAIT_SECONDS):
            send_confirmation(order, sent_by="resend from the order page")
    except DedupLimitTimeout:
        messages.error(
            request, "The mail provider's quota has no room now (in use, or paused): nothing sent, try again."
        )
        return redirect("shop:order", order_id=order.pk)
    messages.success(request, f"Confirmation sent again to {order.email}.")
    return redirect("shop:order", order_id=order.pk)


def order_json(request: HttpRequest, order_id: int) -> JsonResponse:
    """The order's charges and e-mails, its charge key's status (``Status.as_dict``), steps and history (oldest
    first), the deliveries of its charge run and its last charge's result."""
    order = get_object_or_404(Order, pk=order_id)
    steps, history = charge_key_detail(order)
    return JsonResponse(
        {
            "id": order.pk,
            "number": order.number,
            "status": order.status,
            "total": str(order.total),
            "charges": order.charges.count(),
            "charge_ids": list(order.charges.order_by("pk").values_list("pk", flat=True)),
            "charge_list": [
                {"id": c.pk, "amount": str(c.amount), "idempotency_key": c.idempotency_key, "task_id": c.task_id}
                for c in order.charges.order_by("pk")
            ],
            "deliveries": [
                {"task_id": d.task_id, "pid": d.pid, "step": d.step, "charge_id": d.charge_id}
                for d in order.deliveries.all()
            ],
            "emails": order.emails.count(),
            "charge_key": charge_payment.dedup_business_key(order.pk),
            "charge_dedup": (status.as_dict() if (status := charge_payment.dedup_status(order.pk)) else None),
            "charge_result": last_charge_result(order),
            "steps": [step.as_dict() for step in steps],
            "history": [
                {
                    "at": entry.at.isoformat() if entry.at else None,
                    "state": entry.state,
                    "task_id": entry.task_id,
                    "note": entry.note,
                }
                for entry in history
            ],
            "links": {
                "order": reverse("shop:order", args=[order.pk]),
                **{item.task_label: item.url for item in order_records(order) if item.url},
            },
        }
    )
