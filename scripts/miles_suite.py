"""miles' own router/session suite, on miles' servers and on rolloutgate, side by side (make test-miles).

Run with .venv-miles' Python (scripts/miles_env.sh builds it); stdlib only here, the work is pytest's:

  miles_suite.py baseline --out out/miles/baseline.json
      miles' suite unmodified on miles' own servers (the plugin only notes which tests build a server)
  miles_suite.py run --baseline out/miles/baseline.json --out out/miles/rolloutgate.json
      the suite's HTTP tests with rolloutgate serving where miles' servers did (tests/compat/miles), the
      expected failures as strict xfails; then the side-by-side summary, also written as Markdown beside --out

Exit status: 0 when every HTTP test passes or fails as tests/compat/miles/expected_failures.toml says; 1 on any
other failure, and on a listed test that passes (strict xfail: the list is shrunk as the causes are fixed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
COMPAT = REPO / "tests" / "compat" / "miles"
EXPECTED = COMPAT / "expected_failures.toml"
SUITE = "tests/fast/router"
PARITY = "tests/fast/router/test_session_v1_v2_parity.py"
RUN_TIMEOUT_S = 1800  # a hung run is stopped whole (pytest and the gateways it started share its group)


def run_pytest(
    mode: str, miles_dir: Path, venv: Path, report: Path, extra_env: dict[str, str], tests: str = SUITE
) -> int:
    env = dict(os.environ)
    env.update(
        {
            "HF_HOME": str(venv / "hf"),  # the Qwen3 hub-cache entry scripts/miles_env.sh lays
            "HF_HUB_OFFLINE": "1",
            "PYTHONDONTWRITEBYTECODE": "1",  # miles' folder is read-only material: nothing written there
            "PYTHONPATH": str(COMPAT),
            "RG_MILES_MODE": mode,
            "RG_MILES_REPORT": str(report),
            "RG_MILES_LOG_DIR": str(report.parent / "gateway-logs"),
            **extra_env,
        }
    )
    command = [
        sys.executable, "-m", "pytest", tests,
        "-p", "rg_miles_plugin", "-p", "no:cacheprovider",
        # miles' addopts (--verbose --durations=0) print a line per test: left out, nothing else changed
        "-o", "addopts=", "--strict-markers", "-q", "--tb=short", "-rfE",
    ]  # fmt: skip
    print(f"[test-miles] {mode}: {' '.join(command[1:])} (in {miles_dir})", flush=True)
    report.unlink(missing_ok=True)
    process = subprocess.Popen(command, cwd=miles_dir, env=env, start_new_session=True)
    try:
        return process.wait(timeout=RUN_TIMEOUT_S)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        os.killpg(process.pid, signal.SIGKILL)  # the group this script started: pytest and its gateways
        process.wait()
        print(f"[test-miles] {mode}: stopped after {RUN_TIMEOUT_S} s", flush=True)
        return 124


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1]


def summarize(baseline: dict[str, Any], gate: dict[str, Any] | None, expected_path: Path) -> tuple[str, bool]:
    """The side-by-side table and the failing tests by cause, as Markdown; and whether the run is green."""
    causes = tomllib.loads(expected_path.read_text()).get("causes", {}) if expected_path.exists() else {}
    base_tests: dict[str, dict[str, Any]] = baseline["tests"]
    gate_tests: dict[str, dict[str, Any]] = gate["tests"] if gate else {}
    http = sorted(nodeid for nodeid, result in base_tests.items() if result["servers"])
    lines: list[str] = []
    add = lines.append

    per_file: dict[str, Counter[str]] = defaultdict(Counter)
    for nodeid, result in base_tests.items():
        counts = per_file[file_of(nodeid)]
        counts["tests"] += 1
        counts[f"base_{result['outcome']}"] += 1
        if result["servers"]:
            counts["http"] += 1
            outcome = gate_tests.get(nodeid, {}).get("outcome") or "not run"
            counts[f"gate_{outcome}"] += 1
    add(
        "| file | tests | miles' servers: passed / failed / skipped | HTTP | rolloutgate: passed / expected fail / other fail |"
    )
    add("| --- | ---: | --- | ---: | --- |")
    total: Counter[str] = Counter()
    for name in sorted(per_file):
        counts = per_file[name]
        total.update(counts)
        add(row(name, counts))
    add(row("**all**", total))
    add("")
    base_failed = total["base_failed"] + total["base_error"]
    other_fail = sum(total[f"gate_{kind}"] for kind in ("failed", "error", "xpassed_strict", "not run"))
    add(
        f"miles' servers: {total['base_passed']} passed, {base_failed} failed, {total['base_skipped']} skipped "
        f"of {total['tests']} (in {baseline['duration_s']:.0f} s). Of the {len(http)} tests that speak HTTP, "
        f"on rolloutgate: {total['gate_passed']} passed, {total['gate_xfailed']} failed as expected, "
        f"{other_fail} failed otherwise"
        + (f" (in {gate['duration_s']:.0f} s)." if gate else ".")
        + f" Not transferable (miles' objects in process): {total['tests'] - len(http) - total['base_skipped']}."
    )
    if baseline.get("records_standin"):
        add(
            "(miles' `tests.fast.rollout.session.test_samples._make_record` is not in ../shared/peers/miles: "
            "tests/compat/miles/rg_miles_records.py stood in for it, in both runs.)"
        )
    add("")

    failing = [
        nodeid for nodeid in http if gate_tests.get(nodeid, {}).get("outcome") not in ("passed", "skipped")
    ]
    by_cause: dict[str, list[str]] = defaultdict(list)
    for nodeid in failing:
        result = gate_tests.get(nodeid, {})
        if result.get("outcome") == "xfailed":
            by_cause[result.get("expected_cause", "?")].append(nodeid)
        else:
            by_cause["UNEXPECTED"].append(nodeid)
    if failing:
        add(f"### The {len(failing)} HTTP tests failing on rolloutgate, by cause")
        add("")
    for cause in sorted(by_cause, key=lambda name: (name != "UNEXPECTED", -len(by_cause[name]), name)):
        if cause == "UNEXPECTED":
            add(f"- **not on the expected-failure list** ({len(by_cause[cause])}):")
            for nodeid in by_cause[cause]:
                result = gate_tests.get(nodeid, {})
                add(f"  - `{nodeid}`: {result.get('outcome', 'not run')}: {result.get('message', '')}")
            continue
        why = " ".join(causes.get(cause, {}).get("why", "").split())
        add(f"- **{cause}** ({len(by_cause[cause])}): {why}")
        for nodeid in by_cause[cause]:
            add(f"  - `{nodeid.removeprefix('tests/fast/router/')}`")
    missing: Counter[str] = Counter()
    for nodeid in http:
        for flag in gate_tests.get(nodeid, {}).get("missing_flags", []):
            missing[flag.split(" (", 1)[0].split(" -> ", 1)[-1].split("=", 1)[0]] += 1
    if missing:
        add("")
        add(
            "miles settings without a rolloutgate flag, and the HTTP tests that set them: "
            + ", ".join(f"`{flag}` ({count})" for flag, count in missing.most_common())
        )
    green = (
        not by_cause.get("UNEXPECTED") and base_failed == 0 and gate is not None and gate["exitstatus"] == 0
    )
    return "\n".join(lines), green


def row(name: str, counts: Counter[str]) -> str:
    other = sum(counts[f"gate_{kind}"] for kind in ("failed", "error", "xpassed_strict", "not run"))
    gate = f"{counts['gate_passed']} / {counts['gate_xfailed']} / {other}" if counts["http"] else "-"
    return (
        f"| {name} | {counts['tests']} | {counts['base_passed']} / {counts['base_failed'] + counts['base_error']} / "
        f"{counts['base_skipped']} | {counts['http']} | {gate} |"
    )


def not_transferable(baseline: dict[str, Any]) -> list[str]:
    return sorted(
        nodeid
        for nodeid, result in baseline["tests"].items()
        if not result["servers"] and result["outcome"] != "skipped"
    )


def not_transferable_markdown(baseline: dict[str, Any]) -> str:
    """The tests that drive miles' objects in process, by file, parametrized cases folded into one name."""
    by_file: dict[str, dict[str, list[str]]] = defaultdict(dict)
    for nodeid in not_transferable(baseline):
        path, name = nodeid.split("::", 1)
        base, _, case = name.partition("[")
        by_file[file_of(path)].setdefault(base, []).append(case.rstrip("]"))
    lines = []
    for file, names in sorted(by_file.items()):
        count = sum(len(cases) for cases in names.values())
        shown = [
            f"`{base}`" + (f" ({len(cases)} cases)" if cases != [""] else "") for base, cases in names.items()
        ]
        lines.append(f"- {file} ({count}): " + ", ".join(shown))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=["baseline", "run", "summary", "fixed-template"])
    parser.add_argument("--miles-dir", type=Path, default=REPO.parent / "shared" / "peers" / "miles")
    parser.add_argument("--venv", type=Path, default=REPO / ".venv-miles")
    parser.add_argument("--baseline", type=Path, default=REPO / "out" / "miles" / "baseline.json")
    parser.add_argument("--out", type=Path, default=REPO / "out" / "miles" / "rolloutgate.json")
    parser.add_argument("--expected", type=Path, default=EXPECTED)
    options = parser.parse_args()
    miles_dir, venv = options.miles_dir.resolve(), options.venv.resolve()

    if options.command == "baseline":
        started = time.monotonic()
        status = run_pytest("baseline", miles_dir, venv, options.out.resolve(), {})
        print(
            f"[test-miles] baseline: pytest exit {status} in {time.monotonic() - started:.0f} s", flush=True
        )
        return status

    if options.command == "fixed-template":
        # miles' agent parity test again, with the fixed template miles registers for its family (qwen3:
        # qwen3_fixed.jinja, clear_thinking false) passed as --chat-template-path: 16 trajectories, both codecs
        status = run_pytest(
            "rolloutgate", miles_dir, venv, options.out.resolve(), {"RG_MILES_FIXED_TEMPLATE": "1"}, PARITY
        )
        print(f"[test-miles] parity on miles' fixed template: pytest exit {status}", flush=True)
        return status

    if options.command == "run":
        started = time.monotonic()
        shutil.rmtree(
            options.out.resolve().parent / "gateway-logs", ignore_errors=True
        )  # this run's logs only
        status = run_pytest(
            "rolloutgate",
            miles_dir,
            venv,
            options.out.resolve(),
            {
                "RG_MILES_BASELINE": str(options.baseline.resolve()),
                "RG_MILES_EXPECTED": str(options.expected.resolve()),
            },
        )
        print(
            f"[test-miles] rolloutgate: pytest exit {status} in {time.monotonic() - started:.0f} s",
            flush=True,
        )

    baseline = load(options.baseline)
    gate = load(options.out) if options.out.exists() else None
    text, green = summarize(baseline, gate, options.expected)
    options.out.with_suffix(".md").write_text(
        "# miles' own suite: miles' servers and rolloutgate side by side\n\n" + text + "\n\n"
        f"## Not transferable: the {len(not_transferable(baseline))} tests that drive miles' objects in process\n\n"
        + not_transferable_markdown(baseline)
        + "\n"
    )
    print("\n" + "=" * 40 + " miles' suite: miles' servers | rolloutgate " + "=" * 40)
    print(text)
    print(f"(written to {options.out.with_suffix('.md')}; not-transferable tests listed there)")
    return 0 if green else 1


if __name__ == "__main__":
    sys.exit(main())
