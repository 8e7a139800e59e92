"""What the execution guard and bulk publishing know of a keyed task.

They sit below :class:`~celery_dedup.DedupTask`, which only delegates to
them, so they never import it: they take a :class:`KeyedTask`, the part of a
DedupTask they call, and its resolved :class:`~celery_dedup.policy.TaskPolicy`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .header import GateHeader
    from .policy import TaskPolicy
    from .publish.result import DedupResult


class KeyedTask(Protocol):
    """The part of a DedupTask the guard and bulk publishing call (Celery's Task, plus the dedup options)."""

    @property
    def name(self) -> str: ...

    @property
    def app(self) -> Any: ...

    @property
    def serializer(self) -> str: ...

    @property
    def ignore_result(self) -> bool: ...

    @property
    def request(self) -> Any: ...

    @property
    def dedup_policy(self) -> TaskPolicy: ...

    def dedup_gate_header(
        self,
        member: str,
        delay: float = 0.0,
        *,
        continues: bool = False,
        defers: bool = False,
        follows: bool = False,
        fingerprint: str = "",
    ) -> GateHeader: ...

    def AsyncResult(self, task_id: str, **kwargs: Any) -> DedupResult: ...

    def apply_async(self, args: Any = None, kwargs: Any = None, *rest: Any, **options: Any) -> DedupResult: ...

    def retry(self, *args: Any, **kwargs: Any) -> Any: ...

    def signature_from_request(self, request: Any = None, *rest: Any, **extra: Any) -> Any: ...

    def _marked(self, existing_id: str) -> DedupResult: ...
