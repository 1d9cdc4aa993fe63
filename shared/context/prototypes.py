"""Motion prototypes: the stored motion descriptors clustered in two stages, so the jobs list can be filtered by a
kind of motion finer than its readable label.

Stage 1 clusters every video's descriptor (``motion.DESCRIPTOR``: tx, ty, divergence, curl, residual, half-widths
per frame) into at most ``GLOBAL_K`` = 64 global prototypes; stage 2 clusters each readable label's videos (the
class is ``motion.label`` of the video, as stored) into at most ``VARIANTS`` = 8 variants. Both stages are
scikit-learn's ``MiniBatchKMeans`` (``N_INIT`` = 3 initialisations, batches of ``BATCH_SIZE`` = 1024, one thread)
seeded by the caller, so one input and one seed give one result. A stage asked for at least as many clusters as it
has distinct points takes the distinct points themselves as its centroids. Each video belongs to its nearest global
prototype and to the nearest variant of its class; centroids no video is nearest to are dropped, and indexes count
from the prototype with the most members down.

The clustering space. The components span orders of magnitude — a barely moving camera drifts 0.001 half-widths
per frame, a whip pan 0.2 — so Euclidean k-means on raw values would spend every centroid on the fast clips and
pile the slow ones onto the static prototype. Each component is mapped by a signed log1p of its size relative to a
fixed scale: ``f(x) = sign(x)·log1p(|x| / scale)``, linear (and sign-aware) below the scale, logarithmic above it,
so ten times faster is one step of nearly log(10) at any speed above the scale (0.005 to 0.05 is 1.9, 0.05 to 0.5
is 2.25), slow pans keep clear of the still clips and fast ones of the zooms. The scales are motion's thresholds
in the units its labels compare (``SCALE``): ``STATIC_BELOW`` = 0.003 for tx and ty; ``STATIC_BELOW / (RADIUS /
2)`` = 0.012 for divergence and curl, since a zoom or roll moves the fitted points by a quarter of its divergence
or curl on average, so equal strengths in ``motion.label``'s sense are equal features; ``SUBJECT_BELOW`` = 0.01
for the residual, the subjects' own motion. Everything ``motion.label`` calls static lies within
log1p(1) ≈ 0.69 of the origin in each camera component.

The map is invertible, and a prototype's descriptor (what is stored, in raw units) is the inverse of its centroid,
so ``motion.label`` of it is the prototype's readable label and re-mapping it gives the centroid back: assignments
made between refits from the stored descriptors (``Centroids``, ``assign``) agree with the refit's own, which are
computed the same way. A variant's label is its class; at a class's borders (``mixed`` above all) the label of its
centroid's descriptor can differ.

Users name prototypes in ``GET /v1/jobs?motion=``: a label (``pan_left``), a global prototype ``m{version}.{index}``
(``m3.17``) or a variant ``m{version}.{label}.{index}`` (``m3.pan_left.2``); the version is the prototype set's,
chosen by whoever stores it. ``parse_motion_filter`` reads those strictly: canonical decimal numbers only (no sign,
no leading zeros, at most ``MAX_NUMBER``, Postgres's integer), known labels only, nothing around them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from shared.context import motion
from shared.context.ids import (  # noqa: F401  (users' ids are read and written where the API can import them)
    MAX_NUMBER,
    MotionFilter,
    parse_motion_filter,
    prototype_id,
    variant_id,
)

GLOBAL_K = 64
VARIANTS = 8
N_INIT = 3
BATCH_SIZE = 1024
TRANSFORM = "signed_log1p"
SCALE = (
    motion.STATIC_BELOW,
    motion.STATIC_BELOW,
    motion.STATIC_BELOW / (motion.RADIUS / 2),
    motion.STATIC_BELOW / (motion.RADIUS / 2),
    motion.SUBJECT_BELOW,
)
_WIDTH = len(motion.DESCRIPTOR)
_SCALE = np.array(SCALE, dtype=np.float64)
_CHUNK = 8192  # rows per distance block: 8192 × 64 × 5 float64 is 21 MB


def to_features(descriptors: np.ndarray) -> np.ndarray:
    """The clustering space: ``sign(x)·log1p(|x| / SCALE)`` per component, of (n, 5) or (5,) descriptors."""
    raw = np.asarray(descriptors, dtype=np.float64)
    return np.sign(raw) * np.log1p(np.abs(raw) / _SCALE)


def from_features(features: np.ndarray) -> np.ndarray:
    """The inverse of ``to_features``: descriptors in half-widths per frame."""
    mapped = np.asarray(features, dtype=np.float64)
    return np.sign(mapped) * np.expm1(np.abs(mapped)) * _SCALE


@dataclass(frozen=True, slots=True)
class Prototype:
    """A global prototype: its index in the set, its centroid as a descriptor, that descriptor's label."""

    index: int
    descriptor: tuple[float, ...]  # motion.DESCRIPTOR, raw units
    label: str  # motion.label(descriptor)
    members: int


