/*
 * tests/model/fast_path.pml: the fast path's acquire / retire / scan / crash protocol, modelled in
 * Promela for an exhaustive check with spin. tests/model/check.sh runs it (ctest: fast_path_model);
 * common/shm/fast_path_layout.h points here.
 *
 * WHAT IS MODELLED, AND WHICH CODE EACH PART MIRRORS
 *
 *   Shared memory (common/shm/fast_path_layout.h), per daemon start (a restarted daemon makes a new
 *   index memfd and new lease pages; a client that has not noticed the restart yet keeps reading
 *   the old index, frozen as the crash left it, and writing its old page, which nobody scans):
 *     - the catalog index: one bucket, since there is one name: `seq` (IndexBucket::sequence, a
 *       seqlock, odd while the daemon changes the chain) and `head`; entries `etid`/`enext`
 *       (IndexEntry::tensor_id/next), one per control-segment record, reused when records are.
 *     - the lease pages (LeasePage): per client, slots holding tensor ids; only the client writes
 *       them, the daemon only reads them.
 *   Persistent state, which survives a daemon crash:
 *     - the control segment's records: `rstate`, `rtid` (TensorRecord::state, tensor_id);
 *     - the tensors' memory, `tstate`: T_FREED means the daemon gave the buffer back to its pool,
 *       so its bytes may belong to another tensor by now: reading it is a use after free.
 *   The daemon's memory, lost when it crashes: `bound` (Catalog::names_), `retired`
 *   (Catalog::retired_), `leases` (Tensor::leases: RPC leases), `recovered` (Tensor::recovered),
 *   `in_grace` (Catalog::in_grace_), `board` (LeaseBoard::pages_), `session` and `sl` (the
 *   sessions and their RPC leases, Session::leases).
 *
 *   proctype Daemon: the single writer. The real daemon serves every request and housekeeping
 *   round under its service mutex, so its handlers are one sequential process here, and only its
 *   accesses to shared memory interleave with the clients'. Handlers (inline ...):
 *     PUBLISH         Catalog::Publish of a replacement: the new record committed (kPublished),
 *                     CatalogIndex::Bind (server/catalog/catalog_index.cc: sequence odd; Unlink the old
 *                     entry, link the new one; sequence even, a seq_cst store), then
 *                     Catalog::Unbind(old): record kUnbound, FreeIfUnheld.
 *     FREE_IF_UNHELD  Catalog::FreeIfUnheld + LeaseBoard::Holds (server/catalog/lease_board.cc: one
 *                     seq_cst load per slot of every page on the board, each its own step):
 *                     held -> retired; else Catalog::Free at once (FREE).
 *     RECLAIM         Catalog::Reclaim + LeaseBoard::Held: one scan of every slot, then each
 *                     retired tensor that no slot held, no RPC lease holds and is not recovered
 *                     is freed (TensorShmService::Housekeep, and after session closes).
 *     CLOSE           TensorShmService::CloseSession: DropLease of the session's RPC leases,
 *                     LeaseBoard::Drop (the page goes whole, whatever its slots hold), Reclaim.
 *     REATTACH        TensorShmService::Reattach: Catalog::ReattachLease for each tensor id the
 *                     reconnecting client still holds (honoured in the grace period only), then
 *                     its new lease page (LeaseBoard::Open) and index.
 *     QUEUED_RELEASE  a released RPC lease: Catalog::DropLease -> FreeIfUnheld.
 *     EXPIRE          Catalog::ExpireUnbound (server/main.cc, when the grace period ends).
 *     RECOVER         Catalog::Recover + Restore: published and unbound records survive, marked
 *                     recovered; the highest publish_seq keeps the name, other published records
 *                     become unbound; the winner is bound in a new index; no page is on the new
 *                     board and no session exists until clients reconnect.
 *   The first daemon start may crash once, after any step that changes shared or persistent state
 *   (DCRASH_POINT, and between requests); it then restarts (RECOVER) and serves on.
 *
 *   proctype Client(c): a client process, its FastPath (client/fast_path.cc) and ClientCore
 *   (client/client_core.cc, client/session_sender.cc):
 *     TryAcquire      FastPath::TryAcquire: load the bucket's sequence s1 (odd: give up this
 *                     try), walk the chain to the name's entry, load the sequence again (!= s1:
 *                     give up); store the tensor id in a free slot of its page (seq_cst), load
 *                     the sequence once more (seq_cst): != s1 -> clear the slot; == s1 -> leased:
 *                     it reads the tensor (P1). kSnapshotAttempts' retries are the client calling
 *                     TryAcquire again, which it may do at once (so the model has more behaviours,
 *                     not fewer); the RPC fallback is not modelled.
 *     Release         FastPath::Release: the slot back to 0, after the last read (P1).
 *     reconnect       after a daemon restart (heartbeat stale, stream broken), at any later
 *                     point: ClientCore::Open(reattach) -> RetireFastPath (FastPath::Retire: its
 *                     page leases become held tensor ids, i.e. RPC leases) and a session open
 *                     listing them; the answer brings the new index and page (SetUpFastPath).
 *     RPC release     of such a lease: queued for the daemon (the sender's release batch).
 *     CRASH           the client dies (killed, crashed), between any two of its steps or right
 *                     after its hazard store (an unvalidated id left in its slot): it reads
 *                     nothing any more; its page stays as it is until the daemon drops it.
 *     Close           Client::Close once everything is released.
 *
 * PROPERTIES (assertions; spin also checks that every run ends with all processes at their end)
 *   P1 no use after free: whenever a client reads a tensor it leased (right after validating it,
 *      and at release: T_FREED is never undone, so that covers the whole interval), the tensor
 *      is live and its record still describes it; an RPC lease's tensor is live at its release.
 *   P2 no premature free: Free(t) never happens while a live client holds t (a validated slot of
 *      any daemon start's page, or an RPC lease), nor while a validated slot of a page still on
 *      the daemon's board holds t, even a dead client's page until its session is closed. A slot
 *      holding t transiently (stored, re-check pending: it will fail) is not a lease.
 *   P3 no leak: once every client has released or died and every session is closed, after the
 *      grace period (if any) and a final Reclaim, no tensor is retired and only the tensor bound
 *      to the name is live.
 *
 * MEMORY MODEL. spin interleaves whole statements under sequential consistency. The protocol
 * rests on seq_cst pairs exactly: the client's hazard store (seq_cst) then its re-load of the
 * bucket sequence (seq_cst), against the daemon's final sequence store of a Bind (seq_cst) then
 * the scan's seq_cst loads in LeaseBoard::Holds/Held. All four are in C++'s single total order,
 * so SC interleaving is faithful for the property checked. The seqlock part (acquire loads of the
 * chain between two loads of the sequence; release stores of the chain after the odd store) is
 * modelled SC too: its validity is the usual seqlock argument, not checked here.
 * Granularity: each statement makes at most one access to memory another process can see at that
 * moment, except these coarsenings, each exact for what clients can observe:
 *   - the walk of the chain is one step, and so are the daemon's chain stores between its odd and
 *     even sequence stores: if any chain store falls between a reader's two sequence loads, so
 *     does the odd store before it (the first load saw an even value), the second load differs
 *     and the walk is discarded whatever it read; if none does, the walk reads a fixed chain;
 *   - steps on state no client can reach yet (a new record before it is linked, a restarted
 *     daemon's new index before anyone maps it) or on persistent state (Free's record and memory);
 *   - ghost bookkeeping (hp, hc, tidying) rides along with a real step.
 * The 32-bit sequence never wraps here.
 * Not covered (it is about the tensor's bytes, not the protocol's words): the order between a
 * client's last reads of a tensor and the reuse of its buffer after the daemon saw the slot
 * cleared. In C++ terms FastPath::Release's release store of 0 synchronises with the scan's
 * seq_cst (hence acquire) load that reads it, so the client's reads happen before the reuse.
 *
 * ASSUMPTIONS, not checked: a restarted daemon's grace period lasts until every client alive at
 * the crash has reconnected or died (the real one is recovery_grace_seconds long: a client slower
 * than that loses its re-registration, see BROKEN_NO_GRACE); a session ends only when its client
 * is gone or the daemon restarts (so slot 0's kLeasePageDropped, which only a live client whose
 * session ended would read, is not modelled); one name, so every entry matches (a hash shared by
 * two names goes to the RPCs in the real client); tensor ids are never reused; CUDA tensors (not
 * served by the fast path) and unpublished tensors are left out.
 *
 * CONFIGURATIONS (check.sh). 2 clients, 2 records, the initial tensor and NPUB = 2 replacements:
 *   -DNO_DAEMON_CRASH       NS = 2 slots per client, clients may die:      2.6 M states;
 *   -DNS=1                  1 slot per client, clients may die, the daemon may crash and restart:
 *                           3.3 M states. (NS = 2 with the crash: over 200 M, too many for a test.)
 * Broken variants, each of which spin must catch (check.sh replays the shortest counterexample):
 *   -DBROKEN_NO_RECHECK         the client does not load the sequence again after its hazard.
 *   -DBROKEN_SCAN_BEFORE_UNLINK the daemon retires (scans the pages for) the old tensor before it
 *                               unlinks it from the index.
 *   -DBROKEN_NO_GRACE           a restarted daemon frees unbound recovered tensors at once,
 *                               without waiting for clients to reconnect and re-register.
 * Witnesses -DWITNESS=1..10 (REACHED below): situations that must occur, so that P1-P3 do not
 * hold vacuously.
 */

