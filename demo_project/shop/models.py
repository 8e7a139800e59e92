"""Orders and what the background tasks did for them, so "exactly once" can be counted."""

from __future__ import annotations

import secrets
from decimal import Decimal

from django.db import models

from .catalog import BY_SKU


def new_order_number() -> str:
    return secrets.token_hex(4).upper()


class Order(models.Model):
    class Status(models.TextChoices):
        NEW = "new", "new"
        #: a charge run has claimed the order and is at the payment gateway
        PAYING = "paying", "paying"
        PAID = "paid", "paid"

    number = models.CharField(max_length=16, unique=True, default=new_order_number)
    email = models.EmailField("customer e-mail")
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.NEW)
    #: the charge run that claimed the order (``paying``): its own redelivered copy may go on, no other run
    payment_run = models.CharField(max_length=255, blank=True, default="")
    #: the demo's kill switch: the charge run SIGKILLs its own worker process right after the charge step
    kill_after_charge = models.BooleanField("kill the worker after charging", default=False)
    created = models.DateTimeField(auto_now_add=True)
    paid = models.BooleanField(default=False)
    emailed = models.BooleanField("confirmation sent", default=False)

    class Meta:
        ordering = ("-created",)

    def __str__(self) -> str:
        return f"order {self.number}"

    @property
    def total(self) -> Decimal:
        return sum((line.subtotal for line in self.lines.all()), Decimal("0"))

    def charge(self) -> Charge | None:
        """The charge that paid this order, if it is paid."""
        return self.charges.order_by("pk").first()

    def refusal(self) -> str:
        """Why a charge of this order, no longer new, is refused: paid (by which charge) or being paid."""
        if self.paid:
            charge = self.charge()
            return f"Order {self.number} is already paid (charge #{charge.pk if charge else '?'})"
        return f"Order {self.number} is being paid by another run"


class OrderLine(models.Model):
    order = models.ForeignKey(Order, related_name="lines", on_delete=models.CASCADE)
    sku = models.CharField(max_length=32)
    quantity = models.PositiveIntegerField()
    price = models.DecimalField(max_digits=10, decimal_places=2)

    def __str__(self) -> str:
        return f"{self.quantity} x {self.product_name}"

    @property
    def product_name(self) -> str:
        product = BY_SKU.get(self.sku)
        return product.name if product else self.sku

    @property
    def subtotal(self) -> Decimal:
        return self.price * self.quantity


class Charge(models.Model):
    """One charge the (simulated) payment provider made: more than one per order is the bug this demo prevents.

    The provider keeps them by idempotency key (see ``provider.py``): a second
    request with a key it knows gets the charge that key made, as Stripe answers.
    """

    order = models.ForeignKey(Order, related_name="charges", on_delete=models.CASCADE)
    amount = models.DecimalField(max_digits=10, decimal_places=2)
    task_id = models.CharField(max_length=255)
    #: the key the charge was requested with (the charge step's); null for charges made before there were keys
    idempotency_key = models.CharField(max_length=255, unique=True, null=True, blank=True)
    created = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"charge #{self.pk} of {self.amount} for order {self.order.number}"


class ChargeDelivery(models.Model):
    """One delivery of a charge run that reached its charge step: which process ran it, and what the step did."""

    class Step(models.TextChoices):
        #: the step called the provider, which made the charge
        CHARGED = "charged", "charged"
        #: the step was in doubt (its executor died inside it) and called the provider again with its key:
        #: the provider answered with the charge that key had made
        REPLAYED = "replayed", "replayed"
        #: the step was done by an earlier delivery: the provider was not called, its stored charge id returned
        SKIPPED = "skipped", "skipped"

    order = models.ForeignKey(Order, related_name="deliveries", on_delete=models.CASCADE)
    task_id = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
    step = models.CharField(max_length=8, choices=Step.choices)
    charge = models.ForeignKey(Charge, related_name="deliveries", null=True, on_delete=models.SET_NULL)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ("pk",)
        verbose_name_plural = "charge deliveries"

    def __str__(self) -> str:
        return f"{self.task_id} in pid {self.pid}: {self.step}"

    @property
    def what(self) -> str:
        """What the charge step did in this delivery, for people."""
        number = f"charge #{self.charge_id}" if self.charge_id else "no charge"
        step = self.Step(self.step)
        if step is self.Step.SKIPPED:
            return f"skipped: done by an earlier delivery ({number}, the step's stored value)"
        if step is self.Step.REPLAYED:
            return f"called the provider again with the step's key: it answered with {number}, made before"
        return f"called the provider: {number}"


class EmailLog(models.Model):
    """One confirmation e-mail sent."""

    order = models.ForeignKey(Order, related_name="emails", on_delete=models.CASCADE)
    recipient = models.EmailField()
    subject = models.CharField(max_length=200)
    task_id = models.CharField(max_length=255)
    created = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.subject} to {self.recipient}"


class InventorySync(models.Model):
    """One push of a product's ordered quantity to the (imaginary) warehouse."""

    sku = models.CharField(max_length=32)
    ordered = models.PositiveIntegerField()
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name_plural = "inventory syncs"

    def __str__(self) -> str:
        return f"{self.sku}: {self.ordered} ordered"


class SalesReport(models.Model):
    """One run of the daily sales report."""

    day = models.DateField()
    orders = models.PositiveIntegerField()
    revenue = models.DecimalField(max_digits=12, decimal_places=2)
    created = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"sales of {self.day}: {self.orders} orders, {self.revenue}"
