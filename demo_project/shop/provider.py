"""The payment provider, simulated in the demo's database: it honours idempotency keys, as Stripe does.

A charge request carries an idempotency key. The provider keeps every charge
under its key (``Charge.idempotency_key``, unique): a request with a key it
has not seen charges the card; a request with a key it knows charges nothing
and answers with the charge that key made (Stripe's "idempotent replay"),
however the two requests overlapped. That makes the one case a step cannot
settle, a worker killed inside the call, a harmless repeat.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from decimal import Decimal

from django.conf import settings
from django.db import IntegrityError, transaction

from .models import Charge


@dataclass(frozen=True)
class Receipt:
    """The provider's answer: the charge, and whether it was made before under the same key."""

    charge_id: int
    replayed: bool


def charge(order_id: int, amount: Decimal, *, idempotency_key: str, task_id: str) -> Receipt:
    """Charge ``amount`` for the order, once per ``idempotency_key``.

    Takes ``DEMO_GATEWAY_SECONDS`` (default 1 s), as a real provider's round
    trip does, and never declines. ``task_id`` is kept with the charge, as
    the metadata a shop sends along.
    """
    time.sleep(getattr(settings, "DEMO_GATEWAY_SECONDS", 1.0))
    known = Charge.objects.filter(idempotency_key=idempotency_key).first()
    if known is not None:
        return Receipt(known.pk, replayed=True)
    try:
        with transaction.atomic():
            made = Charge.objects.create(
                order_id=order_id, amount=amount, task_id=task_id, idempotency_key=idempotency_key
            )
    except IntegrityError:  # a request with the same key got there first: its charge is the answer
        return Receipt(Charge.objects.get(idempotency_key=idempotency_key).pk, replayed=True)
    return Receipt(made.pk, replayed=False)
