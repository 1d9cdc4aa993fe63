"""``/v1/admin``: operators' endpoints."""
