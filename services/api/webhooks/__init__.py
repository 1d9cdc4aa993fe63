"""``/v1/jobs/{id}/webhooks`` and ``/v1/webhooks``: the delivery log, failing deliveries, redelivery."""
