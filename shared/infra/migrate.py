"""Run Alembic migrations programmatically (``vidq migrate`` and the services' start-up)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from shared.infra.config import Settings

MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(settings: Settings) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", settings.sqlalchemy_url.replace("%", "%%"))
    return cfg


def upgrade(settings: Settings, revision: str = "head") -> None:
    command.upgrade(alembic_config(settings), revision)
