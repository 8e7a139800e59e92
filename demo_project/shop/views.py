"""The storefront, an order page with a deliberately double-clickable "pay" button, and a JSON view."""

from __future__ import annotations

from django.contrib import messages
from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from .catalog import BY_SKU, PRODUCTS
from .dedup_links import DedupRecord, dedup_record
from .forms import OrderForm
from .models import Order, OrderLine
from .tasks import charge_payment, send_confirmation_email, sync_inventory


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


def order_page(request: HttpRequest, order_id: int) -> HttpResponse:
    order = get_object_or_404(Order.objects.prefetch_related("lines"), pk=order_id)
    records = order_records(order)
    context = {
        "order": order,
        "charge": order.charge(),
        "charges": order.charges.count(),
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
    """
    order = get_object_or_404(Order, pk=order_id)
    if order.paid:
        record = charge_payment.dedup_status(order.pk)
        last = f"its charge key's last run, {record.task_id}, {record.state}" if record else "no charge record"
        messages.info(request, f"{order.refusal()}: nothing was sent or charged ({last}).")
        return redirect("shop:order", order_id=order.pk)
    result = charge_payment.delay(order.pk)
    if result.deduplicated:
        messages.info(request, f"Already being paid: this press joined run {result.id}.")
    else:
        messages.success(request, f"Payment accepted as run {result.id}.")
    return redirect("shop:order", order_id=order.pk)


def order_json(request: HttpRequest, order_id: int) -> JsonResponse:
    """The order's charges and e-mails, its charge key's status (``Status.as_dict``) and its last charge's result."""
    order = get_object_or_404(Order, pk=order_id)
    return JsonResponse(
        {
            "id": order.pk,
            "number": order.number,
            "status": order.status,
            "total": str(order.total),
            "charges": order.charges.count(),
            "charge_ids": list(order.charges.order_by("pk").values_list("pk", flat=True)),
            "emails": order.emails.count(),
            "charge_key": charge_payment.dedup_business_key(order.pk),
            "charge_dedup": (status.as_dict() if (status := charge_payment.dedup_status(order.pk)) else None),
            "charge_result": last_charge_result(order),
            "links": {
                "order": reverse("shop:order", args=[order.pk]),
                **{item.task_label: item.url for item in order_records(order) if item.url},
            },
        }
    )
