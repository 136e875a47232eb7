#!/usr/bin/env bash
# CPU side of a same-call A/B on the H200: this tree's kernels against another commit's, built here (no GPU).
#
#   bash tests/gpu/ab_prepare.sh REV [codegen args]      e.g.  bash tests/gpu/ab_prepare.sh main \
#        --config slice:4 --tp 8 --buckets 1,8,64 --max-context 32768
#   then, on the GPU host:  bash tests/gpu/ab.sh [bench args]   (run with carry [".gpu", ".whl"])
#
# With EXAMPLES=moe_down_combine,gemv (templates) it also builds both commits' `codegen --examples k3tp8`
# packages of those templates (EXAMPLE_PREFIXES: other example prefixes, comma-separated), which ab.sh times
# alone with `bench-kernels` (same inputs for both) and session.sh tests.
#
# Writes .gpu/ab/: new.tgz and old.tgz (the two packages, compressed: a device call carries at most 64 MiB,
# tracked files included), old_wheel/ (REV's k3compile: kernel names carry their template sources' hash, so
# each package runs under its own code), REV (the commit), and .gpu/libcute_dsl_runtime.so.gz and
# .whl/ (apache-tvm-ffi for the GPU host's Python 3.12) when missing. A package is pruned to what loads (the
# .so files and the manifest); the CuTe DSL runtime travels once, gzipped.
set -euo pipefail
REV=${1:?usage: ab_prepare.sh REV [codegen args]}
shift
ARGS=("$@")
[ ${#ARGS[@]} -gt 0 ] || ARGS=(--config slice:4 --tp 8 --buckets 1,8,64 --max-context 32768)
ROOT=$(pwd)
AB=$ROOT/.gpu/ab
TMP=$(mktemp -d)
trap 'git -C "$ROOT" worktree remove --force "$TMP/tree" >/dev/null 2>&1 || true; rm -rf "$TMP"' EXIT
mkdir -p .git/info && grep -qx ".gpu/" .git/info/exclude 2>/dev/null || printf ".gpu/\n.whl/\n" >> .git/info/exclude
rm -rf "$AB" && mkdir -p "$AB/old_wheel"
git rev-parse --verify -q "$REV^{commit}" > "$AB/REV" || { echo "ab_prepare: no commit $REV" >&2; exit 2; }

codegen() {  # new|old OUT, then codegen arguments: into OUT under this tree's code or REV's wheel, pruned
    local which=$1 out=$2
    shift 2
    if [ "$which" = new ]; then
        k3compile codegen "$@" --package -o "$out" > "$TMP/$which.log" 2>&1
    else  # from outside the checkout, so that the old wheel (not this tree) is imported; its own compile cache
        (cd "$TMP" && PYTHONPATH="$TMP/site" K3COMPILE_CACHE="$TMP/cache_old" python -m k3compile.cli codegen "$@" \
            --package -o "$out" > "$TMP/$which.log" 2>&1)
    fi || { tail -20 "$TMP/$which.log"; exit 1; }
    [ -f .gpu/libcute_dsl_runtime.so.gz ] || gzip -9 -c "$out/runtime/libcute_dsl_runtime.so" > .gpu/libcute_dsl_runtime.so.gz
    prune "$out"
}

prune() {  # keep what a GPU host loads
    rm -rf "$1/runtime"
    find "$1" \( -name kernel.ptx -o -name kernel.cubin \) -delete
}

echo "== this tree: k3compile codegen ${ARGS[*]} --package"
codegen new "$TMP/new" "${ARGS[@]}"

echo "== $REV ($(cut -c1-12 "$AB/REV")): its own wheel and package"
git worktree add -q --detach "$TMP/tree" "$(cat "$AB/REV")"
python -m pip wheel -q --no-deps --no-build-isolation "$TMP/tree" -w "$AB/old_wheel" > "$TMP/wheel.log" 2>&1 \
    || { tail -20 "$TMP/wheel.log"; exit 1; }
python -m pip install -q --no-deps --target "$TMP/site" "$AB"/old_wheel/*.whl > /dev/null 2>&1
codegen old "$TMP/old" "${ARGS[@]}"

if [ -n "${EXAMPLES:-}" ]; then
    PREFIXES=${EXAMPLE_PREFIXES:-k3tp8}
    echo "== the $PREFIXES examples of $EXAMPLES, both commits"
    codegen new "$TMP/new/examples" --examples "$PREFIXES" --templates "$EXAMPLES"
    # examples new in this tree are not in REV: then only this tree's are timed and tested
    (codegen old "$TMP/old/examples" --examples "$PREFIXES" --templates "$EXAMPLES") \
        || { echo "   ($REV has not all of them: this tree's examples only)"; rm -rf "$TMP/old/examples"; }
fi
tar czf "$AB/new.tgz" -C "$TMP" new
tar czf "$AB/old.tgz" -C "$TMP" old
if ! ls .whl/apache_tvm_ffi-*.whl > /dev/null 2>&1; then
    python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 -d .whl apache-tvm-ffi
fi
du -sh "$AB" .gpu/libcute_dsl_runtime.so.gz .whl
echo "carry: [\".gpu\", \".whl\"] (with the tracked files, at most 64 MiB; remove other .gpu/ content if over)"
