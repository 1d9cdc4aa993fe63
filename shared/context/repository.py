"""The context tables (migrations/versions/0010) from the worker and the refit: a described video's row, its
motion assignment in the newest prototype set, and the refit that makes a new set. The API reads them with its own
queries (services/api/context)."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import numpy as np
from pgvector.sqlalchemy import Vector
from sqlalchemy import cast, delete, func, insert, literal, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from shared.context import prototypes
from shared.context.motion import Motion
from shared.models import Job, MotionAssignment, MotionPrototype, MotionPrototypeSet, VideoContext

log = logging.getLogger("vidq.context")


def vector_literal(vector: np.ndarray) -> str:
    """pgvector's text form, ``[v1,v2,…]`` (float32 digits: what the column keeps)."""
    return "[" + ",".join(f"{float(v):.7g}" for v in vector) + "]"


def store_context(
    session: Session,
    *,
    job_id: uuid.UUID,
    tenant_id: uuid.UUID,
    space: str,
    vector: np.ndarray,
    keyframes: int,
    motion: Motion,
) -> None:
    """The video's row; a retried attempt of the same job rewrites it (the same render describes the same)."""
    values: dict[str, Any] = {
        "job_id": job_id,
        "tenant_id": tenant_id,
        "job_created_at": select(Job.created_at).where(Job.id == job_id).scalar_subquery(),
        "space": space,
        "embedding": text_vector(vector),
        "keyframes": keyframes,
        "motion_label": motion.label,
        "motion_descriptor": [float(v) for v in motion.descriptor],
        "motion_tokens": motion.tokens_list(),
    }
    statement = pg_insert(VideoContext).values(values)
    updated = {k: statement.excluded[k] for k in values if k != "job_id"}
    session.execute(statement.on_conflict_do_update(index_elements=["job_id"], set_=updated))


def text_vector(vector: np.ndarray) -> Any:
    """A bound ``vector`` value sent in its text form (no client-side adapter needed)."""
    return cast(literal(vector_literal(vector)), Vector(len(vector)))


def latest_set(session: Session) -> tuple[int, prototypes.Centroids] | None:
    """The newest prototype set's version and centroids; None before the first refit."""
    version = session.scalar(select(func.max(MotionPrototypeSet.version)))
    if version is None:
        return None
    rows = session.execute(
        select(MotionPrototype.class_label, MotionPrototype.index, MotionPrototype.descriptor).where(
            MotionPrototype.version == version
        )
    ).all()
    centroids = prototypes.Centroids.from_rows(
        ((index, descriptor) for label, index, descriptor in rows if label == ""),
        ((label, index, descriptor) for label, index, descriptor in rows if label != ""),
    )
    return version, centroids


def assign_latest(session: Session, *, job_id: uuid.UUID, motion: Motion) -> tuple[int, int, int | None] | None:
    """The video's prototype and variant in the newest set, stored; None before the first refit."""
    latest = latest_set(session)
    if latest is None:
        return None
    version, centroids = latest
    prototype, variant = prototypes.assign(centroids, motion.descriptor, motion.label)
    statement = pg_insert(MotionAssignment).values(
        job_id=job_id, version=version, prototype=prototype, variant_class=motion.label, variant=variant
    )
    session.execute(
        statement.on_conflict_do_update(
            index_elements=["job_id", "version"],
            set_={"prototype": prototype, "variant_class": motion.label, "variant": variant},
        )
    )
    return version, prototype, variant


def refit(session: Session, *, seed: int = 0, keep_sets: int = 5) -> int | None:
    """Fit a new prototype set from every stored descriptor, assign every described video to it, and prune sets
    beyond the newest ``keep_sets``. Returns the new version; None when no video is described yet. The caller
    commits (one transaction: readers see the whole new set or none of it)."""
    rows = session.execute(select(VideoContext.job_id, VideoContext.motion_label, VideoContext.motion_descriptor)).all()
    if not rows:
        return None
    descriptors = np.array([row.motion_descriptor for row in rows], dtype=np.float64)
    fitted = prototypes.fit(descriptors, [row.motion_label for row in rows], seed=seed)
    version = session.scalar(
        insert(MotionPrototypeSet)
        .values(videos=fitted.videos, params=fitted.params)
        .returning(MotionPrototypeSet.version)
    )
    assert version is not None
    prototype_rows: list[dict[str, Any]] = [
        {
            "version": version,
            "class_label": "",
            "index": p.index,
            "descriptor": list(p.descriptor),
            "label": p.label,
            "members": p.members,
        }
        for p in fitted.prototypes
    ]
    prototype_rows += [
        {
            "version": version,
            "class_label": v.label,
            "index": v.index,
            "descriptor": list(v.descriptor),
            "label": v.label,
            "members": v.members,
        }
        for v in fitted.variants
    ]
    session.execute(insert(MotionPrototype), prototype_rows)
    # Every assignment in one statement: arrays in, unnest on the server.
    session.execute(
        text(
            "INSERT INTO motion_assignments (job_id, version, prototype, variant_class, variant) "
            "SELECT j, :version, p, c, v FROM unnest(CAST(:jobs AS uuid[]), CAST(:prototypes AS int[]), "
            "CAST(:classes AS text[]), CAST(:variants AS int[])) AS t(j, p, c, v)"
        ),
        {
            "version": version,
            "jobs": [row.job_id for row in rows],
            "prototypes": [int(v) for v in fitted.global_index],
            "classes": [row.motion_label for row in rows],
            "variants": [int(v) for v in fitted.variant_index],
        },
    )
    stale = select(MotionPrototypeSet.version).order_by(MotionPrototypeSet.version.desc()).offset(keep_sets)
    session.execute(delete(MotionPrototypeSet).where(MotionPrototypeSet.version.in_(stale.scalar_subquery())))
    log.info(
        "motion prototypes refitted",
        extra={"version": str(version), "videos": str(fitted.videos), "prototypes": str(len(fitted.prototypes))},
    )
    return int(version)
