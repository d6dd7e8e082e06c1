"""How keras_dp's messages are written: short lists, and warnings at the user's line."""

import sys
import warnings


def first_few(texts, noun="", limit=6):
    """The first `limit` of `texts`, joined, and how many in all where there are more."""
    more = f", ... ({len(texts)} {noun}in all)" if len(texts) > limit else ""
    return ", ".join(texts[:limit]) + more


def short_list(items, limit=6):
    """`items` as text, the first `limit` of them and a count of the rest: messages stay short."""
    items = list(items)
    if len(items) <= limit:
        return str(items)
    return f"[{first_few([str(item) for item in items], limit=limit)}]"


def warn(message, category=UserWarning):
    """`warnings.warn` attributed to the user's line: the first frame outside keras_dp.

    A warning about the user's data or model points at the call they wrote
    (`fit_sharded(...)`, `trainer.fit(...)`), however deep inside keras_dp
    it is raised; frames of `contextlib` (keras_dp's context managers) are
    passed over too.
    """
    frame, level = sys._getframe(1), 2
    while frame is not None and _inside(frame):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def _inside(frame):
    name = frame.f_globals.get("__name__") or ""
    return name == "keras_dp" or name.startswith(("keras_dp.", "contextlib"))
