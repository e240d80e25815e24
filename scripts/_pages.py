"""The generated part of a docs page: the text between two marker lines, which a script writes
(``--write``) and a test compares with what the script would write now."""

from __future__ import annotations


def between(path: str, begin: str, end: str) -> str:
    """The text between the page's markers (each must occur once)."""
    text = open(path, encoding="utf-8").read()
    if text.count(begin) != 1 or text.count(end) != 1:
        raise ValueError(f"{path}: needs one {begin.strip()!r} and one {end.strip()!r}")
    return text.split(begin)[1].split(end)[0]


def write_between(path: str, begin: str, end: str, body: str) -> None:
    """Replace the text between the page's markers with ``body``."""
    between(path, begin, end)  # the markers are there, once each
    text = open(path, encoding="utf-8").read()
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    with open(path, "w", encoding="utf-8") as f:
        f.write(head + begin + body + end + tail)
