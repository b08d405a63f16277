#!/usr/bin/env bash
# Quick start 1: install into .venv and run the main job on the embedded default: asynchronous RL
# on CPU with a tiny model built locally, no downloads. Extra arguments are config overrides
# (key=value) for `areal-jax train`, e.g. `bash scripts/demo.sh steps=300 rollout.max_staleness=4`.
source "$(dirname "$0")/_venv.sh" ""
echo "[demo] .venv/bin/areal-jax train --config configs/demo.yaml $*"
# not exec: the run times its start from its own process start, which exec would date back to
# this script's, the install above included
.venv/bin/areal-jax train --config configs/demo.yaml "$@"
