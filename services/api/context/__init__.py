"""What finished videos are about, for their owners: ``output.context``, similar videos, motion filters."""
