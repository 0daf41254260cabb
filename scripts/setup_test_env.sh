# What the test suite needs beyond Python, set up by scripts/run_tests.sh (sourced; functions only).
# Every step is idempotent, costs a few checks when its work is already done, and where it cannot
# do its work (not root, no apt-get, no npm, offline) prints one line saying why and goes on: the
# tests that need what is missing skip with their own reason.
#   system packages (apt, as root): iproute2 (`ip`: network-namespace tests of the TCP transport),
#     prometheus (`promtool`: the alert rules), libibverbs-dev (the RDMA verbs transport is compiled
#     in; so it comes before the Python install), chromium (MegaScope's browser test), openmpi-bin and
#     libopenmpi-dev (`mpirun`, `mpicc` and mpi.h: the Open MPI reference of benchmarks/shm_p2p.py)
#   Python test dependencies: `pip install -e ".[test]"`, skipped while nothing it depends on changed
#   MegaScope web app: `npm ci` when node_modules is older than package-lock.json; the app ships built
#     (megatron/scope/web/dist, committed), rebuilt with `python -m megatron.scope build-web` only when
#     its manifest no longer matches the sources; `web_unit_tests` runs vitest (each time it is called)
# Environment: TEST_SETUP=0 skips the system and web steps; NO_APT=1 skips apt only; REBUILD=1
# reinstalls the Python package.

WEB_DIR=megatron/scope/web

_setup_say() { echo "[setup] $*"; }

# One set-up at a time per checkout (parallel runs of the tests would race on apt, pip and npm).
_setup_lock() {
    command -v flock >/dev/null || return 0
    local key
    key=$(pwd | cksum | cut -d' ' -f1)
    exec 9>"${TMPDIR:-/tmp}/megatron-app-setup-$key.lock"
    flock 9
}
_setup_unlock() { command -v flock >/dev/null && exec 9>&- || true; }

setup_system_packages() {
    local missing=()
    command -v ip >/dev/null || missing+=(iproute2)
    command -v promtool >/dev/null || missing+=(prometheus)
    [ -f /usr/include/infiniband/verbs.h ] || missing+=(libibverbs-dev)
    [ -x "${CHROMIUM:-/usr/bin/chromium}" ] || missing+=(chromium)
    command -v mpirun >/dev/null || missing+=(openmpi-bin)
    [ -f "$(mpicc --showme:incdirs 2>/dev/null | cut -d' ' -f1)/mpi.h" ] || missing+=(libopenmpi-dev)
    if [ ${#missing[@]} -eq 0 ]; then
        _setup_say "system packages: present (ip, promtool, infiniband/verbs.h, chromium, mpirun, mpi.h)"
    elif [ -n "${NO_APT:-}" ]; then
        _setup_say "system packages: ${missing[*]} missing, not installed (NO_APT is set)"
    elif [ "$(id -u)" != 0 ]; then
        _setup_say "system packages: ${missing[*]} missing, not installed (not root: sudo apt-get install ${missing[*]})"
    elif ! command -v apt-get >/dev/null; then
        _setup_say "system packages: ${missing[*]} missing, not installed (no apt-get on this system)"
    else
        _setup_say "system packages: installing ${missing[*]}"
        if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } >/tmp/megatron-app-apt.log 2>&1; then
            _setup_say "system packages: could not install ${missing[*]} (offline? see /tmp/megatron-app-apt.log)"
        fi
    fi
}

# A fingerprint of what `pip install -e ".[test]"` builds from: package metadata, the C++ sources
# and whether the verbs headers are there (they change what is compiled).
_python_fingerprint() {
    {
        cat pyproject.toml setup.py
        find megatron -path '*/csrc/*' -type f -print0 | sort -z | xargs -0 cat
        [ -f /usr/include/infiniband/verbs.h ] && echo verbs
        echo "${SHM_TENSOR_RDMA_VERBS:-}"
    } | cksum | cut -d' ' -f1
}

setup_python_test_deps() {
    local stamp="${VIRTUAL_ENV:-.venv}/.megatron-app-test-install" want
    want=$(_python_fingerprint)
    # by metadata and module lookup, not import (importing torch and transformers costs seconds)
    if [ -z "${REBUILD:-}" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] \
            && compgen -G "megatron/shm_tensor_rdma/_C*.so" >/dev/null && python -c "
import importlib.metadata as m, importlib.util as u
m.version('megatron-app'), m.version('megatron-core')
assert all(u.find_spec(name) for name in ('pytest', 'pytest_timeout', 'tensorboard', 'transformers', 'yaml'))" 2>/dev/null; then
        _setup_say "python: megatron-app[test] up to date in ${VIRTUAL_ENV:-the active environment}"
        return 0
    fi
    _setup_say "python: pip install -e .[test]"
    python -m pip install -q -e ".[test]" && echo "$want" >"$stamp"
}

setup_web_app() {
    if ! command -v npm >/dev/null; then
        _setup_say "web app: npm not found; MegaScope serves its shipped build (vitest and browser tests skip)"
        return 0
    fi
    if [ -f "$WEB_DIR/node_modules/.package-lock.json" ] \
            && [ "$WEB_DIR/node_modules/.package-lock.json" -nt "$WEB_DIR/package-lock.json" ] \
            && [ "$WEB_DIR/node_modules/.package-lock.json" -nt "$WEB_DIR/package.json" ]; then
        _setup_say "web app: node_modules up to date with package-lock.json"
    else
        _setup_say "web app: npm ci"
        if ! (cd "$WEB_DIR" && npm ci --no-audit --no-fund --loglevel=error >/tmp/megatron-app-npm-ci.log 2>&1); then
            _setup_say "web app: npm ci failed (offline? see /tmp/megatron-app-npm-ci.log); web tests skip"
            return 0
        fi
    fi
    # By content (the manifest's blob ids), not mtimes: a fresh clone's shipped build is not rebuilt.
    # Rebuilding here fixes the working tree only; tests/scope/test_scope_web_build.py still fails for
    # a commit whose sources changed without its build.
    if python -m megatron.scope build-web --check >/dev/null 2>&1; then
        _setup_say "web app: the shipped build in $WEB_DIR/dist matches its sources"
    else
        _setup_say "web app: sources changed since the shipped build: python -m megatron.scope build-web" \
            "(commit $WEB_DIR/dist with them)"
        python -m megatron.scope build-web || { WEB_BUILD_FAILED=1; _setup_say "web app: build FAILED"; }
    fi
}

# vitest over the web app's components; returns its status (0 when npm or node_modules is absent).
web_unit_tests() {
    if ! command -v npm >/dev/null || [ ! -f "$WEB_DIR/node_modules/.package-lock.json" ]; then  # written last by npm ci
        echo "[web] vitest skipped: web dependencies not installed"
        return 0
    fi
    echo "[web] npm test (vitest)"
    (cd "$WEB_DIR" && npm test --silent)
}

# Everything above, in order: system packages first (libibverbs-dev changes the C++ build).
setup_test_env() {
    WEB_BUILD_FAILED=""
    _setup_lock
    if [ "${TEST_SETUP:-1}" != 0 ]; then
        setup_system_packages
    else
        _setup_say "system packages and web app: skipped (TEST_SETUP=0)"
    fi
    activate_environment  # venv and torch; the package itself comes with its test extras:
    setup_python_test_deps
    [ "${TEST_SETUP:-1}" = 0 ] || setup_web_app
    _setup_unlock
}
