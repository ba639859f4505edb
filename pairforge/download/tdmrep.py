"""W3C TDMRep's ``/.well-known/tdmrep.json``: which paths of an origin reserve TDM rights.

The file is a JSON array of rules ``{"location": PATTERN, "tdm-reservation": 0 | 1,
"tdm-policy": URL}``. A location is a path pattern as in robots.txt: it matches a path
that starts with it, ``*`` stands for any characters and a final ``$`` anchors the end. The
first rule whose location matches a path decides it (a later, broader rule does not
override an earlier exception). A file that is not such an array is read as no rules
(leniently, like robots.txt), and so is a rule without a usable location.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from urllib.parse import unquote

WELL_KNOWN_PATH = "/.well-known/tdmrep.json"


@dataclass(frozen=True)
class TdmRule:
    location: str
    reserved: bool
    policy: str | None
    pattern: re.Pattern[str]


def _location_pattern(location: str) -> re.Pattern[str]:
    anchored = location.endswith("$")
    body = location[:-1] if anchored else location
    regex = ".*".join(re.escape(part) for part in unquote(body).split("*"))
    return re.compile(regex + ("$" if anchored else ""))


def parse_tdmrep(text: str) -> list[TdmRule]:
    """The rules of a tdmrep.json body, in file order; [] for anything unusable."""
    try:
        data = json.loads(text)
    except ValueError:
        return []
    if not isinstance(data, list):
        return []
    rules = []
    for entry in data:
        if not isinstance(entry, dict):
            continue
        location = entry.get("location")
        if not isinstance(location, str) or not location.strip():
            continue
        location = location.strip()
        if not location.startswith(("/", "*")):
            location = "/" + location
        reservation = entry.get("tdm-reservation")
        policy = entry.get("tdm-policy")
        rules.append(TdmRule(location, reservation in (1, "1"),
                             policy if isinstance(policy, str) else None,
                             _location_pattern(location)))
    return rules


def reservation_for(rules: list[TdmRule], path: str) -> TdmRule | None:
    """The first rule whose location matches ``path`` (its query included), or None."""
    path = unquote(path)
    for rule in rules:
        if rule.pattern.match(path):
            return rule
    return None