/* ---------------------------------------------------------------------------------------------
 * Sizes (see CONFIGURATIONS above). Guards and ghost updates below are written out for these.
 */
#define NC 2            /* clients */
#ifndef NS
#define NS 2            /* lease slots per client (kLeaseSlots - kFirstLeaseSlot in the real page): 1 or 2 */
#endif
#define NR 2            /* control-segment records (= index entries), reused after a Free */
#ifndef NPUB
#define NPUB 2          /* replacements published after the initial publish: 1 or 2 */
#endif
#define NT (NPUB + 1)   /* tensor ids 1..NT (the real ones are never reused either) */
#define NG 2            /* daemon starts: the first and at most one restart */
#if NC != 2 || NR != 2 || (NS != 1 && NS != 2)
#error "the guards below are written out for NC == NR == 2 and NS == 1 or 2"
#endif

#if NPUB == 2
#define ANY_RETIRED (retired[1] || retired[2] || retired[3])
#define NO_LEAK (!retired[1] && !retired[2] && !retired[3] && \
                 (tstate[1] != T_LIVE || bound == 1) && (tstate[2] != T_LIVE || bound == 2) && \
                 (tstate[3] != T_LIVE || bound == 3))
#elif NPUB == 1
#define ANY_RETIRED (retired[1] || retired[2])
#define NO_LEAK (!retired[1] && !retired[2] && \
                 (tstate[1] != T_LIVE || bound == 1) && (tstate[2] != T_LIVE || bound == 2))
