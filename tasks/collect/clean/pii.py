"""Personal data scrubbing: replace e-mail addresses, phone numbers, IP addresses, payment card
numbers and IBANs in a document with placeholders (`<EMAIL>`, `<PHONE>`, ...).

`scrub_pii(text) -> (text, counts)`. Patterns are compiled once at import; each kind has a cheap
character pre-check so that a document without '@' never runs the e-mail regex. Kinds are
replaced in the order of `PII_KINDS`: e-mail first (an address may hold digits that look like a
phone), phones last (their digit groups would otherwise eat parts of cards and IBANs).

Precision over recall where the two conflict: a number is a phone only with a leading `+` and
country code, or in North American form with separators (`(555) 234-5678`, `555-234-5678`,
`1-800-555-0199`); plain digit runs, years, dates, prices and version strings are left alone.
Card numbers must pass the Luhn check and start like a card network's; IBANs must pass ISO 7064
mod 97.

Every IP address is replaced, private ones (10/8, 172.16/12, 192.168/16) included: "private" is
a routing class, not a privacy one. In crawled text such addresses come with someone's router
setup, server logs or VPN layout, and concrete addresses teach a language model nothing it needs.
Kept: loopback and unspecified addresses (127.0.0.0/8, 0.0.0.0, ::1, ::), which name "this
machine", never a person, and which technical prose needs ("listen on 127.0.0.1:8000");
netmasks (255.255.255.0, ffff:ffff::), which come from ranges no host uses; and four-part
versions after a comparison or the word "version" (">= 1.2.1.0").
"""
from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Literal, get_args

PiiKind = Literal["email", "ip_address", "iban", "credit_card", "phone"]
PII_KINDS: tuple[PiiKind, ...] = get_args(PiiKind)  # also the replacement order
PLACEHOLDERS: Mapping[str, str] = {
    "email": "<EMAIL>", "ip_address": "<IP_ADDRESS>", "iban": "<IBAN>",
    "credit_card": "<CREDIT_CARD>", "phone": "<PHONE>",
}

_EMAIL = re.compile(
    r"(?<![\w.+-])[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(?:\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*"
    r"@(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+"
    # a top-level domain, but not an image/asset suffix ("logo@2x.png" is a file name)
    r"(?!(?:png|jpe?g|gif|svg|webp|css|js)\b)[A-Za-z]{2,24}\b")
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
# Not inside a longer dotted run: "1.2.3.4.5" and "v1.2.3.4" are versions, not addresses.
_IPV4 = re.compile(rf"(?<![\w.]){_OCTET}(?:\.{_OCTET}){{3}}(?!\.?\d|\w)")
# Candidates only; ipaddress decides (times like 12:30:45 and MACs are not valid IPv6).
_IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![\w:])")
_IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,3})?\b")
# 13-19 digits written as cards are: one run, groups of four, or Amex's 4-6-5.
_CARD = re.compile(r"(?<![\w.,-])(?:\d{13,19}|\d{4}(?:[ -]\d{4}){2,3}(?:[ -]\d{1,3})?"
                   r"|\d{4}[ -]\d{6}[ -]\d{4,5})(?![\w-]|[.,]\d)")
# (issuer prefix, allowed lengths): Visa, Mastercard, Amex, Diners, Discover/UnionPay, JCB
_CARD_ISSUERS = tuple((re.compile(prefix), lengths) for prefix, lengths in (
    (r"4", {13, 16, 19}), (r"5[1-5]|2[2-7]", {16}), (r"3[47]", {15}), (r"3[0689]", {14, 16, 19}),
    (r"6(?:011|5|4[4-9]|2)", {16, 17, 18, 19}), (r"35", {16, 17, 18, 19})))
# "+" and a country code, then digit groups ("+44 20 7946 0958", "+32 (0)2 790 75 75").
_PHONE_INTL = re.compile(
    r"(?<![\w+])\+\d{1,3}(?:[ .-]?\(\d{1,4}\)|[ .-]?\d{1,5}){2,6}(?!\w|[.-]\d)")
# North American numbers with separators: "(555) 234-5678", "555.234.5678", "1-800-555-0199".
_PHONE_NANP = re.compile(
    r"(?<![\w.+-])(?:1[ .-])?(?:\([2-9]\d\d\) ?|[2-9]\d\d[.-])\d{3}[.-]\d{4}(?![\w-]|\.\d)")
