"""Admin: orders with their lines and charges, and the dedup records of each order's tasks, linked."""

from __future__ import annotations

from django.contrib import admin
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from celery_dedup.store.status import Status

from .dedup_links import DedupRecord, dedup_record
from .models import Charge, ChargeDelivery, EmailLog, InventorySync, Order, OrderLine, SalesReport
from .tasks import charge_payment, send_confirmation_email

#: the record fields the order's change page shows
SHOWN = ("state", "task_id", "duplicates", "skipped", "attempts", "worker", "error")


class OrderLineInline(admin.TabularInline):
    model = OrderLine
    extra = 0
    fields = ("product", "sku", "quantity", "price")
    readonly_fields = ("product",)

    @admin.display(description="product")
    def product(self, line: OrderLine) -> str:
        return line.product_name


class ChargeInline(admin.TabularInline):
    model = Charge
    extra = 0
    fields = readonly_fields = ("amount", "idempotency_key", "task_id", "created")
    can_delete = False


class ChargeDeliveryInline(admin.TabularInline):
    model = ChargeDelivery
    extra = 0
    fields = readonly_fields = ("task_id", "pid", "step", "charge", "created")
    can_delete = False


def linked(item: DedupRecord, text: str) -> SafeString:
    """``text``, linked to the admin page of exactly this record when there is one."""
    return format_html('<a href="{}">{}</a>', item.url, text) if item.url else format_html("{}", text)


def summary(record: Status | None) -> str:
    """``state=succeeded, task_id=..., ...``: the fields of a record worth a glance."""
    shown = [f"{name}={record.fields[name]}" for name in SHOWN if record and record.fields.get(name)]
    return ", ".join(shown) or "no record"


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):
    list_display = ("number", "email", "status", "paid", "emailed", "created", "charge_count", "charge_key_state")
    list_filter = ("status", "paid")
    search_fields = ("number", "email")
    readonly_fields = ("dedup_records",)
    inlines = (OrderLineInline, ChargeInline, ChargeDeliveryInline)

    @admin.display(description="charges")
    def charge_count(self, order: Order) -> int:
        return order.charges.count()

    @admin.display(description="charge key")
    def charge_key_state(self, order: Order) -> SafeString:
        """The state of ``charge_payment``'s record for this order, linked to that record."""
        item = dedup_record(charge_payment, order.pk)
        return linked(item, item.state)

    @admin.display(description="dedup records")
    def dedup_records(self, order: Order) -> SafeString:
        """Each of the order's tasks: its record's key, linked, and what the record says."""
        items = [dedup_record(task, order.pk) for task in (charge_payment, send_confirmation_email)]
        return format_html_join(
            "",
            "<p>{} <code>{}</code>: {}</p>",
            ((item.task_label, linked(item, item.key), summary(item.record)) for item in items),
        )


@admin.register(Charge)
class ChargeAdmin(admin.ModelAdmin):
    list_display = ("order", "amount", "idempotency_key", "task_id", "created")
    search_fields = ("idempotency_key", "task_id")


@admin.register(ChargeDelivery)
class ChargeDeliveryAdmin(admin.ModelAdmin):
    list_display = ("order", "task_id", "pid", "step", "charge", "created")


@admin.register(EmailLog)
class EmailLogAdmin(admin.ModelAdmin):
    list_display = ("order", "recipient", "subject", "task_id", "created")


@admin.register(InventorySync)
class InventorySyncAdmin(admin.ModelAdmin):
    list_display = ("sku", "ordered", "created")


@admin.register(SalesReport)
class SalesReportAdmin(admin.ModelAdmin):
    list_display = ("day", "orders", "revenue", "created")
