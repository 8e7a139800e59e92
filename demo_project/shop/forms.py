"""The storefront's order form: an e-mail address and a quantity per product."""

from __future__ import annotations

from typing import Any

from django import forms

from .catalog import PRODUCTS


class OrderForm(forms.Form):
    email = forms.EmailField(label="Your e-mail")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for product in PRODUCTS:
            self.fields[f"qty_{product.sku}"] = forms.IntegerField(
                label=f"{product.name} ({product.price})", min_value=0, max_value=99, initial=0
            )

    def quantities(self) -> dict[str, int]:
        """Quantity ordered per SKU, only the products actually ordered."""
        wanted = {product.sku: self.cleaned_data[f"qty_{product.sku}"] for product in PRODUCTS}
        return {sku: qty for sku, qty in wanted.items() if qty}

    def clean(self) -> dict[str, Any] | None:
        cleaned = super().clean()
        if not self.errors and not self.quantities():
            raise forms.ValidationError("Choose at least one product.")
        return cleaned
