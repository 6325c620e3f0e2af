#!/usr/bin/env bash
# Debian's Chromium for the pool page's browser test (tests/test_pool_page.py, driven by Playwright with
# executable_path=/usr/bin/chromium; Playwright's own browser download is not used). Idempotent.
set -euo pipefail
say() { printf '\033[1m[fedpool chromium]\033[0m %s\n' "$*"; }
if command -v chromium >/dev/null 2>&1; then
  say "chromium already installed ($(command -v chromium))"
  exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
  SUDO=()
elif command -v sudo >/dev/null 2>&1; then
  SUDO=(sudo)
else
  say "chromium is missing and this user cannot install Debian packages: apt-get install chromium"
  exit 1
fi
say "installing Debian's chromium (about a minute)"
"${SUDO[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq chromium >/dev/null
say "ready: $(command -v chromium)"
