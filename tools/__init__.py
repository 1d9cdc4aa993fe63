"""Tooling around the services: the ``vidq`` command and the local dev stack. Services never import this."""
