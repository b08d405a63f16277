#!/usr/bin/env bash
# Quick start 2: install into .venv with the test extras and run the whole test suite
# (slow end-to-end tests included). Extra arguments go to pytest.
source "$(dirname "$0")/_venv.sh" "[test]"
# torch is only the test-time reference for the model. Ask for the CPU build by its local version
# so that pip never pulls the multi-GB CUDA wheels; without it the live cross-checks skip and the
# committed reference fixtures still run.
echo "[setup] installing CPU torch (test-only reference for the model)"
"$VPY" -m pip install -q "torch==2.13.0+cpu" 2>/dev/null || echo "note: no CPU torch wheel found; live transformers cross-checks will skip"
# SGLang's own API schema for the protocol contract test (one file from the sglang wheel).
echo "[setup] fetching SGLang's API schema for the protocol contract test"
PYTHON="$VPY" bash scripts/fetch_sglang_schema.sh >/dev/null || echo "note: could not fetch SGLang's schema; the protocol contract and launch-flag tests will fail"
# Three worker processes (pytest-xdist), one test file at a time each. Three on two cores,
# because most end-to-end tests wait on the servers and runs they start as child processes: on a
# 2-core machine the suite took 18 min with three workers against about 40 with two (2026-11-27).
# TEST_WORKERS=1 runs everything in this process, in order. The 25 slowest tests are listed at
# the end, to keep the suite inside its time budget, and every test's time goes to
# .cache/test-report.xml: `python -m tests.durations .cache/test-report.xml` turns a whole run's
# into tests/durations.json, the order in which workers take the files.
WORKERS=${TEST_WORKERS:-3}
ARGS=(-q --durations=25 --junitxml=.cache/test-report.xml)
if [[ "$WORKERS" != 1 ]]; then ARGS+=(-n "$WORKERS" --dist loadfile); fi
echo "[test] .venv/bin/python -m pytest ${ARGS[*]} $*"
exec "$VPY" -m pytest "${ARGS[@]}" "$@"
