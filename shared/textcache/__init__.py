"""The text-embedding cache (L1/L2/L3), its hit-rate monitors and the prewarmer's protocol.

``monitor`` (and this package) import no torch: the API and the CLI read the monitors. ``factory`` builds the
cache a process uses from its settings.
"""
