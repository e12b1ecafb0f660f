"""SMG's label selectors (`/v1/rl/engine/{path}?selector=`): parsed once, matched against a worker's labels.

The grammar is SMG's (its RL control plane docs, "Selectors"): terms separated by commas, every one must match.

    key=value            the key exists and equals value
    key!=value           the key is missing or differs
    key in (a,b)         the key exists and equals one of the values
    key notin (a,b)      the key is missing or equals none of them

Matching is exact and case-sensitive; whitespace around keys, operators and values is ignored. Keys use
`A-Z a-z 0-9 _ . / -`. A value with a comma, space, parenthesis, `=` or `!` is double-quoted, with `\\"` and `\\\\` as
escapes. A selector that does not parse raises `SelectorError` with the byte offset of the problem.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ("Selector", "SelectorError", "parse_selector")

_KEY = re.compile(r"[A-Za-z0-9_./-]+")
_BARE_VALUE = re.compile(r"[^\s,()\"=!]+")
_WORD_OPERATORS = ("notin", "in")


class SelectorError(ValueError):
    def __init__(self, message: str, offset: int) -> None:
        super().__init__(message)
        self.offset = offset


@dataclass(frozen=True, slots=True)
class _Term:
    key: str
    values: frozenset[str]
    wanted: bool  # `=` and `in`: the key must hold one of the values; `!=` and `notin`: it must not

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.key)
        return (value in self.values) if self.wanted else (value is None or value not in self.values)


@dataclass(frozen=True, slots=True)
class Selector:
    text: str
    terms: tuple[_Term, ...]

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(term.matches(labels) for term in self.terms)


class _Reader:
    __slots__ = ("at", "text")

    def __init__(self, text: str) -> None:
        self.text, self.at = text, 0

    def skip_space(self) -> None:
        while self.at < len(self.text) and self.text[self.at].isspace():
            self.at += 1

    def peek(self) -> str:
        self.skip_space()
        return self.text[self.at] if self.at < len(self.text) else ""

    def expect(self, char: str) -> None:
        if self.peek() != char:
            raise SelectorError(f"expected {char!r}", self._offset())
        self.at += 1

    def key(self) -> str:
        self.skip_space()
        found = _KEY.match(self.text, self.at)
        if found is None:
            raise SelectorError("expected a label key", self._offset())
        self.at = found.end()
        return found.group()

    def operator(self) -> str:
        self.skip_space()
        rest = self.text[self.at :]
        for symbol in ("!=", "="):
            if rest.startswith(symbol):
                self.at += len(symbol)
                return symbol
        for word in _WORD_OPERATORS:
            if rest.startswith(word) and (len(rest) == len(word) or rest[len(word)] in " \t("):
                self.at += len(word)
                return word
        raise SelectorError("expected one of =, !=, in, notin", self._offset())

    def value(self) -> str:
        self.skip_space()
        if self.peek() == '"':
            return self._quoted()
        found = _BARE_VALUE.match(self.text, self.at)
        if found is None:
            raise SelectorError("expected a value", self._offset())
        self.at = found.end()
        return found.group()

    def _quoted(self) -> str:
        start, self.at, chars = self.at, self.at + 1, []
        while self.at < len(self.text):
            char = self.text[self.at]
            if char == "\\" and self.at + 1 < len(self.text) and self.text[self.at + 1] in '"\\':
                chars.append(self.text[self.at + 1])
                self.at += 2
            elif char == '"':
                self.at += 1
                return "".join(chars)
            else:
                chars.append(char)
                self.at += 1
        raise SelectorError("unterminated quoted value", self._offset(start))

    def _offset(self, at: int | None = None) -> int:
        return len(self.text[: self.at if at is None else at].encode())


def parse_selector(text: str) -> Selector:
    reader, terms = _Reader(text), []
    while True:
        key = reader.key()
        operator = reader.operator()
        if operator in _WORD_OPERATORS:
            reader.expect("(")
            values = [reader.value()]
            while reader.peek() == ",":
                reader.at += 1
                values.append(reader.value())
            reader.expect(")")
        else:
            values = [reader.value()]
        terms.append(_Term(key, frozenset(values), wanted=operator in ("=", "in")))
        if reader.peek() == "":
            return Selector(text, tuple(terms))
        reader.expect(",")
