from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from shared.context import motion
from shared.context.prototypes import (
    GLOBAL_K,
    MAX_NUMBER,
    SCALE,
    VARIANTS,
    Centroids,
    Fit,
    assign,
    fit,
    from_features,
    parse_motion_filter,
    prototype_id,
    to_features,
    variant_id,
)

# Known motions (tx, ty, divergence, curl, residual), each drawn with noise around its centre: pans and tilts at a
# slow, a medium and a fast speed, zooms and rolls at two, still clips, and a diagonal (mixed) drift.
SPEEDS = (0.006, 0.03, 0.15)
ZOOMS = (0.04, 0.25)


def _centres() -> list[tuple[float, float, float, float, float]]:
    centres: list[tuple[float, float, float, float, float]] = []
    for s in SPEEDS:
        centres += [(s, 0, 0, 0, 0.004), (-s, 0, 0, 0, 0.004), (0, s, 0, 0, 0.004), (0, -s, 0, 0, 0.004)]
    for d in ZOOMS:
        centres += [(0, 0, d, 0, 0.005), (0, 0, -d, 0, 0.005), (0, 0, 0, d, 0.005), (0, 0, 0, -d, 0.005)]
    centres += [(0, 0, 0, 0, 0.003), (0.006, 0.006, 0, 0, 0.02)]
    return centres


CENTRES = _centres()


def synthetic(per_group: int, seed: int) -> tuple[np.ndarray, list[str], np.ndarray]:
    """(descriptors, their labels, the group each was drawn from)."""
    rng = np.random.default_rng(seed)
    rows, groups = [], []
    for g, centre in enumerate(CENTRES):
        c = np.array(centre, dtype=np.float64)
        spread = np.maximum(np.abs(c) * 0.08, [2e-4, 2e-4, 8e-4, 8e-4, 5e-4])
        rows.append(c + rng.normal(size=(per_group, 5)) * spread)
        groups += [g] * per_group
    descriptors = np.concatenate(rows)
    descriptors[:, 4] = np.abs(descriptors[:, 4])  # a residual is an rms
    return descriptors, [motion.label(d) for d in descriptors], np.array(groups)


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, list[str], np.ndarray]:
    return synthetic(60, seed=1)


@pytest.fixture(scope="module")
def fitted(data: tuple[np.ndarray, list[str], np.ndarray]) -> Fit:
    descriptors, labels, _ = data
    return fit(descriptors, labels, seed=0)


def _classes_of_centres() -> set[str]:
    return {motion.label(np.array(c)) for c in CENTRES}


def test_synthetic_motions_cover_every_label() -> None:
    # The data below is meant to exercise every class, the mixed one included.
    assert _classes_of_centres() == set(motion.LABELS)


# The transform


def test_transform_is_the_documented_signed_log1p_and_inverts() -> None:
    tx = np.array([[motion.STATIC_BELOW, -motion.STATIC_BELOW, 0.0, 0.0, motion.SUBJECT_BELOW]])
    assert to_features(tx) == pytest.approx(np.array([[np.log1p(1), -np.log1p(1), 0.0, 0.0, np.log1p(1)]]))
    # A divergence of 4·STATIC_BELOW is a zoom as strong as a STATIC_BELOW pan in motion.label's sense.
    zoom = np.array([0.0, 0.0, 4 * motion.STATIC_BELOW, -4 * motion.STATIC_BELOW, 0.0])
    assert to_features(zoom)[2] == pytest.approx(np.log1p(1))
    assert to_features(zoom)[3] == pytest.approx(-np.log1p(1))
    rng = np.random.default_rng(0)
    raw = rng.normal(size=(200, 5)) * 10.0 ** rng.uniform(-5, 0, size=(200, 5))
    assert np.allclose(from_features(to_features(raw)), raw, rtol=1e-12, atol=0)
    assert SCALE == (0.003, 0.003, 0.012, 0.012, 0.01)


def test_transform_separates_pan_speeds_and_keeps_them_far_from_zooms() -> None:
    def f(*v: float) -> np.ndarray:
        return to_features(np.array(v))

    slow, fast, faster = f(0.005, 0, 0, 0, 0.004), f(0.05, 0, 0, 0, 0.004), f(0.5, 0, 0, 0, 0.004)
    zoom = f(0, 0, 0.04, 0, 0.004)
    still = f(0, 0, 0, 0, 0.004)
    # Ten times faster is close to one step of log(10) at any speed; raw units would make the slow pan's step a
    # hundredth of the fast one's and leave it beside the still clips.
    step_low, step_high = np.linalg.norm(fast - slow), np.linalg.norm(faster - fast)
    assert 0.8 * np.log(10) < step_low < step_high <= np.log(10)
    # The slow pan stays apart from the still clip: half a step away, where raw units put it a ninth of one.
    assert np.linalg.norm(slow - still) > 0.5 * step_low
    for pan in (slow, fast, faster):
        assert np.linalg.norm(pan - zoom) > np.linalg.norm(slow - still)


