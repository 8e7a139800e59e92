"""``storm``: prove "exactly one charge per order" under a storm of duplicate pay requests.

Creates N orders, races K ``charge_payment`` sends per order from M
processes, waits for the worker to run what was accepted, counts the
``Charge`` rows of every order and prints a Markdown table. On a terminal a
progress line shows the sends and the charges meanwhile; the dedup decisions
of the senders are logged only with ``--verbosity 2``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser, OutputWrapper
from django.db import transaction

from demo_project.celery import app
from demo_project.shop.models import Charge, Order, OrderLine
from demo_project.shop.storm import IN_FLIGHT, StormError, race
from demo_project.shop.tasks import charge_payment


class Command(BaseCommand):
    help = "Race duplicate charge_payment sends for new orders and count the charges (needs a running worker)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--orders", type=int, default=10, help="orders to create (default 10)")
        parser.add_argument("--processes", type=int, default=4, help="racing sender processes (default 4)")
        parser.add_argument("--sends", type=int, default=20, help="charge_payment sends per order (default 20)")
        parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the worker")

    def handle(
        self, *args: Any, orders: int, processes: int, sends: int, timeout: float, verbosity: int, **options: Any
    ) -> None:
        if min(orders, processes, sends) < 1:
            raise CommandError("--orders, --processes and --sends must be at least 1")
        if not app.control.ping(timeout=2.0):
            raise CommandError(
                "no Celery worker answered a ping within 2 s: start the demo with `python3 run-demo` "
                "(or `celery -A demo_project.celery worker`) against the same REDIS_URL"
            )
        order_ids = self.create_orders(orders)
        progress = Progress(self.stderr, calls=orders * sends, orders=orders)
        started = time.monotonic()
        try:
            tally = race(order_ids, sends, processes, timeout, quiet=verbosity < 2, progress=progress.sent)
            published = time.monotonic() - started
            self.wait_until_done(order_ids, started + timeout, progress.charged)
        except StormError as exc:
            raise CommandError(str(exc)) from exc
        finally:
            progress.end()
        elapsed = time.monotonic() - started
        charges = Counter(Charge.objects.filter(order_id__in=order_ids).values_list("order_id", flat=True).order_by())
        executions = [charges[order_id] for order_id in order_ids]
        ids_per_order = [len(tally.task_ids.get(order_id, ())) for order_id in order_ids]
        wrong = sum(1 for count in executions if count != 1)
        rows = [
            ("orders", orders),
            ("processes", processes),
            ("sends per order", sends),
            ("calls", tally.calls),
            ("accepted", tally.accepted),
            ("deduplicated", tally.deduplicated),
            ("task ids seen per order (expected 1)", spread(ids_per_order)),
            ("charges per order (expected 1)", spread(executions)),
            ("orders not charged exactly once", wrong),
            ("time to publish", f"{published:.2f} s"),
            ("time until all charged", f"{elapsed:.2f} s"),
        ]
        self.stdout.write("| measure | value |\n|---|---|")
        for name, value in rows:
            self.stdout.write(f"| {name} | {value} |")
        if wrong:
            raise CommandError(f"{wrong} of {orders} orders were not charged exactly once")

    def create_orders(self, count: int) -> list[int]:
        with transaction.atomic():
            created = [Order.objects.create(email="storm@example.com") for _ in range(count)]
            OrderLine.objects.bulk_create(
                OrderLine(order=order, sku="TEA-001", quantity=1, price=Decimal("6.50")) for order in created
            )
        return [order.pk for order in created]

    def wait_until_done(self, order_ids: list[int], deadline: float, progress: Callable[[int], None]) -> None:
        """Until every order's charge key has a record that is no longer in flight."""
        pending = list(order_ids)
        while pending:
            pending = [order_id for order_id in pending if _in_flight(order_id)]
            progress(len(order_ids) - len(pending))
            if not pending:
                return
            if time.monotonic() > deadline:
                raise CommandError(f"the worker did not finish the charges of orders {pending} in time")
            time.sleep(0.1)


class Progress:
    """One line on a terminal, redrawn in place: the sends made, then the orders whose charge is over.

    Draws nothing where the output is not a terminal (a pipe, a file, a test).
    """

    WIDTH = 24

    def __init__(self, out: OutputWrapper, *, calls: int, orders: int) -> None:
        self.out = out
        self.shown = out.isatty()
        self.calls, self.orders = calls, orders
        self.done_calls = self.done_orders = 0
        self.drawn: tuple[int, int] | None = None

    def sent(self, calls: int) -> None:
        self.done_calls = calls
        self.draw()

    def charged(self, orders: int) -> None:
        self.done_orders = orders
        self.draw()

    def draw(self) -> None:
        if not self.shown or self.drawn == (self.done_calls, self.done_orders):
            return
        line = (
            f"\r{bar(self.done_calls, self.calls, self.WIDTH)} {self.done_calls}/{self.calls} sends   "
            f"{bar(self.done_orders, self.orders, self.WIDTH)} {self.done_orders}/{self.orders} orders done"
        )
        self.out.write(line, style_func=plain, ending="")
        self.out.flush()
        self.drawn = (self.done_calls, self.done_orders)

    def end(self) -> None:
        """Leave the last state on screen and move to the next line."""
        if self.drawn:
            self.out.write("", style_func=plain)


def plain(text: str) -> str:
    """No style: stderr's default is the colour of errors."""
    return text


def bar(done: int, total: int, width: int) -> str:
    """``[######------]``: ``done`` of ``total`` as a bar ``width`` characters wide."""
    filled = width * done // total if total else width
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def _in_flight(order_id: int) -> bool:
    record = charge_payment.dedup_status(order_id)
    return record is None or record.state in IN_FLIGHT


def spread(values: list[int]) -> str:
    """``"1"`` when all values are 1, else ``"min 0, max 3"``."""
    low, high = min(values), max(values)
    return str(low) if low == high else f"min {low}, max {high}"
