"""Shop URLs."""

from __future__ import annotations

from django.urls import path

from . import views

app_name = "shop"
urlpatterns = [
    path("", views.storefront, name="storefront"),
    path("orders/<int:order_id>/", views.order_page, name="order"),
    path("orders/<int:order_id>/pay/", views.pay, name="pay"),
    path("orders/<int:order_id>/resend/", views.resend_confirmation, name="resend"),
    path("orders/<int:order_id>.json", views.order_json, name="order-json"),
]