#else
#error "NPUB is 1 or 2"
#endif

/* ---------------------------------------------------------------------------------------------
 * Persistent state: survives a daemon crash.
 */
#define T_UNUSED 0
#define T_LIVE 1
#define T_FREED 2       /* the buffer went back to the pool: its bytes may be anything now */
byte tstate[NT + 1];

#define R_FREE 0        /* RecordState::kFree */
#define R_PUBLISHED 1   /* RecordState::kPublished */
#define R_UNBOUND 2     /* RecordState::kUnbound */
byte rstate[NR];
byte rtid[NR];          /* TensorRecord::tensor_id */

/* ---------------------------------------------------------------------------------------------
 * Shared memory, per daemon start g: the index (one bucket: one name) and the lease pages.
 */
byte seq[NG];           /* IndexBucket::sequence */
byte head[NG];          /* IndexBucket::head: record slot + 1 of the first entry; 0: empty */
byte etid[NG * NR];     /* IndexEntry::tensor_id of entry (record slot) r: [g * NR + r] */
byte enext[NG * NR];    /* IndexEntry::next */

#define PG(g, c, k) ((((g) * NC) + (c)) * NS + (k))
byte page[NG * NC * NS];/* LeasePage::slots[kFirstLeaseSlot + k] of client c's page of daemon start g */
/* LeasePage::slots[0] (kLeasePageDropped once the session ended) is not modelled: only a live
 * client whose session ended could read it, and here a session ends only when its client is gone
 * (or the daemon restarts, which the client notices through the heartbeat instead). */
/* Nor are slots 1 to kFirstLeaseSlot - 1 (the client's fast acquire count and recent ring):
 * the daemon reads them only for its figures and LRU order, never to decide what to free. */

/* ---------------------------------------------------------------------------------------------
 * The daemon's memory: lost when it crashes.
 */
byte dgen;              /* the daemon start now running */
bool dcrash;            /* the first start crashed (for the trails: dgen says the same) */
byte bound;             /* the tensor bound to the name (Catalog::names_) */
byte ntensors;          /* tensor ids handed out */
byte npub;              /* replacements published */
byte tslot[NT + 1];     /* Tensor::slot (a record slot never changes for a tensor) */
bool retired[NT + 1];   /* Catalog::retired_ */
byte leases[NT + 1];    /* Tensor::leases: RPC leases */
bool recovered[NT + 1]; /* Tensor::recovered */
bool in_grace;          /* Catalog::in_grace_ */
bool board[NC];         /* client c's page of start dgen is in LeaseBoard::pages_ */
bool session[NC];       /* client c has a session with start dgen */
byte sl[NC * NS];       /* Session::leases: the re-registered RPC leases (tensor ids) */

/* ---------------------------------------------------------------------------------------------
 * Clients' state, global so that the daemon's requests and the assertions can see it.
 */
