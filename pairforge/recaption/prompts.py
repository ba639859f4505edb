"""What the captioner is asked, and how its answer is cleaned into one caption sentence.

The prompt asks only for what is clearly visible, in one sentence. Models still open with
boilerplate ("The image shows ...", "This is a picture of ..."), run on past one sentence
or echo their prompt, so the answer is cleaned by rules, not trusted.
"""

from __future__ import annotations

import re

from pairforge.recaption.attributes import STRICT_PROMPT_SUFFIX

DEFAULT_PROMPT = ("Describe what is clearly visible in this image in one sentence. Mention the "
                  "main objects, their colours and what is happening. Do not guess anything "
                  "that cannot be seen.")
# Added on the second try, when the first caption failed a safety check.
STRICT_PROMPT = (" " + STRICT_PROMPT_SUFFIX
                 + " Name only objects that are plainly in view.")

# "The image shows", "This is a close-up photo of", "In this picture, we can see", ...
_MEDIUM = r"(?:image|picture|photo|photograph|pic|scene|shot|snapshot|illustration|frame)"
_BOILERPLATE = re.compile(
    rf"""^(?:
        (?:the|this|in\s+(?:the|this))\s+(?:[\w-]+\s+)?{_MEDIUM}\s*(?:,\s*)?
            (?:shows|depicts|features|contains|captures|presents|displays|is\s+of|of|
               we\s+(?:can\s+)?see|there\s+(?:is|are)|you\s+can\s+see)\s*:?\s*
      | (?:this|it)\s+is\s+(?:a|an)\s+(?:[\w-]+\s+)?{_MEDIUM}\s+(?:of|showing|that\s+shows)\s+
      | (?:a|an)\s+(?:[\w-]+\s+)?{_MEDIUM}\s+(?:of|showing)\s+
      | (?:here\s+)?(?:we|you)\s+(?:can\s+)?see\s+
      | there\s+(?:is|are)\s+
    )""",
    re.IGNORECASE | re.VERBOSE,
)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\ufffd]")
_SENTENCE_END = re.compile(r"(?<=[a-z0-9)\"'])[.!?](?=\s|$)")


def first_sentence(text: str) -> str:
    match = _SENTENCE_END.search(text)
    return text[:match.end()] if match else text


def strip_boilerplate(text: str) -> str:
    """Drop leading "The image shows"-style phrases (repeatedly: models stack them)."""
    previous = None
    while previous != text:
        previous, text = text, _BOILERPLATE.sub("", text, count=1).lstrip(" ,:-")
    return text


def clean_caption(raw: str, prompt: str | None = None) -> str:
    """One tidy sentence, or "" when nothing usable is left (the sample then abstains)."""
    text = _CONTROL.sub(" ", raw)
    if prompt and text.strip().lower().startswith(prompt.strip().lower()):
        text = text.strip()[len(prompt.strip()):]  # prefix-prompted models echo the prompt
    text = " ".join(text.split())
    text = strip_boilerplate(first_sentence(text))
    text = text.strip(" \"'`")
    if not re.search(r"[A-Za-z]{2}", text):
        return ""
    text = text[0].upper() + text[1:]
    return text if text[-1] in ".!?" else text + "."
