"""The Idempotency-Key header grammar (RFC 8941 sf-string; a bare value of token
characters tolerated, a UUID that starts with a digit included)."""

import pytest

from pg_idempotency import default_store_policy, parse_idempotency_key


@pytest.mark.parametrize("raw, key", [
    ('"abc"', "abc"),
    ('"8e03978e-40d5-43e8-bc93-6894a57f9324"', "8e03978e-40d5-43e8-bc93-6894a57f9324"),
    ('"a b,c;d"', "a b,c;d"),                 # anything printable inside the quotes
    ('"say \\"hi\\" \\\\ bye"', 'say "hi" \\ bye'),
    ("abc-123", "abc-123"),                   # bare token
    ("*tok:en/x.y", "*tok:en/x.y"),
    ("8e03978e-40d5-43e8-bc93-6894a57f9324", "8e03978e-40d5-43e8-bc93-6894a57f9324"),  # bare UUID
    ("1abc", "1abc"),
    ('  "abc"  ', "abc"),                     # surrounding whitespace is not the value
    ('"' + "x" * 255 + '"', "x" * 255),
])
def test_valid(raw: str, key: str) -> None:
    assert parse_idempotency_key([raw]).key == key


@pytest.mark.parametrize("raw", [
    "",                     # empty
    '""',                   # empty string
    '"abc',                 # no closing quote
    '"a\\x"',               # only \" and \\ escape
    '"abc";p=1',            # parameters
    "abc;p=1",
    '"abc" x',              # junk after the string
    "ab c",                 # junk after the token
    "{abc}",                # not token characters
    '"caf\u00e9"',          # non-ASCII
    "caf\u00e9",
    '"a\tb"',               # control character
    "(abc)",
])
def test_malformed(raw: str) -> None:
    parsed = parse_idempotency_key([raw])
    assert parsed.key is None
    assert parsed.error == "idempotency-key-malformed", (raw, parsed)


@pytest.mark.parametrize("values", [
    ['"a"', '"b"'],          # two field lines
    ['"a"', '"a"'],
    ['"a", "b"'],            # a list
    ["a, b"],
    ['"a",'],
])
def test_repeated(values: list) -> None:
    assert parse_idempotency_key(values).error == "idempotency-key-repeated"


def test_missing() -> None:
    assert parse_idempotency_key([]).error == "idempotency-key-missing"


def test_too_long() -> None:
    parsed = parse_idempotency_key(['"' + "x" * 256 + '"'])
    assert parsed.error == "idempotency-key-too-long"
    assert "256 characters" in parsed.detail
    assert parse_idempotency_key(["x" * 256]).error == "idempotency-key-too-long"


@pytest.mark.parametrize("status, decision", [
    (200, "succeeded"), (201, "succeeded"), (204, "succeeded"), (302, "succeeded"),
    (400, "failed"), (404, "failed"), (422, "failed"),
    (408, "release"), (409, "release"), (425, "release"), (429, "release"),
    (500, "release"), (503, "release"),
])
def test_default_store_policy(status: int, decision: str) -> None:
    assert default_store_policy(status) == decision