byte fg[NC];            /* the daemon start client c has its session, index and page with */
bool crashed[NC];
bool finished[NC];
bool want_reconnect[NC];/* a session open with held tensor ids, not answered yet */
byte relq[NC * NS];     /* RPC lease releases queued for the daemon (tensor ids) */
byte hp[NC * NS];       /* ghost: the tensor client c validated in page slot k of start fg[c] */
byte hc[NC * NS];       /* ghost: a tensor it holds as an RPC lease (converted by Retire) */

#define GONE(c) (crashed[c] || finished[c])

/* Witnesses (check.sh, -DWITNESS=n): the verification of witness n must fail at REACHED(n, ...),
 * which shows that the situation it names does occur in the model, i.e. that the properties are
 * not verified vacuously. Without -DWITNESS, REACHED is a skip (which spin optimises away). */
#ifdef WITNESS
#define REACHED(n, cond) assert(WITNESS != (n) || !(cond))
#else
#define REACHED(n, cond) skip
#endif

/* Per-client slot helpers, written out for NS == 1 or 2. */
#if NS == 2
#define FREE_SLOT(c) (hp[(c) * NS] == 0 || hp[(c) * NS + 1] == 0)
#define HOLDS_NOTHING(c) (hp[(c) * NS] == 0 && hp[(c) * NS + 1] == 0 && \
                          hc[(c) * NS] == 0 && hc[(c) * NS + 1] == 0)
#define CLEAR2(a, c) a[(c) * NS] = 0; a[(c) * NS + 1] = 0
#else
#define FREE_SLOT(c) (hp[(c) * NS] == 0)
#define HOLDS_NOTHING(c) (hp[(c) * NS] == 0 && hc[(c) * NS] == 0)
#define CLEAR2(a, c) a[(c) * NS] = 0
#endif

/* The first daemon start may crash here (then Daemon goes on at `restart`). Placed after every
 * step of the daemon that changes shared or persistent state, and at the top of its loop: a crash
 * anywhere else (in the middle of a scan, say) leaves the same state as one of these. */
#ifdef NO_DAEMON_CRASH
#define DCRASH_POINT skip
#else
#define DCRASH_POINT if :: dgen == 0 -> goto restart :: skip fi
#endif

/* Ghost tidying, no behaviour: once no client reads the first start's index and page any more,
 * they are zeroed so that equal futures make equal states. */
#define TIDY_GEN0 \
  if \
  :: dgen == 1 && (fg[0] == 1 || GONE(0)) && (fg[1] == 1 || GONE(1)) -> \
     seq[0] = 0; head[0] = 0; etid[0] = 0; etid[1] = 0; enext[0] = 0; enext[1] = 0; \
     CLEAR2(page, 0); CLEAR2(page, 1) \
  :: else -> skip \
  fi

/* P2, asserted by every Free: nobody holds t. A live client's validated page slot (of any daemon
 * start) or RPC lease, and a dead client's validated slot while its page is still on the board. */
#define HOLDS(c, k, t) \
  ((hp[(c) * NS + (k)] == (t) && (!crashed[c] || (fg[c] == dgen && board[c]))) || \
   (hc[(c) * NS + (k)] == (t) && !crashed[c]))
#if NS == 2
#define UNHELD(t) (!HOLDS(0, 0, t) && !HOLDS(0, 1, t) && !HOLDS(1, 0, t) && !HOLDS(1, 1, t))
#else
#define UNHELD(t) (!HOLDS(0, 0, t) && !HOLDS(1, 0, t))
#endif

/* P1: what a client reads of the tensor it validated in slot x: live memory, and the record it
 * found through the index still describing it. */
#define READABLE(x) \
  (tstate[hp[x]] == T_LIVE && rtid[tslot[hp[x]]] == hp[x] && rstate[tslot[hp[x]]] != R_FREE)

/* =============================================================================================
 * The daemon.
 */

/* Catalog::Free: the record goes free, then the memory is reused. Daemon-private and the
 * persistent state only: one step. */
inline FREE(t) {
  assert(UNHELD(t));                    /* P2 */
  assert(tstate[t] == T_LIVE);
  printf("MSC: daemon frees tensor %d\n", t);
  rstate[tslot[t]] = R_FREE;
  tstate[t] = T_FREED;
  retired[t] = false
}

/* Catalog::FreeIfUnheld(t) with LeaseBoard::Holds(t): one seq_cst load per slot of every page
 * on the board, each its own step; held: retired, else freed now. */
