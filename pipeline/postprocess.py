"""Post-processors, shared by every benchmark of a kind. Each maps raw text to a normalised answer."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

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


OPTION_LETTERS = "ABCDEFGHIJ"


def option_letter(text: str, fields: Mapping[str, Any]) -> str:
    """The chosen option's letter: an explicit letter ('B', '(B)', 'The answer is B') or, failing that,
    the option whose text the answer gives ('Paris' when option B is 'Paris'). Options are the sample's
    fields named A, B, C, … . Empty when the answer names no option or several equally."""
    letter = multiple_choice(text)
    if letter and letter in fields:
        return letter
    answer = " ".join(strip_punct(text).lower().split())
    if not answer:
        return ""
    matches = []
    for letter in OPTION_LETTERS:
        option = fields.get(letter)
        if option is None:
            break
        norm = " ".join(str(option).lower().split())
        if norm and (answer == norm or answer.startswith(norm + " ") or answer.startswith(norm)):
            matches.append((len(norm), letter))
    if not matches:
        return ""
    matches.sort(reverse=True)
    if len(matches) > 1 and matches[0][0] == matches[1][0]:
        return ""
    return matches[0][1]


Postprocessor = Callable[[str, Mapping[str, Any]], str]


def _text_only(fn: Callable[[str], str]) -> Postprocessor:
    return lambda text, fields: fn(text)


POSTPROCESSORS: dict[str, Postprocessor] = {
    "strip": _text_only(strip),
    "first_line": _text_only(first_line),
    "first_word": _text_only(first_word),
    "lower": _text_only(lower),
    "strip_punct": _text_only(strip_punct),
    "number": _text_only(number),
    "multiple_choice": _text_only(multiple_choice),
    "option_letter": option_letter,
    "yes_no": _text_only(yes_no),
    "asr_normalize": _text_only(asr_normalize),
}


def apply_postprocess(text: str, steps: Sequence[str], fields: Mapping[str, Any] | None = None) -> str:
    """Run the named steps in order; `fields` are the sample's own fields (options for option_letter)."""
    for step in steps:
        text = POSTPROCESSORS[step](text, fields or {})
    return text
