"""Putting back the message of a run whose worker died on this machine.

With ``task_acks_late`` a run's message waits in kombu's unacknowledged hash
while the run executes. When the whole worker is killed, nobody acknowledges
or rejects it, and kombu hands it out again only once ``visibility_timeout``
has passed (an hour by default). A process of the same machine can prove
that both the run's owner (its lock token, see
:func:`celery_dedup.worker.processes.owner_gone`) and the main process of the worker
that delivered it (which alone acknowledges, rejects or requeues the message)
are dead: then the message goes back to the head of its queue at once
(where the store is the broker: the atomic gate's path), and its copy takes
the dead owner's lock over (``Delivery.take_over``).

The record says where the message waits: its delivery tag and kombu's
unacknowledged hash. The gate writes them at publish, with the queue list it
pushed to; a run the gate did not route (``while_executing``, or a record
started by its delivery) gets them from that delivery as it starts
(:func:`delivery`), and its message goes back where kombu's own restore
sends it, routed by the exchange and routing key kept beside it.

The run's record names that main process: each delivery writes the token
its worker's main process took when the worker was built (:func:`incarnate`,
:func:`main_token`), so a run is judged by the incarnation that delivered
it, never by whichever worker goes by the same node name now (a restart
whose new worker starts while the old one drains). A pool child that died
under a live main process is left to that process, which settles its
message as Celery's settings say. Workers do this when they start and after
every reaper pass; another machine's runs are left to their lock TTL and the
visibility timeout.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

from .. import runtime
from ..store.broker import restore_unacked
from ..store.store import DedupStore
from .processes import owner_gone, owner_of, token

logger = logging.getLogger("celery_dedup")

#: Started runs looked at per pass, and per page read.
LIMIT, PAGE = 1000, 200


@dataclass(frozen=True)
class Orphan:
    """A started run whose lock owner is provably dead, and where its message waits."""

    member: str
    task: str
    task_id: str
    token: str
    #: The token of the main process of the worker that delivered it.
    main: str
    tag: str
    unacked: str
    #: The list its message was pushed to (priority and global key prefix included);
    #: "" if the gate did not route it (then it goes where kombu would restore it).
    queue: str


def orphans(store: DedupStore, *, limit: int = LIMIT) -> list[Orphan]:
    """Started runs (at most ``limit`` read) whose execution lock was taken by a process now dead.

    Whether their worker's main process is dead too is :func:`recover`'s to ask.
    """
    found: list[Orphan] = []
    cursor: str | None = None
    seen = 0
    while seen < limit:
        page = store.records(state="started", cursor=cursor, limit=min(PAGE, limit - seen))
        for status in page.records:
            tag, unacked = status.fields.get("tag", ""), status.fields.get("unacked", "")
            if status.lock and tag and unacked and owner_gone(status.lock):
                found.append(
                    Orphan(
                        member=status.member,
                        task=status.task,
                        task_id=status.task_id,
                        token=status.lock,
                        main=status.fields.get("main", ""),
                        tag=tag,
                        unacked=unacked,
                        queue=status.queue,
                    )
                )
        seen += len(page.records)
        if page.cursor is None or not page.records:
            break
        cursor = page.cursor
    return found


def restore(app: Any, store: DedupStore, found: list[Orphan]) -> int:
    """Put each orphan's unacknowledged message back at the head of its queue; returns how many.

    As kombu's ``QoS.restore_by_tag`` does (one transaction: out of the
    unacknowledged hash and its index, marked redelivered, pushed where the
    next fetch takes it: onto the list the gate pushed it to, or, for a run
    the gate did not route, the list kombu's restore would route it to by
    the exchange and routing key kept with it), on the store's own
    connection: only where the store
    is the broker (the atomic gate), and only for the unacknowledged hash of
    ``app``'s transport options. A message is left alone when its lock now
    belongs to another delivery (a copy runs), when it is no longer
    unacknowledged (restored or acknowledged already), or when it is not that
    run's.
    """
    if not found or not runtime.is_atomic(app):
        return 0
    unacked, index = unacked_keys(app)
    restored = 0
    with _Router(app) as router:
        for orphan in found:
            if orphan.unacked != unacked:
                continue
            holder = store.lock_holder(orphan.member)
            if holder is not None and holder != orphan.token:
                continue
            route = functools.partial(_gated, orphan.queue) if orphan.queue else router.queues
            if restore_unacked(store.client, unacked, index, orphan.tag, orphan.task_id, route):
                restored += 1
                logger.warning(
                    "recovered: %s[%s] key %r: its process is gone (lock %s); its message is back in its queue",
                    orphan.task,
                    orphan.task_id,
                    orphan.member.partition(":")[2],
                    orphan.token,
                )
    return restored


def unacked_keys(app: Any) -> tuple[str, str]:
    """kombu's unacknowledged hash and its index for ``app``'s transport options (global key prefix included)."""
    options = app.conf.broker_transport_options or {}
    prefix = str(options.get("global_keyprefix") or "")
    return (
        prefix + str(options.get("unacked_key") or "unacked"),
        prefix + str(options.get("unacked_index_key") or "unacked_index"),
    )


def delivery(task: Any) -> tuple[str, str]:
    """The delivery tag of the message ``task`` is running and the unacknowledged hash it waits in.

    ``("", "")`` where recovery could not put it back: the message is
    acknowledged before the body runs (no ``acks_late``), the store is not
    the broker, or the request carries no tag.
    """
    request = task.request
    tag = (getattr(request, "properties", None) or {}).get("delivery_tag")
    if not tag or not task.acks_late:
        return "", ""
    # A message with a delivery tag was fetched from the broker, never run eagerly: whether the store
    # is the broker is the runtime's to say, and where kombu keeps it unacknowledged does not change
    # while a worker runs (its channel read it once too).
    state = runtime.runtime_for(task.app)
    if not state.atomic:
        return "", ""
    if state.unacked_key is None:
        state.unacked_key = unacked_keys(task.app)[0]
    return str(tag), state.unacked_key


class _Router:
    """Where kombu's restore sends a message it kept with its exchange and routing key (``Channel._lookup``).

    The channel, on a connection of the app's broker, is opened on first use:
    only for a message the gate did not route.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self.connection: Any = None

    def __enter__(self) -> _Router:
        return self

    def __exit__(self, *_: object) -> None:
        if self.connection is not None:
            self.connection.release()

    def queues(self, message: dict[str, Any], exchange: str, routing_key: str) -> list[str]:
        """The lists (priority and global key prefix included) kombu would push ``message`` back onto."""
        if self.connection is None:
            self.connection = self.app.connection_for_write()
        channel = self.connection.default_channel
        priority = channel._get_message_priority(message, reverse=False)
        prefix = channel.global_keyprefix
        return [prefix + channel._q_for_pri(queue, priority) for queue in channel._lookup(exchange, routing_key)]


def _gated(queue: str, *_: object) -> list[str]:
    """A message the gate routed goes back to the list it pushed it onto."""
    return [queue]


#: The token of this worker's main process (see :func:`incarnate`); "" outside a worker.
_main = ""


def incarnate() -> str:
    """Take a token for this process as a worker's main process, before its pool forks children.

    Pool children inherit it; every delivery records it (:func:`main_token`).
    """
    global _main  # noqa: PLW0603 - one incarnation per worker process, inherited by its pool
    _main = token()
    return _main


def main_token() -> str:
    """The token of the main process of the worker this process delivers for: itself or its parent.

    "" outside a worker (or in a process that did not inherit it from its
    worker): its runs then wait for ``visibility_timeout`` if killed whole.
    """
    owner = owner_of(_main)
    return _main if owner is not None and owner.pid in (os.getpid(), os.getppid()) else ""


def recover(app: Any, store: DedupStore, *, limit: int = LIMIT) -> int:
    """Restore the messages of ``app``'s started runs whose owner and delivering worker died on this machine.

    Returns how many messages were put back.
    """
    found = orphans(store, limit=limit)
    dead = [orphan for orphan in found if orphan.main and owner_gone(orphan.main)]
    return restore(app, store, dead)
