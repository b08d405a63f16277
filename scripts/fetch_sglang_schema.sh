#!/usr/bin/env bash
# Fetch, from the pinned sglang wheel into .cache/sglang/: its generated HTTP schema
# (sglang/api/v1/api_types.py, needs only msgspec), read by the protocol contract test, and the
# sources that declare `sglang.launch_server`'s flags (srt/server_args.py and
# srt/arg_groups/fields/*.py), read by the launch-command test. Nothing is imported or installed.
set -euo pipefail
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${SGLANG_SCHEMA_CACHE:-$ROOT/.cache/sglang}"
PYTHON="${PYTHON:-python}"
OUT="$CACHE/api_types.py"
if [ -f "$OUT" ] && [ -d "$CACHE/server_args" ] && [ "$(cat "$CACHE/VERSION" 2>/dev/null)" = "$SGLANG_VERSION" ]; then
  echo "$OUT (sglang $SGLANG_VERSION) already present"; exit 0
fi
mkdir -p "$CACHE/wheel"
"$PYTHON" -m pip download --no-deps --only-binary=:all: "sglang==$SGLANG_VERSION" -d "$CACHE/wheel" >&2
WHEEL="$(ls "$CACHE"/wheel/sglang-"$SGLANG_VERSION"-*.whl | head -n1)"
"$PYTHON" - "$WHEEL" "$OUT" "$CACHE/server_args" <<'PY'
import os, sys, zipfile
wheel, out, args_dir = sys.argv[1], sys.argv[2], sys.argv[3]
with zipfile.ZipFile(wheel) as z:
    with open(out, "wb") as f:
        f.write(z.read("sglang/api/v1/api_types.py"))
    os.makedirs(args_dir, exist_ok=True)
    for name in z.namelist():
        if name == "sglang/srt/server_args.py" or (
                name.startswith("sglang/srt/arg_groups/fields/") and name.endswith(".py")):
            with open(os.path.join(args_dir, os.path.basename(name)), "wb") as f:
                f.write(z.read(name))
PY
echo "$SGLANG_VERSION" > "$CACHE/VERSION"
rm -rf "$CACHE/wheel"
echo "$OUT"
