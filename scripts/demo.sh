#!/usr/bin/env bash
# Quick start 1: install into .venv and run the main job on the embedded default
# (CPU, a tiny model built locally, no downloads). Extra arguments go to `areal-jax demo`.
source "$(dirname "$0")/_venv.sh" ""
exec .venv/bin/areal-jax demo "$@"