# The global stage


def test_global_prototypes_cover_the_classes_present(
    fitted: Fit, data: tuple[np.ndarray, list[str], np.ndarray]
) -> None:
    descriptors, labels, _ = data
    assert 1 <= len(fitted.prototypes) <= GLOBAL_K
    assert [p.index for p in fitted.prototypes] == list(range(len(fitted.prototypes)))
    assert {p.label for p in fitted.prototypes} >= set(labels)
    for p in fitted.prototypes:
        assert len(p.descriptor) == 5
        assert p.label == motion.label(np.array(p.descriptor))
        assert p.members >= 1
    counts = [p.members for p in fitted.prototypes]
    assert sum(counts) == len(descriptors)
    assert counts == sorted(counts, reverse=True)
    assert counts == np.bincount(fitted.global_index, minlength=len(counts)).tolist()


def test_no_prototype_mixes_distinct_motions(fitted: Fit, data: tuple[np.ndarray, list[str], np.ndarray]) -> None:
    # Slow and fast pans, zooms and rolls, stills: with 64 prototypes each of them gets prototypes of its own.
    _, _, groups = data
    for p in fitted.prototypes:
        assert len(set(groups[fitted.global_index == p.index].tolist())) == 1, p


def test_assignment_is_the_nearest_prototype(fitted: Fit, data: tuple[np.ndarray, list[str], np.ndarray]) -> None:
    descriptors, labels, _ = data
    centres = to_features(np.array([p.descriptor for p in fitted.prototypes]))
    distances = ((to_features(descriptors)[:, None, :] - centres[None]) ** 2).sum(axis=2)
    assert (fitted.global_index == distances.argmin(axis=1)).all()
    for name in set(labels):
        members = np.flatnonzero(np.array(labels) == name)
        own = to_features(np.array([v.descriptor for v in fitted.variants_of(name)]))
        d = ((to_features(descriptors[members])[:, None, :] - own[None]) ** 2).sum(axis=2)
        assert (fitted.variant_index[members] == d.argmin(axis=1)).all()


# The variants


def test_every_variant_belongs_to_its_class(fitted: Fit, data: tuple[np.ndarray, list[str], np.ndarray]) -> None:
    _, labels, _ = data
    present = sorted(set(labels), key=motion.LABELS.index)
    assert [v.label for v in fitted.variants] == sorted((v.label for v in fitted.variants), key=motion.LABELS.index)
    for name in present:
        variants = fitted.variants_of(name)
        assert 1 <= len(variants) <= VARIANTS
        assert [v.index for v in variants] == list(range(len(variants)))
        members = np.array(labels) == name
        assert sum(v.members for v in variants) == int(members.sum())
        assert [v.members for v in variants] == np.bincount(fitted.variant_index[members]).tolist()
        for v in variants:
            assert v.label == name
            # Clusters drawn well inside a class keep its label in their centroid too.
            assert motion.label(np.array(v.descriptor)) == name
    assert {v.label for v in fitted.variants} == set(present)
    assert fitted.params["variant_counts"] == {name: len(fitted.variants_of(name)) for name in present}


def test_assign_agrees_with_the_fit(fitted: Fit, data: tuple[np.ndarray, list[str], np.ndarray]) -> None:
    descriptors, labels, _ = data
    stored = Centroids.from_rows(
        [(p.index, list(p.descriptor)) for p in reversed(fitted.prototypes)],
        [(v.label, v.index, list(v.descriptor)) for v in reversed(fitted.variants)],
    )
    for i in range(0, len(descriptors), 7):
        expected = fitted.assignment(i)
        assert assign(fitted, descriptors[i], labels[i]) == expected
        assert assign(stored, descriptors[i].tolist(), labels[i]) == expected


def test_assign_without_variants_of_the_label() -> None:
    descriptors = np.array([[0.02, 0, 0, 0, 0.004], [0, 0, 0, 0, 0.002]])
    result = fit(descriptors, ["pan_left", "static"])
    index = {p.label: p.index for p in result.prototypes}
    assert assign(result, [0.025, 0.0, 0, 0, 0.004], "mixed") == (index["pan_left"], None)
    assert assign(result, [0.0, 0.0, 0, 0, 0.001], "static") == (index["static"], 0)
    with pytest.raises(ValueError, match="unknown label"):
        assign(result, [0.0, 0.0, 0, 0, 0.001], "dolly")
    with pytest.raises(ValueError, match="shape"):
        assign(result, [0.0, 0.0, 0], "static")


# Determinism and immutability


