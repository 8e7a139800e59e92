"""Admin: orders with their lines, each order's charge key state, and what the tasks recorded."""

from __future__ import annotations

from django.contrib import admin
from django.utils.html import format_html

from .dedup_links import dedup_admin_url
from .models import Charge, EmailLog, InventorySync, Order, OrderLine, SalesReport
from .tasks import charge_payment


class OrderLineInline(admin.TabularInline):
    model = OrderLine
    extra = 0


class ChargeInline(admin.TabularInline):
    model = Charge
    extra = 0
    readonly_fields = ("amount", "task_id", "created")
    can_delete = False


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):
    list_display = ("number", "email", "status", "paid", "emailed", "created", "charge_count", "charge_key_state")
    list_filter = ("status", "paid")
    search_fields = ("number", "email")
    readonly_fields = ("charge_key_state", "charge_key_record")
    inlines = (OrderLineInline, ChargeInline)

    @admin.display(description="charges")
    def charge_count(self, order: Order) -> int:
        return order.charges.count()

    @admin.display(description="charge key")
    def charge_key_state(self, order: Order) -> str:
        """The state of ``charge_payment``'s key for this order, linked to the dedup records admin."""
        record = charge_payment.dedup_status(order.pk)
        state = record["state"] if record else "no record"
        url = dedup_admin_url(charge_payment.dedup_business_key(order.pk))
        return format_html('<a href="{}">{}</a>', url, state) if url else state

    @admin.display(description="charge key record")
    def charge_key_record(self, order: Order) -> str:
        record = charge_payment.dedup_status(order.pk) or {}
        shown = ("state", "task_id", "duplicates", "skipped", "attempts", "worker", "error")
        return format_html(
            "<code>{}</code><br>{}",
            charge_payment.dedup_business_key(order.pk),
            ", ".join(f"{name}={record[name]}" for name in shown if record.get(name)) or "no record",
        )


@admin.register(Charge)
class ChargeAdmin(admin.ModelAdmin):
    list_display = ("order", "amount", "task_id", "created")


@admin.register(EmailLog)
class EmailLogAdmin(admin.ModelAdmin):
    list_display = ("order", "recipient", "subject", "task_id", "created")


@admin.register(InventorySync)
class InventorySyncAdmin(admin.ModelAdmin):
    list_display = ("sku", "ordered", "created")


@admin.register(SalesReport)
class SalesReportAdmin(admin.ModelAdmin):
    list_display = ("day", "orders", "revenue", "created")
