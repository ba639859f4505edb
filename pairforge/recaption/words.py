"""English word forms shared by the attribute filter and the grounding lexicon."""

from __future__ import annotations

import re

# Words ending in "man" whose plural is regular (human -> humans, not humen).
_REGULAR_MAN = {"human", "shaman", "german", "roman", "ottoman", "talisman", "caiman"}


def plural(phrase: str) -> str:
    """The regular plural of a phrase's last word: woman -> women, lady -> ladies,
    box -> boxes, knife -> knives. Irregular nouns are listed by the callers' word lists."""
    head, _, last = phrase.rpartition(" ")
    if last.endswith("man") and last.lower() not in _REGULAR_MAN:
        last = last[:-3] + "men"
    elif re.search(r"[^aeiou]y$", last):
        last = last[:-1] + "ies"
    elif re.search(r"(s|x|z|ch|sh)$", last):
        last += "es"
    elif last.endswith("fe"):
        last = last[:-2] + "ves"
    else:
        last += "s"
    return f"{head} {last}".strip()
