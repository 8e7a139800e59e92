"""The operator's shell: the ``celery dedup`` command (:mod:`.cli`) and what its ``check`` inspects
(:mod:`.checks`). The actions on keys they share with the admin and scripts are the public
:mod:`celery_dedup.operations`."""
