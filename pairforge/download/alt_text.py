"""What stage 1 knows of a row's alt-text before any model sees it: can it train?

Web alt-text is often missing, empty, a file name a CMS filled in (``IMG_0001.jpg``) or a
boilerplate word (``image``, ``click here``). The image of such a row may be as good as
any. Stage 1 records why its alt-text cannot train in the raw column ``caption_issue``
(null when it can). Where the alt-text is the training caption's one source, a missing,
empty or undecodable alt-text ends the row ``caption_invalid`` as it always did, and a
junk one is left to stage 3's caption rules. When the recaption can train
(config.recaption_first), no alt-text ends a row: stage 3 captions the image and chooses
among the usable captions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# caption_issue values: why an alt-text cannot be a training caption
ABSENT = "absent"  # no caption column, or a null in it
EMPTY = "empty"  # nothing but whitespace
NOT_UTF8 = "not_utf8"
FILE_NAME = "file_name"  # IMG_0001.jpg, DSC1234, photo-12.png
BOILERPLATE = "boilerplate"  # image, photo, untitled, click here, ...
CAPTION_ISSUES = (ABSENT, EMPTY, NOT_UTF8, FILE_NAME, BOILERPLATE)
# the issues that leave no text at all: when the alt-text decides, they end the row
UNREADABLE = (ABSENT, EMPTY, NOT_UTF8)

_IMAGE_EXTENSIONS = r"jpe?g|jfif|png|gif|webp|bmp|tiff?|heic|heif|avif|svg|ico"
# a name ending in an image extension, spaces allowed (uploads keep them), a few words long
_FILE_NAME = re.compile(rf"[^\s/\\]+(?: [^\s/\\]+){{0,4}}\.(?:{_IMAGE_EXTENSIONS})",
                        re.IGNORECASE)
# camera and upload names without an extension, and bare numbers or hex ids
_GENERATED_NAME = re.compile(
    r"(?:img|dsc[nf]?|dcim|pxl|mvimg|gopr|sam|wp|image|photo|pic|upload|screenshot)"
    r"[_-]?\d[\d_-]*|[\d _-]+|[0-9a-f]{8,}(?:-[0-9a-f]{4,})*", re.IGNORECASE)
# What CMSs and templates put where a description should be (lowercase, words only)
BOILERPLATE_TEXTS = frozenset({
    "image", "images", "img", "photo", "photos", "photograph", "picture", "pictures", "pic",
    "untitled", "untitled image", "no title", "no image", "image not found", "no description",
    "thumbnail", "thumb", "placeholder", "logo", "banner", "icon", "spacer", "blank",
    "click here", "click to enlarge", "click to zoom", "enlarge", "zoom", "view image",
    "stock image", "stock photo", "featured image", "product image", "main image",
    "default", "alt", "alt text", "image alt", "null", "none", "undefined", "n a", "na",
    "screenshot", "header image", "hero image", "slide", "slider", "gallery image",
})
# "image 3", "photo #12": a boilerplate word and a number
_NUMBERED = re.compile(r"(?:image|photo|picture|pic|img|slide|thumbnail) ?\d+")


@dataclass(frozen=True)
class AltText:
    text: str | None  # the decoded, stripped alt-text (kept even when it cannot train)
    issue: str | None  # why it cannot train (CAPTION_ISSUES), None when it can
    detail: str | None = None  # the error a caption_invalid row records


def junk_kind(text: str) -> str | None:
    """FILE_NAME or BOILERPLATE when ``text`` (stripped, non-empty) is one, else None."""
    if _FILE_NAME.fullmatch(text) or _GENERATED_NAME.fullmatch(text):
        return FILE_NAME
    words = " ".join(re.findall(r"[a-z0-9]+", text.lower()))
    if words in BOILERPLATE_TEXTS or _NUMBERED.fullmatch(words):
        return BOILERPLATE
    return None


def read_alt_text(raw: bytes | None) -> AltText:
    """The alt-text of one input row (bytes as the input reader gives it; None: no caption
    column, or a null in it) and why it cannot train, if it cannot."""
    if raw is None:
        return AltText(None, ABSENT, "missing caption")
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError as err:
        return AltText(None, NOT_UTF8,
                       f"caption is not valid UTF-8 ({err.reason} at byte {err.start})")
    if not text:
        return AltText(None, EMPTY, "empty caption")
    return AltText(text, junk_kind(text))


def invalid_error(alt: AltText, required: bool, recaption_first: bool) -> str | None:
    """The caption_invalid error of a row, or None when the row goes on. With
    recaption-first no alt-text ends a row. Otherwise, as always: undecodable bytes end it,
    and so does a missing or empty one where a caption column is read (``required``); a
    junk one is left to stage 3's caption rules."""
    if recaption_first:
        return None
    if alt.issue == NOT_UTF8 or (required and alt.issue in (ABSENT, EMPTY)):
        return alt.detail
    return None
