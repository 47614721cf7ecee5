#!/usr/bin/env bash
# Checks the fast path's protocol models exhaustively with spin: tests/model/fast_path.pml (acquire,
# retire, scan, crash) and tests/model/publish_wake.pml (how a waiting consumer is woken):
#   - each model as written must verify with 0 errors, every reachable state explored; the fast
#     path's in two configurations: "clients die" (2 clients with 2 lease slots each, 2
#     replacements, a client may die at any point) and "daemon restarts" (the same with 1 lease
#     slot each, and the daemon may also crash at any point and restart once);
#   - each deliberately broken variant (-DBROKEN_...) must be caught violating the property it
#     is named with (P1, P2, ...: the tag in the comment on the violated assertion's line, or
#     "end-state" for a run that ends with a process blocked); another error (a deadlock where
#     an assertion was expected, another property's assertion) fails the check. Its shortest
#     counterexample is replayed and summarised;
#   - each witness (-DWITNESS=n) must be reached, showing that the situations the properties are
#     about (a retire, a failed re-check, a validation on a crashed daemon's index, ...) occur.
# Exits non-zero if spin or gcc is missing, if the correct model has an error or is not explored
# completely, if a broken variant is not caught violating its property, or if a witness is not
# reached. Works in a
# temporary directory; runs two searches at a time (about 15 s on 2 cores).
#
#   tests/model/check.sh                          # what ctest runs (fast_path_model)
#   FAST_PATH_MODEL_KEEP=1 tests/model/check.sh   # keep the work directory (pan, trails, logs)
set -u

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
model="$here/fast_path.pml"  # the model of a check; `model=... check ...` names another
wake_model="$here/publish_wake.pml"
me=fast_path_model

missing=()
for tool in spin gcc; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "$me: FAILED: not found: ${missing[*]}. Install them (Debian: apt-get install -y spin" \
       "gcc; scripts/setup.sh does)." >&2
  exit 1
fi
for file in "$model" "$wake_model"; do
  if [ ! -r "$file" ]; then
    echo "$me: FAILED: $file not readable" >&2
    exit 1
  fi
done

work=$(mktemp -d "${TMPDIR:-/tmp}/fast_path_model.XXXXXX") || exit 1
if [ -n "${FAST_PATH_MODEL_KEEP:-}" ]; then
  echo "$me: work directory $work (kept)"
else
  trap 'rm -rf "$work"' EXIT
fi

# Each check NAME reports into $work/NAME.out and, when it fails, touches $work/NAME.failed.
fail() {
  echo "$me: FAILED: $*"
  touch "$work/$name.failed"
}

# build NAME MODE DEFINES...: spin -a, then gcc, in $work/NAME. MODE: full (depth-first with state
# compression: exhaustive runs, witnesses) or shortest (breadth-first: the shortest
# counterexample). Unoptimised: pan.c compiles in about a second against seven at -O2, which
# saves more than the search loses.
build() {
  local name=$1 mode=$2
  shift 2
  local dir="$work/$name"
  mkdir -p "$dir"
  cp "$model" "$dir/model.pml"
  if ! (cd "$dir" && spin -a "$@" model.pml >spin.log 2>&1); then
    fail "$name: spin -a $* failed:"
    sed 's/^/    /' "$dir/spin.log"
    return 1
  fi
  local flags=(-O0 -w -DSAFETY -DMEMLIM=8192)
  if [ "$mode" = full ]; then flags+=(-DCOLLAPSE); else flags+=(-DBFS); fi
  if ! (cd "$dir" && gcc "${flags[@]}" -o pan pan.c >gcc.log 2>&1); then
    fail "$name: gcc ${flags[*]} pan.c failed:"
    sed 's/^/    /' "$dir/gcc.log"
    return 1
  fi
}

# Figures from pan's report.
stored() { sed -n 's/^ *\([0-9.e+]*\) states, stored.*/\1/p' "$1" | head -n 1; }
errors() { sed -n 's/.*errors: \([0-9]*\).*/\1/p' "$1" | head -n 1; }
elapsed() { sed -n 's/^pan: elapsed time \([0-9.e+]*\) seconds.*/\1/p' "$1" | head -n 1; }
incomplete() {
  grep -q -e 'Search not completed' -e 'max search depth too small' -e 'reached -DMEMLIM' \
    -e 'out of memory' "$1"
}

