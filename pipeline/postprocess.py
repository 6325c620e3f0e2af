"""Post-processors, shared by every benchmark of a kind. Each maps raw text to a normalised answer."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

_THINK = re.compile(r"<think>(.*?)(?:</think>|$)", re.DOTALL)
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)?\s*:?\s*\(?([A-Ja-j])\b\)?", re.IGNORECASE)
_LEADING_LETTER = re.compile(r"^\s*(?:\(([A-Ja-j])\)|([A-Ja-j])(?:[.):\]]|\s*$))")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
_PUNCT_EDGES = re.compile(r"^[\s\"'`.,;:!?()\[\]]+|[\s\"'`.,;:!?()\[\]]+$")


def split_reasoning(text: str) -> tuple[str, str | None]:
    """Move `<think>…</think>` out of the answer. Returns (answer, reasoning or None)."""
    match = _THINK.search(text)
    if match is None:
        return text, None
    answer = (text[: match.start()] + text[match.end() :]).strip()
    return answer, match.group(1).strip()


def strip(text: str) -> str:
    return text.strip()


def first_line(text: str) -> str:
    for line in text.strip().splitlines():
        if line.strip():
            return line.strip()
    return ""


def first_word(text: str) -> str:
    words = text.strip().split()
    return _PUNCT_EDGES.sub("", words[0]) if words else ""


def lower(text: str) -> str:
    return text.lower()


def strip_punct(text: str) -> str:
    return _PUNCT_EDGES.sub("", text)


def number(text: str) -> str:
    """First number in the text, canonical: '1,200.0' -> '1200'. Empty when there is none."""
    match = _NUMBER.search(text)
    if match is None:
        return ""
    raw = match.group(0).replace(",", "")
    try:
        value = float(raw)
    except ValueError:
        return ""
    return str(int(value)) if value.is_integer() else repr(value)


def multiple_choice(text: str) -> str:
    """The chosen letter from 'The answer is (B)', 'B. Paris', '(b)', bare 'b'. Empty when unclear."""
    stripped = text.strip()
    match = _ANSWER_IS.search(stripped)
    if match is None:
        match = _LEADING_LETTER.match(stripped)
    if match is None:
        return ""
    return next(g for g in match.groups() if g).upper()


def yes_no(text: str) -> str:
    match = _YES_NO.search(text)
    return match.group(1).lower() if match else ""


def asr_normalize(text: str) -> str:
    """ASR text normalisation: lower case, drop punctuation except apostrophes, collapse whitespace."""
    cleaned = re.sub(r"[^\w\s']", " ", text.lower())
    return " ".join(cleaned.split())


POSTPROCESSORS: dict[str, Callable[[str], str]] = {
    "strip": strip,
    "first_line": first_line,
    "first_word": first_word,
    "lower": lower,
    "strip_punct": strip_punct,
    "number": number,
    "multiple_choice": multiple_choice,
    "yes_no": yes_no,
    "asr_normalize": asr_normalize,
}


def apply_postprocess(text: str, steps: Sequence[str]) -> str:
    for step in steps:
        text = POSTPROCESSORS[step](text)
    return text