def test_fit_is_deterministic_for_a_seed(data: tuple[np.ndarray, list[str], np.ndarray], fitted: Fit) -> None:
    descriptors, labels, _ = data
    again = fit(descriptors.copy(), list(labels), seed=0)
    assert again.prototypes == fitted.prototypes
    assert again.variants == fitted.variants
    assert (again.global_index == fitted.global_index).all()
    assert (again.variant_index == fitted.variant_index).all()
    assert again.params == fitted.params


def test_refit_with_more_data_leaves_the_previous_fit_alone(data: tuple[np.ndarray, list[str], np.ndarray]) -> None:
    descriptors, labels, _ = data
    inputs = descriptors.copy()
    first = fit(inputs, labels, seed=3)
    snapshot = (first.prototypes, first.variants, first.global_index.copy(), first.variant_index.copy(), first.params)
    more, more_labels, _ = synthetic(30, seed=2)
    second = fit(np.concatenate([inputs, more]), labels + more_labels, seed=3)
    assert second.videos == len(inputs) + len(more) != first.videos
    inputs[:] = 0.0  # the caller's array is not the fit's
    params = first.params
    params["seed"] = 99
    assert (first.prototypes, first.variants, first.params) == (snapshot[0], snapshot[1], snapshot[4])
    assert (first.global_index == snapshot[2]).all()
    assert (first.variant_index == snapshot[3]).all()
    with pytest.raises(ValueError):
        first.global_index[0] = 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.prototypes = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.prototypes[0].members = 0  # type: ignore[misc]
    centroids = first.centroids
    with pytest.raises(ValueError):
        centroids.prototypes[0, 0] = 1.0
    with pytest.raises(TypeError):
        centroids.variants["static"] = np.zeros((1, 5))  # type: ignore[index]


def test_params_are_json(fitted: Fit) -> None:
    params = json.loads(json.dumps(fitted.params))
    assert params["global_k"] == GLOBAL_K and params["variants"] == VARIANTS and params["seed"] == 0
    assert params["videos"] == fitted.videos == len(fitted.global_index)
    assert params["scale"] == list(SCALE)
    assert params["transform"] == "signed_log1p"
    assert params["prototypes"] == len(fitted.prototypes)


# Tiny inputs


def test_no_descriptors_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one descriptor"):
        fit(np.zeros((0, 5)), [])


