#!/usr/bin/env bash
# Set up a fresh machine and run the test suite on CPU; what CI runs (.ci/run calls only this).
#   bash scripts/run_tests.sh                  # everything: set-up, MegaScope's vitest, all of tests/
#   bash scripts/run_tests.sh tests/scope -x   # set-up, then pytest on what the arguments select
#   bash scripts/run_tests.sh --quick [ARGS]   # set-up, then the unit tests only, no vitest: a local
#                                              # loop of under a minute, not CI (--quick tests/app -x)
# --quick leaves out the tests marked multiprocess (torchrun, subprocesses, multiprocessing), server
# (one of our network servers) and browser; tests/conftest.py marks them by what they reach and fails
# a test that starts a process or a server without its marker, so the quick selection stays in-process.
# Set-up (scripts/setup_test_env.sh), the same for both forms and quick once done: as root with
# apt-get, the system packages some tests need (iproute2, prometheus, libibverbs-dev, chromium);
# .venv with torch and megatron-app[test] (pip runs only when pyproject.toml, setup.py or the C++
# sources changed); MegaScope's web app (npm ci when package-lock.json changed, the build when its
# sources did). A step that cannot run says why in one line; the tests needing it then skip.
# The web app's vitest tests run in the full form only (WEB_TESTS=1 adds them to a subset,
# WEB_TESTS=0 drops them); a failed vitest or web build fails the full run after pytest has run.
# TEST_SETUP=0 skips the system and web steps; NO_APT=1 only the apt one; REBUILD=1 reinstalls.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/common.sh
. scripts/setup_test_env.sh
quick=0
pytest_args=()
for arg in "$@"; do
    if [ "$arg" = --quick ]; then quick=1; else pytest_args+=("$arg"); fi
done
setup_test_env
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

web_status=0
default_web=0
[ $# -eq 0 ] && default_web=1
if [ "${WEB_TESTS:-$default_web}" = 1 ] && [ "${TEST_SETUP:-1}" != 0 ]; then
    web_unit_tests || web_status=$?
    [ -z "${WEB_BUILD_FAILED:-}" ] || web_status=1
fi

selection=()
[ "$quick" = 0 ] || selection=(-m "not multiprocess and not server and not browser")
status=0
# The 25 slowest tests are listed at the end of every run (tests marked `slow` take 25 s or more).
python -m pytest -q --timeout 900 --durations 25 "${selection[@]}" "${pytest_args[@]:-tests}" || status=$?
if [ "$web_status" -ne 0 ]; then
    echo "MegaScope web app: vitest or the web build FAILED (see above)"
    [ "$status" -ne 0 ] || status=1
fi
exit "$status"
