"""The store: the only code that runs Lua or reads dedup state in Redis.

:mod:`.store` is :class:`~celery_dedup.store.store.DedupStore` and what its
calls return; :mod:`.status` a record as typed values; :mod:`.scripts` loads
the Lua scripts of ``lua/``; :mod:`.connection` makes the clients.
"""