inline FREE_IF_UNHELD(t) {
  if
  :: t == bound || leases[t] > 0 || recovered[t] ->
     /* W9: kept for a re-registered lease after the grace period; W10: a replaced tensor kept
      * as recovered during the grace period */
     d_step {
       REACHED(9, leases[t] > 0 && dgen == 1 && !in_grace);
       REACHED(10, recovered[t] && in_grace && t != bound)
     }
  :: else ->
     i = 0;
     do
     :: i < NC * NS && !held ->
        d_step {
          if
          :: board[i / NS] && page[PG(dgen, i / NS, i % NS)] == t -> held = true
          :: else -> skip
          fi;
          i++
        }
     :: else -> break
     od;
     atomic {
       if
       :: held ->
          /* slot i - 1 held it. W1: a validated lease; W4: a dead client's slot; W5: a live
           * client's hazard not validated yet (its re-check will fail) */
          REACHED(1, hp[i - 1] == t);
          REACHED(4, crashed[(i - 1) / NS]);
          REACHED(5, !crashed[(i - 1) / NS] && hp[i - 1] != t);
          retired[t] = true;
          printf("MSC: daemon retires tensor %d (a page holds it)\n", t)
       :: else -> printf("MSC: daemon scanned the pages: no slot holds tensor %d\n", t); FREE(t)
       fi;
       held = false;
       i = 0
     };
     DCRASH_POINT
  fi
}

/* Catalog::Reclaim with LeaseBoard::Held: one pass over every slot of every page on the board,
 * then every retired tensor that no slot held, no RPC lease holds and is not recovered is freed. */
inline RECLAIM() {
  if
  :: ANY_RETIRED ->
     i = 0;
     do
     :: i < NC * NS ->
        d_step {
          if
          :: board[i / NS] -> hb[page[PG(dgen, i / NS, i % NS)]] = true
          :: else -> skip
          fi;
          i++
        }
     :: else -> break
     od;
     w = 1;
     do
     :: w <= NT && retired[w] && !hb[w] && leases[w] == 0 && !recovered[w] ->
        d_step { REACHED(2, true); FREE(w); w++ };   /* W2: Reclaim frees a retired tensor */
        DCRASH_POINT
     :: w <= NT && !(retired[w] && !hb[w] && leases[w] == 0 && !recovered[w]) -> w++
     :: else -> break
     od;
     atomic {
       w = 0;
       do
       :: w <= NT -> hb[w] = false; w++
       :: else -> break
       od;
       w = 0;
       i = 0
     }
  :: else -> skip
  fi
}

/* Catalog::Publish of a replacement, CatalogIndex::Bind, Catalog::Unbind(old). */
inline PUBLISH() {
  d_step {
    /* Catalog::Create, the producer's writes, and the commit point: the new record published. */
    if
    :: rstate[0] == R_FREE -> r = 0
    :: else -> r = 1
    fi;
    ntensors++;
    npub++;
    nt = ntensors;
    rtid[r] = nt;
    tslot[nt] = r;
    tstate[nt] = T_LIVE;
    rstate[r] = R_PUBLISHED;
    old = bound;
    bound = nt;
    printf("MSC: daemon publishes tensor %d (record %d) to replace tensor %d\n", nt, r, old)
  };
  DCRASH_POINT;
#ifdef BROKEN_SCAN_BEFORE_UNLINK
  /* BROKEN: the old tensor is retired (the pages scanned for it) while the index links it. */
  rstate[tslot[old]] = R_UNBOUND;
  DCRASH_POINT;
  FREE_IF_UNHELD(old);
#endif
  d_step {                              /* odd: a relaxed store; the chain stores after it are releases */
    seq[dgen] = seq[dgen] + 1;
    printf("MSC: daemon: sequence %d\n", seq[dgen])
  };
  DCRASH_POINT;
  /* The chain's stores while the sequence is odd (CatalogIndex::Unlink's one store, then the new
   * entry's name_hash, tensor_id and next, then the head) as one step: a reader whose two loads
   * of the sequence surround any of them sees two values and retries, whatever it read (see the
   * header). A crash in their middle leaves an odd sequence: the same as one after them. */
  d_step {
    if
    :: head[dgen] == tslot[old] + 1 -> head[dgen] = enext[dgen * NR + tslot[old]]
    :: else ->                          /* later in the chain: never with one name */
       assert(head[dgen] != 0);
       enext[dgen * NR + head[dgen] - 1] = enext[dgen * NR + tslot[old]]
    fi;
    etid[dgen * NR + r] = nt;
    enext[dgen * NR + r] = head[dgen];
    head[dgen] = r + 1;
    printf("MSC: daemon unlinks tensor %d, links tensor %d\n", old, nt)
  };
  DCRASH_POINT;
  d_step {                              /* even: the seq_cst store */
    seq[dgen] = seq[dgen] + 1;
    printf("MSC: daemon: sequence %d\n", seq[dgen])
  };
  DCRASH_POINT;
#ifndef BROKEN_SCAN_BEFORE_UNLINK
  /* Catalog::Unbind(old): the record unbound, then FreeIfUnheld, after the unlink. */
  rstate[tslot[old]] = R_UNBOUND;
  DCRASH_POINT;
  FREE_IF_UNHELD(old);
#endif
  d_step { old = 0; r = 0; nt = 0 }
}

