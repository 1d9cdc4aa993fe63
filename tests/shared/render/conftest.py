"""Render tests build every model in process: no test may reach a model hub."""

from __future__ import annotations

import os

# Set before anything imports huggingface_hub, which reads it once at import time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
