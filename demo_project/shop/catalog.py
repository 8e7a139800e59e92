"""The products the storefront sells: a fixed list, so the demo needs no product admin."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal


@dataclass(frozen=True)
class Product:
    sku: str
    name: str
    price: Decimal


PRODUCTS: tuple[Product, ...] = (
    Product("TEA-001", "Green tea, 100 g", Decimal("6.50")),
    Product("MUG-002", "Stoneware mug", Decimal("12.00")),
    Product("POT-003", "Cast-iron teapot", Decimal("39.90")),
    Product("BIS-004", "Oat biscuits", Decimal("3.20")),
)
BY_SKU = {product.sku: product for product in PRODUCTS}
