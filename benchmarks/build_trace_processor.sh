#!/usr/bin/env bash
# Perfetto's trace processor (trace_processor_shell) built from source, for machines that cannot
# download its prebuilt binary (the `perfetto` Python package fetches one from Google storage at
# run time). Used to check that Perfetto itself reads the traces MegaScan writes:
#
#   git clone --depth 1 --branch v58.2 https://github.com/google/perfetto /tmp/perfetto-src
#   bash benchmarks/build_trace_processor.sh /tmp/perfetto-src
#   export PERFETTO_TRACE_PROCESSOR=/tmp/perfetto-src/out/tp/trace_processor_shell
#   python -m pytest tests/scan/test_perfetto.py          # the trace-processor test runs, not skips
#   python benchmarks/aggregate_scale.py --dp 64 --format perfetto --focus-suspects 1000 \
#       --trace-processor "$PERFETTO_TRACE_PROCESSOR"
#
# Needs Debian's generate-ninja ninja-build g++ pkg-config npm libprotobuf-dev libprotoc-dev
# protobuf-compiler zlib1g-dev (the system protobuf and zlib are linked). Perfetto v58 needs SQLite
# 3.41.2 or newer, newer than Debian 12's; its pinned SQLite comes from Google storage, so the
# SQLite amalgamation shipped in the better-sqlite3 npm package is used instead (npm is reachable
# where Google storage is not). SQLite's percentile extension is then missing and turned off.
# About 40 minutes on 2 cores at -j2; the binary keeps its debug info (about 460 MB).
set -euo pipefail

SOURCE=${1:?usage: build_trace_processor.sh PERFETTO_SOURCE_DIR (a checkout of google/perfetto v58.2)}
SQLITE_NPM=${SQLITE_NPM:-better-sqlite3@12.11.1}
JOBS=${JOBS:-2}
OUT=${OUT:-out/tp}  # the build directory inside the checkout
cd "$SOURCE"
[[ -f gn/perfetto.gni ]] || { echo "error: $SOURCE is not a Perfetto checkout (no gn/perfetto.gni)" >&2; exit 2; }
for tool in gn ninja g++ protoc npm; do
    command -v "$tool" >/dev/null || {
        echo "error: $tool not found; apt-get install generate-ninja ninja-build g++ pkg-config npm" \
             "libprotobuf-dev libprotoc-dev protobuf-compiler zlib1g-dev" >&2
        exit 2
    }
done

# A recent SQLite where Perfetto's build looks for it (buildtools/sqlite).
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
(cd "$scratch" && npm pack --silent "$SQLITE_NPM" >/dev/null && tar xzf ./*.tgz)
mkdir -p buildtools/sqlite buildtools/sqlite_src/ext/misc
cp "$scratch"/package/deps/sqlite3/sqlite3.{c,h} "$scratch"/package/deps/sqlite3/sqlite3ext.h buildtools/sqlite/
# The build lists this extension's source even with the feature off; it is compiled empty.
[[ -f buildtools/sqlite_src/ext/misc/percentile.c ]] ||
    echo '/* the percentile extension is disabled in this build */' > buildtools/sqlite_src/ext/misc/percentile.c

mkdir -p "$OUT"
cat > "$OUT/args.gn" <<'ARGS'
is_debug = false
is_clang = false
is_system_compiler = true
use_custom_libcxx = false
skip_buildtools_check = true
perfetto_use_system_protobuf = true
perfetto_use_system_sqlite = false
perfetto_use_system_zlib = true
enable_perfetto_zstd = false
enable_perfetto_re2 = false
enable_perfetto_llvm_demangle = false
enable_perfetto_trace_processor_linenoise = false
enable_perfetto_trace_processor_percentile = false
enable_perfetto_trace_processor_mac_instruments = false
enable_perfetto_etm_importer = false
enable_perfetto_ui = false
enable_perfetto_unittests = false
enable_perfetto_integration_tests = false
enable_perfetto_benchmarks = false
enable_perfetto_fuzzers = false
enable_perfetto_heapprofd = false
enable_perfetto_traced_perf = false
enable_perfetto_stderr_crash_dump = false
ARGS
gn gen "$OUT"
ninja -C "$OUT" -j "$JOBS" trace_processor_shell
"$OUT/trace_processor_shell" --version
echo "built: $PWD/$OUT/trace_processor_shell (export PERFETTO_TRACE_PROCESSOR=$PWD/$OUT/trace_processor_shell)"
