#!/usr/bin/env bash
# Set up (scripts/setup.sh), lint (ruff), build the docs (mkdocs --strict) and run the test suite. pytest's exit
# code 5 (no tests collected) fails.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
# The report's browser test renders report.html in Debian's chromium (tests/integration/test_report_html.py). Install
# it when missing and we can (root with apt); otherwise that test is skipped with a reason naming the package.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
    || echo "test.sh: could not install the Debian package chromium; the browser test will be skipped" >&2
fi
# Lint and format (settings in pyproject.toml) before the tests, so CI keeps them.
.venv/bin/ruff check . || exit 1
.venv/bin/ruff format --check . || exit 1
# The documentation site (mkdocs.yml: strict, links and anchors validated), built into a temporary folder so that
# nothing is written into the checkout: a broken link or a page missing from the navigation fails here. Not with
# --quiet: MkDocs 1.6 then stops counting warnings and --strict passes a broken link (checked); its log is printed
# only when the build fails.
site=$(mktemp -d) || exit 1
if ! log=$(.venv/bin/mkdocs build --strict -d "$site" 2>&1); then
  echo "$log" >&2; rm -rf "$site"; exit 1
fi
rm -rf "$site"
# Three pytest workers (pytest-xdist) on the 2 cores: many tests wait on a subprocess, a rank or a poll, and a third
# worker fills that time (the suite took ~15% less wall time than with two); tests/conftest.py gives each one
# intra-op thread.
.venv/bin/python -m pytest -n "${LOWPREC_TEST_WORKERS:-3}" --dist worksteal "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi
exit "$rc"