# replay DIR DEFINES...: the trail's MSC lines, then the violated assertion's source line.
replay() {
  local dir=$1
  shift
  (cd "$dir" && spin -t "$@" model.pml >replay.log 2>&1)
  grep 'MSC:' "$dir/replay.log" | sed 's/^ *MSC: /      /'
  local line
  line=$(sed -n 's/^spin: model.pml:\([0-9]*\), Error: assertion violated.*/\1/p' \
           "$dir/replay.log" | head -n 1)
  if [ -n "$line" ]; then
    echo "      => assertion violated at $(basename "$model"):$line: $(sed -n "${line}p" "$model" |
                                                            sed 's/^ *//')"
  fi
}

# expect_pass NAME DESCRIPTION DEFINES...: 0 errors, the search complete.
expect_pass() {
  local name=$1 what=$2
  shift 2
  build "$name" full "$@" || return
  local dir="$work/$name"
  (cd "$dir" && ./pan -m2000000 >pan.log 2>&1)
  local e s t
  e=$(errors "$dir/pan.log")
  s=$(stored "$dir/pan.log")
  t=$(elapsed "$dir/pan.log")
  if [ "$e" != 0 ] || incomplete "$dir/pan.log"; then
    fail "$name ($what) [spin $*]: errors: ${e:-?}, or the search did not complete:"
    sed 's/^/    /' "$dir/pan.log"
    if [ -e "$dir/model.pml.trail" ] && build "$name.shortest" shortest "$@"; then
      (cd "$work/$name.shortest" && ./pan >pan.log 2>&1)
      echo "    shortest counterexample:"
      replay "$work/$name.shortest" "$@"
    fi
    return
  fi
  echo "$me: ok: $what [spin $*]: 0 errors, ${s:-?} states stored (exhaustive), ${t:-0} s"
}

# violated DIR: the property the trail in DIR violates: the P<n> tag on the violated
# assertion's source line, "end-state" (pan's "invalid end state": a process blocked where it
# may not end), or "other: <pan's error line>".
violated() {
  local dir=$1 line tag
  line=$(sed -n 's/^spin: model.pml:\([0-9]*\), Error: assertion violated.*/\1/p' \
           "$dir/replay.log" | head -n 1)
  if [ -n "$line" ]; then
    tag=$(sed -n "${line}p" "$dir/model.pml" | grep -o '/\* *P[0-9][0-9]*' | grep -o 'P[0-9]*')
    echo "${tag:-other: untagged assertion at line $line}"
  elif grep -q '^pan:1: invalid end state' "$dir/pan.log"; then
    echo end-state
  else
    echo "other: $(grep -m1 '^pan:1:' "$dir/pan.log")"
  fi
}

# expect_caught NAME DESCRIPTION PROPERTY DEFINES...: >= 1 error, and the shortest counterexample
# violates PROPERTY (see violated); the shortest trail summarised.
expect_caught() {
  local name=$1 what=$2 property=$3
  shift 3
  build "$name" shortest "$@" || return
  local dir="$work/$name"
  (cd "$dir" && ./pan >pan.log 2>&1)
  local e s
  e=$(errors "$dir/pan.log")
  s=$(stored "$dir/pan.log")
  if [ -z "$e" ] || [ "$e" -lt 1 ] || [ ! -e "$dir/model.pml.trail" ]; then
    fail "$name ($what) [spin $*]: NOT caught (errors: ${e:-?}):"
    sed 's/^/    /' "$dir/pan.log"
    return
  fi
  (cd "$dir" && spin -t "$@" model.pml >replay.log 2>&1)
  local found
  found=$(violated "$dir")
  if [ "$found" != "$property" ]; then
    fail "$name ($what) [spin $*]: caught, but violating $found, not $property; shortest trail:"
    replay "$dir" "$@"
    sed 's/^/    /' "$dir/pan.log"
    return
  fi
  echo "$me: ok: $what [spin $*]: caught violating $property, $e error after ${s:-?} states;" \
       "shortest trail:"
  replay "$dir" "$@"
}

# expect_reached NAME DESCRIPTION DEFINES...: the witness's assertion fails, and no other.
expect_reached() {
  local name=$1 what=$2
  shift 2
  build "$name" full "$@" || return
  local dir="$work/$name"
  (cd "$dir" && ./pan -m2000000 >pan.log 2>&1)
  local e line=""
  e=$(errors "$dir/pan.log")
  if [ -n "$e" ] && [ "$e" -ge 1 ] && [ -e "$dir/model.pml.trail" ]; then
    (cd "$dir" && spin -t "$@" model.pml >replay.log 2>&1)
    line=$(sed -n 's/^spin: model.pml:\([0-9]*\), Error: assertion violated.*/\1/p' \
             "$dir/replay.log" | head -n 1)
  fi
  if [ -z "$line" ] || ! sed -n "${line}p" "$model" | grep -q 'REACHED('; then
    fail "$name ($what) [spin $*]: not reached (errors: ${e:-?}, failed line: ${line:-none}):"
    sed 's/^/    /' "$dir/pan.log"
    return
  fi
  echo "$me: ok: reached: $what [spin $*]"
}

