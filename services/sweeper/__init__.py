"""The sweeper service: the loop that re-sends lost jobs, recovers dead workers' jobs and ages low jobs up.
Runs as ``vidq sweep`` or as a thread inside the API (``VIDQ_SWEEPER_IN_API``)."""
