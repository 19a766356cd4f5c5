"""The ``Idempotency-Key`` request header: an RFC 8941 sf-string, or a bare
sf-token, and nothing else."""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Optional, Sequence

from ._core import MAX_KEY_LENGTH

__all__ = ["KeyHeader", "parse_idempotency_key"]

# RFC 9110 tchar, plus ":" and "/" which RFC 8941 allows in a token
_TCHAR = frozenset("!#$%&'*+-.^_`|~" + string.digits + string.ascii_letters + ":/")


@dataclass(frozen=True)
class KeyHeader:
    """The parse of the header lines: ``key`` when valid, else ``error`` (the
    problem slug: idempotency-key-missing, -malformed, -repeated, -too-long)
    and ``detail`` for the client."""

    key: Optional[str] = None
    error: Optional[str] = None
    detail: str = ""


def _malformed(detail: str) -> KeyHeader:
    return KeyHeader(error="idempotency-key-malformed", detail=detail)


_REPEATED = KeyHeader(
    error="idempotency-key-repeated",
    detail="Send exactly one Idempotency-Key header holding one key, not a list.")


def parse_idempotency_key(values: Sequence[str]) -> KeyHeader:
    """Parse the field lines of ``Idempotency-Key`` (in the order received)."""
    if not values:
        return KeyHeader(error="idempotency-key-missing",
                         detail='This request needs an Idempotency-Key header, '
                                'e.g. Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324".')
    if len(values) > 1:
        return _REPEATED
    text = values[0].strip(" \t")
    if not text:
        return _malformed("The Idempotency-Key header is empty.")
    if text[0] == '"':
        key, pos, err = _sf_string(text)
        if err:
            return _malformed(err)
    elif text[0] in _TCHAR:
        # A strict RFC 8941 token starts with a letter or "*"; a bare UUID that
        # starts with a digit is accepted too, because many clients send their
        # keys so and the value is unambiguous.
        pos = 1
        while pos < len(text) and text[pos] in _TCHAR:
            pos += 1
        key = text[:pos]
    else:
        return _malformed('The Idempotency-Key must be a quoted string, e.g. '
                          'Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324" '
                          '(a bare value may hold only token characters).')
    rest = text[pos:].lstrip(" \t")
    if rest.startswith(","):
        return _REPEATED
    if rest.startswith(";"):
        return _malformed("The Idempotency-Key takes no parameters.")
    if rest:
        return _malformed("The Idempotency-Key holds characters after the key; "
                          "quote it, with printable ASCII characters only.")
    if not key:
        return _malformed("The Idempotency-Key is an empty string.")
    if len(key) > MAX_KEY_LENGTH:
        return KeyHeader(error="idempotency-key-too-long",
                         detail=f"The Idempotency-Key is {len(key)} characters long; "
                                f"the limit is {MAX_KEY_LENGTH} characters.")
    return KeyHeader(key=key)


def _sf_string(text: str) -> tuple[str, int, Optional[str]]:
    """(value, position after the closing quote, error) of the sf-string at 0."""
    out = []
    i = 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            if i + 1 >= len(text) or text[i + 1] not in '"\\':
                return "", i, 'The Idempotency-Key string has an invalid escape (only \\" and \\\\).'
            out.append(text[i + 1])
            i += 2
            continue
        if c == '"':
            return "".join(out), i + 1, None
        if not " " <= c <= "~":
            return "", i, "The Idempotency-Key may hold printable ASCII characters only."
        out.append(c)
        i += 1
    return "", i, "The Idempotency-Key string has no closing quote."