/* Catalog::ExpireUnbound: the grace period ends; every unbound tensor goes unless held. */
inline EXPIRE() {
  d_step {
    in_grace = false;
    w = 1;
    do
    :: w <= NT -> recovered[w] = false; w++
    :: else -> break
    od;
    w = 0;
    printf("MSC: daemon: the grace period ends\n")
  };
  u = 1;
  do
  :: u <= NT ->
     if
     :: tstate[u] == T_LIVE && u != bound -> FREE_IF_UNHELD(u)
     :: else -> skip
     fi;
     u++
  :: else -> break
  od;
  u = 0
}

/* Catalog::Recover after a crash: a new index (a new memfd), an empty lease board, no sessions.
 * Published and unbound records survive, recovered; the highest publish_seq (here the highest
 * tensor id) keeps the name, other published records become unbound. */
inline RECOVER() {
  d_step {
    REACHED(7, seq[0] % 2 == 1);        /* W7: the crash came in the middle of a Bind */
    dgen = 1;
    w = 1;
    do
    :: w <= NT -> retired[w] = false; leases[w] = 0; recovered[w] = false; w++
    :: else -> break
    od;
    w = 0;
    do
    :: w < NC ->
       board[w] = false;
       session[w] = false;
       CLEAR2(sl, w);
       CLEAR2(relq, w);
       if                               /* ghost: a dead client's old page protects nothing */
       :: crashed[w] -> CLEAR2(hp, w)
       :: else -> skip
       fi;
       w++
    :: else -> break
    od;
    bound = 0;
    r = 0;
    do
    :: r < NR ->
       if
       :: rstate[r] != R_FREE ->
          recovered[rtid[r]] = true;
          if
          :: rstate[r] == R_PUBLISHED && rtid[r] > bound -> bound = rtid[r]
          :: else -> skip
          fi
       :: else -> skip
       fi;
       r++
    :: else -> break
    od;
    r = 0;
    do
    :: r < NR ->
       if
       :: rstate[r] == R_PUBLISHED && rtid[r] != bound -> rstate[r] = R_UNBOUND
       :: else -> skip
       fi;
       r++
    :: else -> break
    od;
    r = 0;
    assert(bound != 0);
    etid[NR + tslot[bound]] = bound;
    enext[NR + tslot[bound]] = 0;
    head[1] = tslot[bound] + 1;
    seq[1] = 2;
    in_grace = true;
    w = 0;
    TIDY_GEN0;
    printf("MSC: daemon restarted: tensor %d keeps the name, the grace period begins\n", bound)
  };
#ifdef BROKEN_NO_GRACE
  /* BROKEN: no grace period: unbound recovered tensors are freed at once. */
  EXPIRE();
#endif
  skip
}

/* Catalog::DropLease. */
inline DROP_LEASE(t) {
  leases[t]--;
  if
  :: leases[t] == 0 -> FREE_IF_UNHELD(t)
  :: else -> skip
  fi
}

/* TensorShmService::CloseSession(c): the session's RPC leases dropped, LeaseBoard::Drop (the
 * page goes whole, slot 0 = kLeasePageDropped), Catalog::Reclaim. */
inline CLOSE(c) {
  k = 0;
  do
  :: k < NS ->
     if
     :: sl[c * NS + k] != 0 ->
        d_step { t = sl[c * NS + k]; sl[c * NS + k] = 0 };
        DROP_LEASE(t);
        t = 0
     :: else -> skip
     fi;
     d_step { relq[c * NS + k] = 0; k++ }
  :: else -> break
  od;
  atomic {
    k = 0;
    /* ghost: nobody reads the dropped page any more */
    page[PG(dgen, c, 0)] = 0;
#if NS == 2
    page[PG(dgen, c, 1)] = 0;
#endif
    board[c] = false;
    session[c] = false;
    if                                  /* ghost: a dead client's page protects nothing now */
    :: crashed[c] -> CLEAR2(hp, c)
    :: else -> skip
    fi;
    printf("MSC: daemon closes client %d's session, drops its page\n", c)
  };
  RECLAIM()
}

/* TensorShmService::Reattach(c) (Catalog::ReattachLease per held tensor id, honoured in the grace
 * period only), then the new session's lease page (LeaseBoard::Open) and index. A refused tensor
 * stays in the client's hands (its mapping still points at the memory): P1 then judges it. */
