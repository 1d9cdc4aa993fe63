"""Webhooks: URL policy (``urls``), Standard Webhooks signing (``signing``) and one guarded POST
(``transport``). Delivery, its retries and its log live in the webhook service (services/webhooks/tasks.py)."""