@dataclass(frozen=True, slots=True)
class Variant:
    """A variant of one readable label: the label (its class), its index within the class, its centroid."""

    label: str
    index: int
    descriptor: tuple[float, ...]  # motion.DESCRIPTOR, raw units
    members: int


@dataclass(frozen=True, slots=True)
class Centroids:
    """What ``assign`` needs: the global centroids (row = index) and each class's variant centroids (row = index),
    as descriptors in raw units. Build it from stored rows with ``from_rows`` or take ``Fit.centroids``."""

    prototypes: np.ndarray  # (k, 5), read-only
    variants: Mapping[str, np.ndarray]  # label → (v, 5), read-only

    def __post_init__(self) -> None:
        prototypes = _frozen(_check_descriptors(self.prototypes, "prototype centroids"))
        if len(prototypes) == 0:
            raise ValueError("centroids need at least one global prototype")
        variants: dict[str, np.ndarray] = {}
        for name in motion.LABELS:  # a fixed order, whatever the mapping's
            if name in self.variants:
                rows = _check_descriptors(self.variants[name], f"{name} variant centroids")
                if len(rows):
                    variants[name] = _frozen(rows)
        unknown = set(self.variants) - set(motion.LABELS)
        if unknown:
            raise ValueError(f"variants of unknown labels {sorted(unknown)}; labels are {', '.join(motion.LABELS)}")
        object.__setattr__(self, "prototypes", prototypes)
        object.__setattr__(self, "variants", MappingProxyType(variants))

    @classmethod
    def from_rows(
        cls,
        prototypes: Iterable[tuple[int, Sequence[float]]],
        variants: Iterable[tuple[str, int, Sequence[float]]] = (),
    ) -> Centroids:
        """From stored rows: (index, descriptor) per global prototype and (label, index, descriptor) per variant,
        in any order; the indexes of each set must be 0, 1, … without gaps."""
        global_rows: dict[int, Sequence[float]] = {}
        for index, row in prototypes:
            _put(global_rows, int(index), row, f"global prototype {index}")
        grouped: dict[str, dict[int, Sequence[float]]] = {}
        for name, index, row in variants:
            _put(grouped.setdefault(str(name), {}), int(index), row, f"variant {name}.{index}")
        return cls(
            prototypes=np.array(_contiguous(global_rows, "global prototypes"), dtype=np.float64).reshape(-1, _WIDTH),
            variants={
                name: np.array(_contiguous(rows, f"{name} variants"), dtype=np.float64).reshape(-1, _WIDTH)
                for name, rows in grouped.items()
            },
        )


