#!/usr/bin/env python3
"""Prints the slowest tests of a nextest JUnit report (scripts/test.sh calls it after the run).

Usage: slowest.py REPORT.xml [N]   (N defaults to 10)
"""
import sys
import xml.etree.ElementTree as ET


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    report, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10
    try:
        root = ET.parse(report).getroot()
    except (OSError, ET.ParseError) as e:
        print(f"slowest: no report to read ({e})", file=sys.stderr)
        return 1
    cases = [
        (float(case.get("time", "0")), f"{suite.get('name', '?')} {case.get('name', '?')}")
        for suite in root.iter("testsuite")
        for case in suite.iter("testcase")
    ]
    total = float(root.get("time", "0")) or sum(t for t, _ in cases)
    print(f"{len(cases)} tests, {total:.0f} s wall; the {min(n, len(cases))} slowest:")
    for t, name in sorted(cases, reverse=True)[:n]:
        print(f"  {t:8.1f} s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
