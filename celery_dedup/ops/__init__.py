"""The operator's side: actions on keys (:mod:`.operations`), the ``celery dedup`` command (:mod:`.cli`) and
what its ``check`` inspects (:mod:`.checks`)."""
