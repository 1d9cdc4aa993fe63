"""The priority score (docs/architecture.md): ``score = w_c·C + w_r·R + w_d·D`` picks the class and the queue.

C (prompt complexity) = min(1, nodes / node_norm) where the prompt's *node count* is a deterministic parse:
  nodes = words + 2·clauses + modifiers
  - words: runs of letters/digits/apostrophes;
  - clauses: segments separated by , ; : . ! ? or the connectives and/but/while/then/as/with/where/when
    (a prompt with no separator is one clause);
  - modifiers: words ending in -ly, -ful, -ous, -ive, -ic, -al, -ish, -less, -y (longer than 3 letters) or in a
    small list of colour/size/light/motion adjectives.
R (resolution) = 0.3 + 0.7·log2(1 + 15·r)/4 clamped to [0.3, 1.0], with r = H·W / 2048² (2048² → 1.0).
D (duration)   = min(1, 1000 / max(100, duration_ms)) in [0.1, 1.0]: short clips are more urgent.
Class: high ≥ score_high, medium ≥ score_medium, else low.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from shared.infra.config import Settings
from shared.queues import PriorityClass

_WORD = re.compile(r"[A-Za-z0-9']+")
_CLAUSE_SPLIT = re.compile(r"[,;:.!?]+|\b(?:and|but|while|then|as|with|where|when)\b", re.IGNORECASE)
_MODIFIER_SUFFIXES = ("ly", "ful", "ous", "ive", "ic", "al", "ish", "less", "y")
_MODIFIER_WORDS = frozenset(
    [
        "red",
        "orange",
        "yellow",
        "green",
        "blue",
        "purple",
        "pink",
        "black",
        "white",
        "gray",
        "grey",
        "golden",
        "silver",
        "neon",
        "dark",
        "bright",
        "big",
        "small",
        "tiny",
        "huge",
        "giant",
        "tall",
        "short",
        "wide",
        "long",
        "slow",
        "fast",
        "quick",
        "soft",
        "hard",
        "warm",
        "cold",
        "old",
        "young",
        "cinematic",
        "dramatic",
        "aerial",
        "closeup",
        "close-up",
        "wide-angle",
        "vivid",
        "misty",
        "foggy",
        "rainy",
        "sunny",
    ]
)


def node_count(prompt: str) -> int:
    words = _WORD.findall(prompt)
    clauses = max(1, sum(1 for part in _CLAUSE_SPLIT.split(prompt) if part and _WORD.search(part)))
    modifiers = sum(
        1 for w in (w.lower() for w in words) if w in _MODIFIER_WORDS or (len(w) > 3 and w.endswith(_MODIFIER_SUFFIXES))
    )
    return len(words) + 2 * clauses + modifiers


def complexity(prompt: str, *, node_norm: int) -> float:
    return min(1.0, node_count(prompt) / node_norm)


def resolution_factor(width: int, height: int) -> float:
    r = (width * height) / (2048 * 2048)
    return min(1.0, max(0.3, 0.3 + 0.7 * math.log2(1 + 15 * r) / 4))


def duration_factor(duration_s: float) -> float:
    return min(1.0, 1000.0 / max(100.0, duration_s * 1000.0))


@dataclass(frozen=True, slots=True)
class Score:
    value: float
    complexity: float
    resolution: float
    duration: float
    priority_class: PriorityClass


def score_job(settings: Settings, *, prompt: str, width: int, height: int, duration_s: float) -> Score:
    c = complexity(prompt, node_norm=settings.score_node_norm)
    r = resolution_factor(width, height)
    d = duration_factor(duration_s)
    value = (
        settings.score_weight_complexity * c + settings.score_weight_resolution * r + settings.score_weight_duration * d
    )
    if value >= settings.score_high:
        cls = PriorityClass.HIGH
    elif value >= settings.score_medium:
        cls = PriorityClass.MEDIUM
    else:
        cls = PriorityClass.LOW
    return Score(round(value, 4), round(c, 4), round(r, 4), round(d, 4), cls)
