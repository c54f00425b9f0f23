#!/usr/bin/env bash
# tests/test_surface.py (the commands as a new user meets them) against a wheel installed outside the tree: the
# wheel in a folder of its own, the tests with the files they read (results/, .gitignore) copied beside it, so the
# lra they import is the wheel's (the test's INSTALLED names it).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip install -q --no-deps --no-build-isolation --target "$work/site" "$root"
mkdir "$work/tree"
cp -r "$root/tests" "$root/results" "$root/.gitignore" "$work/tree/"
cd "$work/tree"
PYTHONPATH="$work/site" python3 -m pytest -q -p no:cacheprovider tests/test_surface.py
