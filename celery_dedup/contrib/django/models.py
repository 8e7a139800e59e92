"""An admin entry without a table: the records live in Redis, the permissions in Django."""

from __future__ import annotations

from django.db import models


class Record(models.Model):
    """Stands for the status records in Redis in the admin index and in permissions.

    ``view_record`` lets staff list and inspect records; ``change_record``
    also lets them release keys, purge finished records and re-enqueue runs.
    Never queried: it has no table (``managed = False``).
    """

    class Meta:
        managed = False
        default_permissions = ("view", "change")
        verbose_name = "status record"
        verbose_name_plural = "status records"

    def __str__(self) -> str:
        return str(self.pk) if self.pk is not None else "status records"

    @classmethod
    def standing_for(cls, member: str | None) -> Record:
        """An unsaved stand-in for ``member``'s record (all records for None), for the admin's log.

        Its pk is the member, so a log entry links to the record's page.
        """
        record = cls()
        record.pk = member
        return record
