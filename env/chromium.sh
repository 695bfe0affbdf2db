#!/usr/bin/env bash
# Install Debian's chromium, which the report's test uses to open report.html headless and screenshot it
# (tests/report_check.py). Needs root and apt; env/test.sh runs it. Exit 0: chromium is there; 2: it is not and
# cannot be installed here (not root, no apt-get); anything else: the install failed.
set -euo pipefail
if command -v chromium >/dev/null; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "[chromium] not installed, and installing it needs root and apt-get: the report's browser test is skipped" >&2
  exit 2
fi
export DEBIAN_FRONTEND=noninteractive
apt=(apt-get install -y -q --no-install-recommends chromium)
echo "[chromium] apt-get install chromium"
if ! "${apt[@]}" >/dev/null; then
  echo "[chromium] install failed: apt-get update and retry"
  apt-get update -q >/dev/null
  "${apt[@]}" >/dev/null
fi
command -v chromium >/dev/null