@dataclass(frozen=True, slots=True)
class Fit:
    """One refit: the prototypes, the variants, and each input video's (global index, variant index)."""

    prototypes: tuple[Prototype, ...]
    variants: tuple[Variant, ...]  # by class (motion.LABELS order), then index
    global_index: np.ndarray  # (n,) int64, read-only: input i's prototype
    variant_index: np.ndarray  # (n,) int64, read-only: input i's variant within its class
    global_k: int
    variants_k: int
    seed: int

    @property
    def videos(self) -> int:
        return len(self.global_index)

    @property
    def centroids(self) -> Centroids:
        grouped: dict[str, list[tuple[float, ...]]] = {}
        for variant in self.variants:
            grouped.setdefault(variant.label, []).append(variant.descriptor)
        return Centroids(
            prototypes=np.array([p.descriptor for p in self.prototypes], dtype=np.float64),
            variants={name: np.array(rows, dtype=np.float64) for name, rows in grouped.items()},
        )

    @property
    def params(self) -> dict[str, Any]:
        """A new JSON-able dict of what produced this fit, for the prototype set's row."""
        import sklearn

        return {
            "algorithm": "MiniBatchKMeans",
            "sklearn": sklearn.__version__,
            "global_k": self.global_k,
            "variants": self.variants_k,
            "seed": self.seed,
            "n_init": N_INIT,
            "batch_size": BATCH_SIZE,
            "transform": TRANSFORM,
            "descriptor": list(motion.DESCRIPTOR),
            "scale": [float(s) for s in SCALE],
            "videos": self.videos,
            "prototypes": len(self.prototypes),
            "variant_counts": {
                name: sum(1 for v in self.variants if v.label == name)
                for name in motion.LABELS
                if any(v.label == name for v in self.variants)
            },
        }

    def assignment(self, i: int) -> tuple[int, int]:
        """Input ``i``'s (global index, variant index)."""
        return int(self.global_index[i]), int(self.variant_index[i])

    def variants_of(self, label: str) -> tuple[Variant, ...]:
        return tuple(v for v in self.variants if v.label == label)


def fit(
    descriptors: np.ndarray,
    labels: Sequence[str],
    *,
    global_k: int = GLOBAL_K,
    variants: int = VARIANTS,
    seed: int = 0,
) -> Fit:
    """Prototypes and variants of (n, 5) descriptors whose readable labels are ``labels`` (one per row)."""
    raw = _check_descriptors(descriptors, "descriptors")
    if len(raw) == 0:
        raise ValueError("fitting motion prototypes needs at least one descriptor")
    classes = [str(name) for name in labels]
    if len(classes) != len(raw):
        raise ValueError(f"{len(raw)} descriptors but {len(classes)} labels")
    unknown = sorted(set(classes) - set(motion.LABELS))
    if unknown:
        raise ValueError(f"unknown labels {unknown}; labels are {', '.join(motion.LABELS)}")
    for name, value in (("global_k", global_k), ("variants", variants), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "seed" else 1):
            raise ValueError(f"{name} must be an integer ≥ {0 if name == 'seed' else 1}, got {value!r}")

    features = to_features(raw)
    centroids, global_index = _cluster(features, global_k, seed)
    prototypes = tuple(
        Prototype(
            index=i,
            descriptor=_row(centroid),
            label=motion.label(centroid),
            members=int(np.count_nonzero(global_index == i)),
        )
        for i, centroid in enumerate(centroids)
    )

    class_of = np.array(classes, dtype=object)
    variant_index = np.full(len(raw), -1, dtype=np.int64)
    found: list[Variant] = []
    for name in motion.LABELS:
        members = np.flatnonzero(class_of == name)
        if len(members) == 0:
            continue
        class_centroids, nearest = _cluster(features[members], variants, seed)
        variant_index[members] = nearest
        found.extend(
            Variant(label=name, index=i, descriptor=_row(centroid), members=int(np.count_nonzero(nearest == i)))
            for i, centroid in enumerate(class_centroids)
        )

    return Fit(
        prototypes=prototypes,
        variants=tuple(found),
        global_index=_frozen(global_index),
        variant_index=_frozen(variant_index),
        global_k=global_k,
        variants_k=variants,
        seed=seed,
    )


