"""The webhook service: a CPU-only Celery worker on the ``vidq.webhooks`` queue that delivers signed events."""
