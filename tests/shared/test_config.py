"""Settings: the one place that reads the environment."""

from __future__ import annotations

import pytest

from shared.infra.config import Settings


def test_empty_optional_settings_mean_unset(monkeypatch):
    monkeypatch.setenv("VIDQ_DEVICE", "")
    monkeypatch.setenv("VIDQ_MODEL_DIR", "")
    monkeypatch.setenv("VIDQ_S3_PUBLIC_SECURE", "")
    s = Settings()
    assert (s.device, s.model_dir, s.s3_public_secure) == (None, None, None)


def test_placeholder_secrets_are_refused_in_prod():
    with pytest.raises(ValueError, match="placeholder"):
        Settings(env="prod", s3_secret_key="vidq-dev-secret")
    assert Settings(env="prod", s3_secret_key="a-real-secret-value").env == "prod"


def test_worker_precision_defaults_to_exact_and_takes_only_a_known_tier(monkeypatch):
    monkeypatch.delenv("VIDQ_WORKER_PRECISION", raising=False)
    assert Settings().worker_precision == "exact"
    monkeypatch.setenv("VIDQ_WORKER_PRECISION", "fast")
    assert Settings().worker_precision == "fast"
    monkeypatch.setenv("VIDQ_WORKER_PRECISION", "int8")
    with pytest.raises(ValueError, match="worker_precision"):
        Settings()