# A version, not an address, when it follows a comparison or the word "version": ">= 1.2.1.0".
_VERSION_CONTEXT = re.compile(r"(?:[<>=~!]=?|\bversions?|\breleases?)\s*$", re.IGNORECASE)


def _is_person_ip(candidate: str) -> bool:
    """A valid address other than loopback, unspecified, or a netmask (ones then zeros, like
    255.255.255.0 or ffff:ffff::, from reserved ranges no host uses)."""
    try:
        address = ipaddress.ip_address(candidate)
    except ValueError:
        return False
    value, bits = int(address), address.max_prefixlen
    inverted = ~value & ((1 << bits) - 1)
    is_netmask = value >> (bits - 8) == 0xFF and inverted & (inverted + 1) == 0
    return not (address.is_loopback or address.is_unspecified or is_netmask)


def _is_ipv4(match: re.Match[str]) -> bool:
    before = match.string[max(0, match.start() - 12):match.start()]
    return not _VERSION_CONTEXT.search(before) and _is_person_ip(match.group(0))


def _is_ipv6(match: re.Match[str]) -> bool:
    # "1::2" is valid IPv6 but in text it is a slice or a score: ask for a 3+ digit group.
    return (any(len(group) >= 3 for group in match.group(0).split(":"))
            and _is_person_ip(match.group(0)))


def luhn_ok(digits: str) -> bool:
    """The Luhn checksum every payment card number satisfies."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch) * (2 if i % 2 else 1)
        total += d - 9 if d > 9 else d
    return total % 10 == 0


def _is_card(match: re.Match[str]) -> bool:
    digits = re.sub(r"[ -]", "", match.group(0))
    return (any(prefix.match(digits) and len(digits) in lengths
                for prefix, lengths in _CARD_ISSUERS) and luhn_ok(digits))


def iban_ok(candidate: str) -> bool:
    """ISO 13616 length bounds and the ISO 7064 mod-97 check."""
    iban = candidate.replace(" ", "")
    if not 15 <= len(iban) <= 34:
        return False
    rotated = iban[4:] + iban[:4]
    return int("".join(str(int(ch, 36)) for ch in rotated)) % 97 == 1


def _is_phone(match: re.Match[str]) -> bool:
    return 8 <= sum(ch.isdigit() for ch in match.group(0)) <= 15  # E.164: at most 15 digits


_DIGIT = re.compile(r"\d")


def _has_digit(text: str) -> bool:
    return _DIGIT.search(text) is not None


Validator = Callable[[re.Match[str]], bool]
# (kind, pattern, validator or None, cheap pre-check the text must pass for the regex to run),
# applied in this order.
_RULES: tuple[tuple[str, re.Pattern[str], Validator | None, Callable[[str], bool]], ...] = (
    ("email", _EMAIL, None, lambda t: "@" in t),
    ("ip_address", _IPV4, _is_ipv4, lambda t: "." in t),
    ("ip_address", _IPV6, _is_ipv6, lambda t: "::" in t or t.count(":") >= 7),
    ("iban", _IBAN, lambda m: iban_ok(m.group(0)), _has_digit),
    ("credit_card", _CARD, _is_card, _has_digit),
    ("phone", _PHONE_INTL, _is_phone, lambda t: "+" in t),
    ("phone", _PHONE_NANP, _is_phone, _has_digit),
)


def _replace(pattern: re.Pattern[str], validator: Validator | None, placeholder: str,
             text: str) -> tuple[str, int]:
    if validator is None:
        return pattern.subn(placeholder, text)
    hits = 0

    def substitute(match: re.Match[str]) -> str:
        nonlocal hits
        if not validator(match):
            return match.group(0)
        hits += 1
        return placeholder

    return pattern.sub(substitute, text), hits


def scrub_pii(text: str, kinds: Iterable[str] = PII_KINDS) -> tuple[str, dict[str, int]]:
    """`text` with every found item of `kinds` replaced by its placeholder, and how many of each
    kind were replaced (kinds with no hit are left out)."""
    wanted = set(kinds)
    unknown = wanted - set(PII_KINDS)
    if unknown:
        raise ValueError(f"unknown PII kinds {sorted(unknown)} (known: {', '.join(PII_KINDS)})")
    counts: dict[str, int] = {}
    for kind, pattern, validator, precheck in _RULES:
        if kind in wanted and precheck(text):
            text, hits = _replace(pattern, validator, PLACEHOLDERS[kind], text)
            if hits:
                counts[kind] = counts.get(kind, 0) + hits
    return text, counts
