"""A small PromQL reader for the deploy tests: the metric selectors of an expression (name and label matchers)
and the labels its aggregations and vector matches group on. Enough for the dashboard's and the rules'
expressions, and strict where it is not: anything it does not know raises, so nothing is skipped silently.

What it reads: metric names (with or without a `{...}` matcher list), matchers `label op "value"`
(`=`, `!=`, `=~`, `!~`), function and aggregation calls (a name before `(`), grouping clauses (`by`,
`without`, `on`, `ignoring`, `group_left`, `group_right` with their label lists), range and subquery brackets
(`[5m]`, `[$__rate_interval]`, `[1h:1m]`: skipped), numbers, durations after `offset`, strings and the binary
operators. Grafana's variables (`$instance`) may appear inside strings and brackets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ("Matcher", "Parsed", "Selector", "literal_alternatives", "parse")

_KEYWORDS_GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
_KEYWORDS_OTHER = frozenset({"bool", "and", "or", "unless", "offset", "atan2"})
_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<bracket>\[[^\]]*\])
  | (?P<number>(?:\d+(?:\.\d+)?(?:e[+-]?\d+)?)(?:ms|[smhdwy])*(?![A-Za-z_:]))
  | (?P<name>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<matchop>=~|!~|!=)
  | (?P<op>==|<=|>=|[-+*/%^<>=])
  | (?P<punct>[(){},@])
    """,
    re.VERBOSE,
)


@dataclass(frozen=True, slots=True)
class Matcher:
    label: str
    op: str  # "=", "!=", "=~", "!~"
    value: str


@dataclass(frozen=True, slots=True)
class Selector:
    metric: str
    matchers: tuple[Matcher, ...] = ()


@dataclass(frozen=True, slots=True)
class Parsed:
    selectors: tuple[Selector, ...]
    grouping: frozenset[str]  # labels named in by / without / on / ignoring / group_left / group_right


def _tokens(expr: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    at = 0
    while at < len(expr):
        match = _TOKEN.match(expr, at)
        if match is None:
            raise ValueError(f"cannot read {expr[at : at + 20]!r} in {expr!r}")
        kind = match.lastgroup
        assert kind is not None
        if kind != "space":
            out.append((kind, match.group()))
        at = match.end()
    return out


def _unquote(text: str) -> str:
    body = text[1:-1]
    return body if text[0] == "`" else re.sub(r"\\(.)", r"\1", body)


def _label_list(tokens: list[tuple[str, str]], at: int, expr: str) -> tuple[list[str], int]:
    """The labels of `( a, b )` starting at `at` (the opening parenthesis); returns them and the index after."""
    labels: list[str] = []
    at += 1
    while tokens[at] != ("punct", ")"):
        kind, text = tokens[at]
        if kind == "name":
            labels.append(text)
        elif (kind, text) != ("punct", ","):
            raise ValueError(f"unexpected {text!r} in a label list of {expr!r}")
        at += 1
    return labels, at + 1


def _matchers(tokens: list[tuple[str, str]], at: int, expr: str) -> tuple[tuple[Matcher, ...], int]:
    """The matchers of `{ l op "v", ... }` starting at `at` (the opening brace); returns them and the index
    after the closing one."""
    found: list[Matcher] = []
    at += 1
    while tokens[at] != ("punct", "}"):
        if tokens[at] == ("punct", ","):
            at += 1
            continue
        (kind, label), (op_kind, op), (value_kind, value) = tokens[at : at + 3]
        if kind != "name" or op_kind not in ("matchop", "op") or op not in ("=", "!=", "=~", "!~"):
            raise ValueError(f"unreadable matcher at {label!r} in {expr!r}")
        if value_kind != "string":
            raise ValueError(f"matcher {label}{op} needs a string in {expr!r}")
        found.append(Matcher(label, op, _unquote(value)))
        at += 3
    return tuple(found), at + 1


def parse(expr: str) -> Parsed:
    """The selectors and grouping labels of a PromQL expression. Raises ValueError on what it cannot read
    (a selector without a metric name among them: `{__name__=~...}` is not supported)."""
    tokens = [*_tokens(expr), ("end", "")]
    selectors: list[Selector] = []
    grouping: set[str] = set()
    at = 0
    while tokens[at][0] != "end":
        kind, text = tokens[at]
        following = tokens[at + 1]
        if kind == "name" and text in _KEYWORDS_GROUPING:
            if following == ("punct", "("):
                labels, at = _label_list(tokens, at + 1, expr)
                grouping.update(labels)
            else:  # group_left / group_right without a label list
                at += 1
        elif kind == "name" and text in _KEYWORDS_OTHER:
            at += 1
        elif kind == "name" and (following == ("punct", "(") or following[1] in ("by", "without")):
            at += 1  # a function, or an aggregation (`sum by (a) (...)`)
        elif kind == "name":
            matchers: tuple[Matcher, ...] = ()
            at += 1
            if following == ("punct", "{"):
                matchers, at = _matchers(tokens, at, expr)
            selectors.append(Selector(text, matchers))
        elif (kind, text) == ("punct", "{"):
            raise ValueError(f"a selector without a metric name in {expr!r}")
        else:
            at += 1
    return Parsed(tuple(selectors), frozenset(grouping))


def literal_alternatives(regex: str) -> list[str] | None:
    """The values a regex matcher names when it is a plain alternation of literals (`a|b_c`); None when it
    is anything more (a real pattern, or a Grafana variable), whose values cannot be listed."""
    if re.fullmatch(r"[A-Za-z0-9_.:-]+(\|[A-Za-z0-9_.:-]+)*", regex) is None:
        return None
    return regex.split("|")
