"""The worker's side: the guard around each delivery, its lock and limits, the endings Celery reports, bootsteps."""
