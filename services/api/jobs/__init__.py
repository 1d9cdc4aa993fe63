"""``/v1/jobs``: submit, read, list, cancel, and a job's progress stream."""