inline REATTACH(c) {
  d_step {
    k = 0;
    do
    :: k < NS ->
       t = hc[c * NS + k];
       if
       :: t != 0 && in_grace && tstate[t] == T_LIVE ->
          REACHED(8, t != bound);       /* W8: a replaced tensor re-registered */
          leases[t]++;
          sl[c * NS + k] = t
       :: else -> skip
       fi;
       k++
    :: else -> break
    od;
    k = 0;
    t = 0;
    session[c] = true;
    board[c] = true;
    fg[c] = dgen;
    want_reconnect[c] = false;
    TIDY_GEN0;
    printf("MSC: daemon reattaches client %d, maps its new page\n", c)
  }
}

/* A released RPC lease (a release batch): DropLease if the session still has it. */
inline QUEUED_RELEASE(x) {
  d_step { t = relq[x]; relq[x] = 0 };
  if
  :: sl[x] == t -> sl[x] = 0; DROP_LEASE(t)
  :: else -> skip
  fi;
  t = 0
}

#define GRACE_OVER ((GONE(0) || fg[0] == dgen) && (GONE(1) || fg[1] == dgen))
#define ALL_DONE (GONE(0) && GONE(1) && !session[0] && !session[1])

/* The serving loop: whichever request or housekeeping round comes next (all under the service's
 * mutex in the real daemon: one at a time). */
inline SERVE() {
  do
  :: npub < NPUB && (rstate[0] == R_FREE || rstate[1] == R_FREE) -> PUBLISH()
  :: ANY_RETIRED -> RECLAIM()           /* TensorShmService::Housekeep */
  :: session[0] && GONE(0) -> CLOSE(0)
  :: session[1] && GONE(1) -> CLOSE(1)
  :: want_reconnect[0] -> REATTACH(0)
  :: want_reconnect[1] -> REATTACH(1)
  :: relq[0] != 0 -> QUEUED_RELEASE(0)
  :: relq[1] != 0 -> QUEUED_RELEASE(1)
#if NS == 2
  :: relq[2] != 0 -> QUEUED_RELEASE(2)
  :: relq[3] != 0 -> QUEUED_RELEASE(3)
#endif
  :: in_grace && GRACE_OVER -> EXPIRE()
  :: ALL_DONE -> break
#ifndef NO_DAEMON_CRASH
  :: dgen == 0 -> goto restart          /* a crash between two requests */
#endif
  od
}

proctype Daemon() {
  byte t, u, w, old, r, nt, k, i;
  bool held;
  bool hb[NT + 1];
  SERVE();
  goto finish;
restart:
  /* The first start crashed: its memory (these locals included) is gone; a new start recovers. */
  dcrash = true;
  d_step {
    t = 0; u = 0; w = 0; old = 0; r = 0; nt = 0; k = 0; i = 0; held = false;
    hb[0] = false; hb[1] = false; hb[2] = false;
#if NPUB == 2
    hb[3] = false;
#endif
    printf("MSC: the daemon crashes\n")
  };
  RECOVER();
  SERVE();
finish:
  /* P3: every client released or died and every session is closed: once the grace period is
   * over and a final Reclaim ran, nothing is retired and only the bound tensor lives. */
  if
  :: in_grace -> EXPIRE()
  :: else -> skip
  fi;
  RECLAIM();
  assert(NO_LEAK)  /* P3 */
}

/* =============================================================================================
 * A client: its FastPath (client/fast_path.cc) and ClientCore's reconnection (client/session_sender.cc).
 */
/* The client dies (killed, or it crashed): it reads nothing any more; its page stays as it is
 * until the daemon drops it. It may die between two operations (whatever it holds), right after
 * its hazard store, and while it waits for a reconnection's answer. That covers every point: its
 * other steps only read shared memory, so dying after one of them leaves the same state as dying
 * before it. */
inline CRASH() {
  d_step {
    crashed[c] = true;
    k = 0; s1 = 0; tid = 0; ok = false;
    CLEAR2(hc, c);
    if                                  /* ghost: an old start's page protects nothing */
    :: fg[c] != dgen -> CLEAR2(hp, c)
    :: else -> skip
    fi;
    TIDY_GEN0;
    printf("MSC: client %d dies\n", c)
  };
  break
}

