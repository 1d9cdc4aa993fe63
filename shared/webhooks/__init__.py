"""Webhooks: URL policy (``urls``), Standard Webhooks signing (``signing``), a finished job's event by the API that
created it (``events``) and one guarded POST (``transport``). Delivery, its retries and its log live in the webhook
service (services/webhooks/tasks.py)."""
