"""What every process stands on: settings, Postgres, S3, logs, traces, liveness files, the URL policy."""