@pytest.mark.parametrize(
    ("descriptors", "labels", "message"),
    [
        (np.zeros((2, 5)), ["static"], "2 descriptors but 1 labels"),
        (np.zeros((1, 5)), ["dolly"], "unknown labels"),
        (np.zeros((1, 4)), ["static"], "shape"),
        (np.array([[np.nan, 0, 0, 0, 0]]), ["static"], "finite"),
    ],
)
def test_bad_inputs_are_errors(descriptors: np.ndarray, labels: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fit(descriptors, labels)


@pytest.mark.parametrize("option", [{"global_k": 0}, {"variants": 0}, {"seed": -1}, {"global_k": True}])
def test_bad_options_are_errors(option: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="must be an integer"):
        fit(np.zeros((1, 5)), ["static"], **option)


def test_one_descriptor() -> None:
    descriptor = np.array([[0.02, 0.0, 0.0, 0.0, 0.004]])
    result = fit(descriptor, ["pan_left"])
    assert len(result.prototypes) == 1 and len(result.variants) == 1
    assert result.prototypes[0].descriptor == pytest.approx(tuple(descriptor[0]), rel=1e-12)
    assert result.prototypes[0].label == "pan_left" and result.prototypes[0].members == 1
    assert result.variants[0].label == "pan_left" and result.variants[0].members == 1
    assert result.assignment(0) == (0, 0)


def test_identical_descriptors_make_one_prototype() -> None:
    descriptors = np.tile([0.0, 0.0, 0.08, 0.0, 0.004], (50, 1))
    result = fit(descriptors, ["zoom_in"] * 50)
    assert [(p.label, p.members) for p in result.prototypes] == [("zoom_in", 50)]
    assert [(v.label, v.index, v.members) for v in result.variants] == [("zoom_in", 0, 50)]
    assert set(result.global_index.tolist()) == {0} and set(result.variant_index.tolist()) == {0}


def test_a_class_with_fewer_distinct_members_than_variants() -> None:
    descriptors, labels, _ = synthetic(40, seed=4)
    extra = np.array([[0.0, 0.0, 0.0, -0.1, 0.004]] * 3 + [[0.0, 0.0, 0.0, -0.2, 0.004]] * 2)
    keep = [i for i, name in enumerate(labels) if name != "rotate_cw"]
    result = fit(np.concatenate([descriptors[keep], extra]), [labels[i] for i in keep] + ["rotate_cw"] * 5)
    rolls = result.variants_of("rotate_cw")
    assert [v.members for v in rolls] == [3, 2]  # two distinct members: two variants, the larger first
    assert rolls[0].descriptor == pytest.approx((0.0, 0.0, 0.0, -0.1, 0.004), rel=1e-12)
    assert result.variant_index[-5:].tolist() == [0, 0, 0, 1, 1]
    assert len(result.variants_of("pan_left")) == VARIANTS


def test_fewer_distinct_points_than_global_k() -> None:
    descriptors = np.array([[0.02, 0, 0, 0, 0.004]] * 4 + [[0, 0, 0.1, 0, 0.004]] * 2 + [[0, 0, 0, 0, 0.001]])
    result = fit(descriptors, ["pan_left"] * 4 + ["zoom_in"] * 2 + ["static"])
    assert [(p.label, p.members) for p in result.prototypes] == [("pan_left", 4), ("zoom_in", 2), ("static", 1)]
    assert result.global_index.tolist() == [0, 0, 0, 0, 1, 1, 2]


# Stored centroids


def test_centroids_from_rows_want_every_index_once() -> None:
    row = [0.0, 0.0, 0.0, 0.0, 0.001]
    with pytest.raises(ValueError, match="without gaps"):
        Centroids.from_rows([(0, row), (2, row)])
    with pytest.raises(ValueError, match="twice"):
        Centroids.from_rows([(0, row), (0, row)])
    with pytest.raises(ValueError, match="without gaps"):
        Centroids.from_rows([(0, row)], [("static", 1, row)])
    with pytest.raises(ValueError, match="unknown labels"):
        Centroids.from_rows([(0, row)], [("dolly", 0, row)])
    with pytest.raises(ValueError, match="at least one"):
        Centroids.from_rows([])
    assert assign(Centroids.from_rows([(0, row)], [("static", 0, row)]), row, "static") == (0, 0)


# Ids and the motion filter


def test_ids_read_back() -> None:
    assert prototype_id(3, 17) == "m3.17"
    assert variant_id(3, "pan_left", 2) == "m3.pan_left.2"
    assert parse_motion_filter(prototype_id(12, 0)) == ("prototype", 12, 0)
    for name in motion.LABELS:
        assert parse_motion_filter(variant_id(7, name, 5)) == ("variant", 7, name, 5)
        assert parse_motion_filter(name) == ("label", name)


@pytest.mark.parametrize(
    "call",
    [
        lambda: prototype_id(-1, 0),
        lambda: prototype_id(1, -2),
        lambda: prototype_id(True, 0),
        lambda: prototype_id(1, MAX_NUMBER + 1),
        lambda: variant_id(1, "dolly", 0),
        lambda: variant_id(1, "static", -1),
    ],
)
def test_ids_reject_bad_parts(call: object) -> None:
    with pytest.raises(ValueError):
        call()  # type: ignore[operator]


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("static", ("label", "static")),
        ("rotate_ccw", ("label", "rotate_ccw")),
        ("m3.17", ("prototype", 3, 17)),
        ("m0.0", ("prototype", 0, 0)),
        ("m3.pan_left.2", ("variant", 3, "pan_left", 2)),
        ("m10.mixed.7", ("variant", 10, "mixed", 7)),
        (f"m{MAX_NUMBER}.{MAX_NUMBER}", ("prototype", MAX_NUMBER, MAX_NUMBER)),
    ],
)
def test_motion_filter_accepts(text: str, parsed: tuple[object, ...]) -> None:
    assert parse_motion_filter(text) == parsed


@pytest.mark.parametrize(
    "text",
    [
        "",
        "dolly",
        "Static",
        " static",
        "static\n",
        "pan-left",
        "m3",
        "m3.",
        "m.3",
        "3.17",
        "M3.17",
        "m3.17.",
        "m3.17.2",
        "m-1.2",
        "m3.-2",
        "m+3.2",
        "m03.17",
        "m3.017",
        "m3.1e2",
        "m3.١٧",  # Arabic-Indic digits: int() would take them
        "m3.pan_left",
        "m3.pan_left.",
        "m3.pan_left.-1",
        "m3.dolly.2",
        "m3.PAN_LEFT.2",
        "m3.pan_left.2.1",
        "m3..2",
        f"m{MAX_NUMBER + 1}.0",
        "m1." + "9" * 40,
        "m1.2" + " " * 100,
    ],
)
def test_motion_filter_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="motion filter|unknown label|over"):
        parse_motion_filter(text)


def test_motion_filter_rejects_non_strings() -> None:
    with pytest.raises(ValueError, match="string"):
        parse_motion_filter(3)  # type: ignore[arg-type]


def test_rejection_names_the_forms_and_shortens_the_input() -> None:
    with pytest.raises(ValueError) as raised:
        parse_motion_filter("x" * 500)
    message = str(raised.value)
    assert "m3.17" in message and "m3.pan_left.2" in message and "pan_left" in message
    assert len(message) < 300