proctype Client(byte c) {
  byte k, s1, tid;
  bool ok;
  do
  :: /* FastPath::TryAcquire, one attempt (see the header on retries), with a free slot. The
      * first load of the bucket's sequence (acquire). */
     FREE_SLOT(c) ->
     d_step {
#if NS == 2
       if
       :: hp[c * NS + 1] == 0 -> k = 1  /* free_slots_.back() */
       :: else -> k = 0
       fi;
#else
       k = 0;
#endif
       s1 = seq[fg[c]]
     };
     if
     :: s1 % 2 == 1 -> skip             /* the daemon is changing the chain */
     :: else ->
        /* The walk (head, the entry's name_hash, tensor_id) as one step: see the header. */
        d_step {
          if
          :: head[fg[c]] != 0 -> tid = etid[fg[c] * NR + head[fg[c]] - 1]
          :: else -> tid = 0
          fi;
          printf("MSC: client %d: sequence %d, the chain gives tensor %d\n", c, s1, tid)
        };
        if
        :: seq[fg[c]] != s1 -> skip     /* not a consistent snapshot */
        :: seq[fg[c]] == s1 && tid == 0 -> skip  /* kNotFound */
        :: seq[fg[c]] == s1 && tid != 0 ->
           /* The hazard: the slot first (seq_cst store)... */
           d_step {
             page[PG(fg[c], c, k)] = tid;
             printf("MSC: client %d stores tensor %d in its slot %d\n", c, tid, k)
           };
           if
           :: CRASH()                   /* dies with an unvalidated id in its slot */
           :: skip
           fi;
           /* ...then the bucket's sequence again (seq_cst load). */
           d_step {
#ifdef BROKEN_NO_RECHECK
             ok = true;
#else
             ok = (seq[fg[c]] == s1);
#endif
             if
             :: ok ->
                hp[c * NS + k] = tid;
                REACHED(6, fg[c] != dgen);  /* W6: validated on a crashed start's index */
                printf("MSC: client %d leased tensor %d, reads it\n", c, tid);
                assert(READABLE(c * NS + k))   /* P1 */
             :: else ->
                REACHED(3, true);       /* W3: a re-check fails */
                printf("MSC: client %d: the sequence moved on, it clears slot %d\n", c, k)
             fi
           };
           if
           :: !ok -> page[PG(fg[c], c, k)] = 0
           :: else -> skip
           fi
        fi
     fi;
     d_step { k = 0; s1 = 0; tid = 0; ok = false }
  :: /* FastPath::Release: it read the tensor until now. */
     hp[c * NS] != 0 ->
     d_step {
       assert(READABLE(c * NS));        /* P1 */
       printf("MSC: client %d releases tensor %d (slot 0)\n", c, hp[c * NS]);
       hp[c * NS] = 0;
       page[PG(fg[c], c, 0)] = 0
     }
#if NS == 2
  :: hp[c * NS + 1] != 0 ->
     d_step {
       assert(READABLE(c * NS + 1));    /* P1 */
       printf("MSC: client %d releases tensor %d (slot 1)\n", c, hp[c * NS + 1]);
       hp[c * NS + 1] = 0;
       page[PG(fg[c], c, 1)] = 0
     }
#endif
  :: /* The release of an RPC lease, queued for the daemon. */
     hc[c * NS] != 0 ->
     d_step {
       assert(tstate[hc[c * NS]] == T_LIVE);       /* P1 */
       relq[c * NS] = hc[c * NS];
       hc[c * NS] = 0
     }
#if NS == 2
  :: hc[c * NS + 1] != 0 ->
     d_step {
       assert(tstate[hc[c * NS + 1]] == T_LIVE);   /* P1 */
       relq[c * NS + 1] = hc[c * NS + 1];
       hc[c * NS + 1] = 0
     }
#endif
  :: /* The daemon restarted (its heartbeat went stale, the session stream broke):
      * ClientCore::Open(reattach) runs RetireFastPath (FastPath::Retire: page leases become held
      * tensor ids) and opens a session listing them; SetUpFastPath follows the answer. */
     fg[c] != dgen ->
     d_step {
       hc[c * NS] = hp[c * NS];
#if NS == 2
       hc[c * NS + 1] = hp[c * NS + 1];
#endif
       CLEAR2(hp, c);
       want_reconnect[c] = true;
       printf("MSC: client %d noticed the restart, retires its fast path\n", c)
     };
     if
     :: !want_reconnect[c]              /* the answer */
     :: CRASH()
     fi
  :: CRASH()                            /* between two operations, whatever it holds */
  :: /* Client::Close: everything released. */
     HOLDS_NOTHING(c) ->
     d_step { finished[c] = true; TIDY_GEN0 };
     break
  od
}

init {
  atomic {
    /* Tensor 1 is published under the name (record 0); both clients have a session, a page and
     * the first start's index. */
    ntensors = 1;
    tstate[1] = T_LIVE;
    rtid[0] = 1;
    rstate[0] = R_PUBLISHED;
    tslot[1] = 0;
    bound = 1;
    etid[0] = 1;
    head[0] = 1;
    seq[0] = 2;
    board[0] = true;
    board[1] = true;
    session[0] = true;
    session[1] = true;
    run Daemon();
    run Client(0);
    run Client(1)
  }
}