# Up to two checks at a time (wait -n: bash 4.3).
names=()
check() {
  local name=$1 kind=$2
  shift 2
  names+=("$name")
  while [ "$(jobs -rp | wc -l)" -ge 2 ]; do wait -n; done
  "expect_$kind" "$name" "$@" >"$work/$name.out" 2>&1 &
}

start=$(date +%s)
crash_clients=(-DNO_DAEMON_CRASH)  # 2 slots per client, clients die
crash_daemon=(-DNS=1)              # 1 slot per client, clients die, the daemon crashes
check clients_die pass "correct model, clients die (2 slots each, 2 replacements)" \
  "${crash_clients[@]}"
check daemon_restarts pass "correct model, clients die, the daemon restarts (1 slot each)" \
  "${crash_daemon[@]}"
check no_recheck caught "broken: no re-check of the sequence after the hazard store" P1 \
  "${crash_clients[@]}" -DBROKEN_NO_RECHECK
check scan_before_unlink caught "broken: the daemon scans the pages before it unlinks" P1 \
  "${crash_clients[@]}" -DBROKEN_SCAN_BEFORE_UNLINK
check no_grace caught "broken: a restarted daemon frees unbound tensors at once" P1 \
  "${crash_daemon[@]}" -DBROKEN_NO_GRACE
check w1 reached "W1 a validated slot makes the daemon retire a tensor" \
  "${crash_clients[@]}" -DWITNESS=1
check w2 reached "W2 Reclaim frees a retired tensor" "${crash_clients[@]}" -DWITNESS=2
check w3 reached "W3 a client's re-check fails" "${crash_clients[@]}" -DWITNESS=3
check w4 reached "W4 a dead client's slot keeps a tensor retired" \
  "${crash_clients[@]}" -DWITNESS=4
check w5 reached "W5 a not yet validated hazard makes the daemon retire a tensor" \
  "${crash_clients[@]}" -DWITNESS=5
check w6 reached "W6 a client validates on a crashed daemon's index" \
  "${crash_daemon[@]}" -DWITNESS=6
check w7 reached "W7 the daemon crashes in the middle of a Bind" "${crash_daemon[@]}" -DWITNESS=7
check w8 reached "W8 a replaced tensor is re-registered after a restart" \
  "${crash_daemon[@]}" -DWITNESS=8
check w9 reached "W9 a re-registered lease outlives the grace period" \
  "${crash_daemon[@]}" -DWITNESS=9
check w10 reached "W10 a replaced tensor is kept as recovered in the grace period" \
  "${crash_daemon[@]}" -DWITNESS=10
model=$wake_model check wake pass "correct wake-up model, 2 waiters, early wake-up, a refused publish"
model=$wake_model check wake_producer pass "correct wake-up model, the producer wakes as well" \
  -DPRODUCER_WAKE
model=$wake_model check wake_trust caught \
  "broken: a consumer woken early takes the tensor unlooked" P1 -DBROKEN_TRUST_WAKE
model=$wake_model check wake_no_bump_wake caught "broken: the daemon bumps without waking" P2 \
  -DBROKEN_NO_BUMP_WAKE
model=$wake_model check wake_bump_first caught "broken: the daemon bumps before it commits" P2 \
  -DBROKEN_BUMP_BEFORE_COMMIT
model=$wake_model check wake_seen_late caught \
  "broken: the consumer loads the word after its lookup" P2 -DBROKEN_SEEN_AFTER_LOOKUP
model=$wake_model check wake_w1 reached "wake W1 a consumer is woken before the commit" -DWITNESS=1
model=$wake_model check wake_w2 reached "wake W2 its looks run out and it sleeps again" -DWITNESS=2
model=$wake_model check wake_w3 reached "wake W3 it sees the bump while it looks" -DWITNESS=3
wait
end=$(date +%s)

failures=0
for name in "${names[@]}"; do
  cat "$work/$name.out"
  [ -e "$work/$name.failed" ] && failures=$((failures + 1))
done
if [ "$failures" -ne 0 ]; then
  echo "$me: $failures check(s) FAILED ($((end - start)) s)" >&2
  exit 1
fi
echo "$me: all ${#names[@]} checks passed ($((end - start)) s)"