def assign(model: Fit | Centroids, descriptor: np.ndarray | Sequence[float], label: str) -> tuple[int, int | None]:
    """A new video's (global index, variant index) between refits: the nearest centroid in the clustering space,
    and the nearest variant of its label, None when the label has no variants yet."""
    centroids = model.centroids if isinstance(model, Fit) else model
    row = _check_descriptors(np.asarray(descriptor, dtype=np.float64).reshape(1, -1), "descriptor")
    if label not in motion.LABELS:
        raise ValueError(f"unknown label {label!r}; labels are {', '.join(motion.LABELS)}")
    point = to_features(row)
    global_index = int(_nearest(point, to_features(centroids.prototypes))[0])
    variants = centroids.variants.get(label)
    if variants is None:
        return global_index, None
    return global_index, int(_nearest(point, to_features(variants))[0])


def _check_descriptors(values: Any, what: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim == 1 and array.size == 0:
        array = array.reshape(0, _WIDTH)
    if array.ndim != 2 or array.shape[1] != _WIDTH:
        raise ValueError(f"{what} must be (n, {_WIDTH}) ({', '.join(motion.DESCRIPTOR)}), got shape {array.shape}")
    if not np.isfinite(array).all():
        raise ValueError(f"{what} must be finite")
    return array


def _frozen(array: np.ndarray) -> np.ndarray:
    out = np.array(array, copy=True)
    out.setflags(write=False)
    return out


def _row(descriptor: np.ndarray) -> tuple[float, ...]:
    return tuple(float(v) for v in descriptor)


def _put(rows: dict[int, Sequence[float]], index: int, row: Sequence[float], what: str) -> None:
    if index in rows:
        raise ValueError(f"{what} appears twice")
    rows[index] = row


def _contiguous(rows: Mapping[int, Sequence[float]], what: str) -> list[Sequence[float]]:
    if sorted(rows) != list(range(len(rows))):
        raise ValueError(f"{what} must be indexed 0 to {len(rows) - 1} without gaps, got {sorted(rows)}")
    return [rows[i] for i in range(len(rows))]


def _nearest(points: np.ndarray, centres: np.ndarray) -> np.ndarray:
    """Index of each point's nearest centre (exact squared distances; the lowest index on a tie)."""
    out = np.empty(len(points), dtype=np.int64)
    for start in range(0, len(points), _CHUNK):
        block = points[start : start + _CHUNK]
        distances = ((block[:, None, :] - centres[None, :, :]) ** 2).sum(axis=2)
        out[start : start + _CHUNK] = distances.argmin(axis=1)
    return out


def _cluster(features: np.ndarray, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(centroids as raw descriptors, each point's index), largest cluster first, no empty cluster."""
    distinct = np.unique(features, axis=0)
    if len(distinct) <= k:
        centres = distinct
    else:
        from sklearn.cluster import MiniBatchKMeans
        from threadpoolctl import threadpool_limits

        model = MiniBatchKMeans(n_clusters=k, random_state=seed, n_init=N_INIT, batch_size=BATCH_SIZE)
        # One thread: on batches of 5-wide rows OpenMP's workers cost far more than they save (a fit of 2,000
        # descriptors takes 2 s with them on a busy machine, 20 ms without).
        with threadpool_limits(limits=1, user_api="openmp"):
            centres = model.fit(features).cluster_centers_
    # The stored descriptors are the truth: assign from what a reader of them gets back.
    raw = from_features(np.unique(centres, axis=0))
    nearest = _nearest(features, to_features(raw))
    counts = np.bincount(nearest, minlength=len(raw))
    order = np.argsort(-counts, kind="stable")
    order = order[counts[order] > 0]
    raw = raw[order]
    while True:  # reordering can move a point that lies exactly between two centres; drop what that empties
        nearest = _nearest(features, to_features(raw))
        kept = np.bincount(nearest, minlength=len(raw)) > 0
        if kept.all():
            return raw, nearest
        raw = raw[kept]
