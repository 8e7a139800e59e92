"""``demo_user``: create (or reset) the demo's admin superuser."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User
from django.core.management.base import BaseCommand, CommandParser


class Command(BaseCommand):
    help = "Create the demo superuser, or reset its password if it exists."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--username", default="demo")
        parser.add_argument("--password", default="demo")

    def handle(self, *args: Any, username: str, password: str, **options: Any) -> None:
        user, _ = User.objects.get_or_create(username=username)
        user.is_staff = user.is_superuser = True
        user.set_password(password)
        user.save()
        self.stdout.write(f"superuser {username!r} is ready")
