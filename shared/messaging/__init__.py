"""What travels between processes: queues, the broker's wire format, sends that follow a commit, progress."""
