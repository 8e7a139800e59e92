"""The storefront, an order page with a deliberately double-clickable "pay" button, and a JSON view."""

from __future__ import annotations

from django.contrib import messages
from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from .catalog import BY_SKU, PRODUCTS
from .dedup_links import dedup_admin_url
from .forms import OrderForm
from .models import Order, OrderLine
from .tasks import charge_payment, sync_inventory


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


def order_page(request: HttpRequest, order_id: int) -> HttpResponse:
    order = get_object_or_404(Order.objects.prefetch_related("lines"), pk=order_id)
    key = charge_payment.dedup_business_key(order.pk)
    context = {
        "order": order,
        "key": key,
        "charges": order.charges.count(),
        "emails": order.emails.count(),
        "dedup": charge_payment.dedup_status(order.pk),
        "dedup_admin_url": dedup_admin_url(key),
    }
    return render(request, "shop/order.html", context)


@require_POST
def pay(request: HttpRequest, order_id: int) -> HttpResponse:
    """Ask for the charge; a repeated press while it is held is answered with the same run."""
    order = get_object_or_404(Order, pk=order_id)
    result = charge_payment.delay(order.pk)
    if result.deduplicated:
        messages.info(request, f"Already being paid: this press joined run {result.id}.")
    else:
        messages.success(request, f"Payment accepted as run {result.id}.")
    return redirect("shop:order", order_id=order.pk)


def order_json(request: HttpRequest, order_id: int) -> JsonResponse:
    """The order's counts of charges and e-mails and its charge key's status record."""
    order = get_object_or_404(Order, pk=order_id)
    return JsonResponse(
        {
            "id": order.pk,
            "number": order.number,
            "status": order.status,
            "total": str(order.total),
            "charges": order.charges.count(),
            "emails": order.emails.count(),
            "charge_key": charge_payment.dedup_business_key(order.pk),
            "charge_dedup": charge_payment.dedup_status(order.pk),
            "links": {"order": reverse("shop:order", args=[order.pk])},
        }
    )
