/*-------------------------------------------------------------------------
 *
 * idempotency.h
 *	  Declarations shared by the parts of the idempotency extension.
 *
 * Each .c file includes postgres.h first, then this.  Its sections, in
 * order, declare what each part offers the others:
 *	  module.c       module entry point: _PG_init calls each part's init;
 *	                 the shared-memory registry; idem_version()
 *	  (statuses)     a key's status and its SQL name
 *	  guc.c          the idempotency.* settings
 *	  pause.c        pause points for isolation tests (test builds only)
 *	  fingerprint.c  SHA-256 request fingerprints and lock hashes
 *	  row.c          reading keys: the index probe, fetches, the sweep's scan,
 *	                 whether a key is remembered
 *	  catalog.c      the key store's relations, found and checked
 *	  write.c        every change to a key, by one table of write rules
 *	  token.c        the fencing token sequence: blocks of tokens reserved
 *	                 ahead in shared memory, or nextval, made durable
 *	                 before a token leaves
 *	  keylock.c      the per-key advisory lock and the write counters
 *	  wait.c         waiting for an in-flight attempt: shared-memory
 *	                 waiter slots and the wake-up at commit or abort
 *	  session.c      session-bound claims: this session's binding, the
 *	                 liveness of others', the wake-up when one ends
 *	  citus.c        running on Citus: shards, tokens, sweeping every node
 *	  stats.c        the idempotency.stats view: shared-memory counters,
 *	                 key counts
 *	  tenant.c       scope bindings: which scopes a role may use
 *	  sweep.c        one sweep batch, shared by the worker and idem_sweep()
 *	  worker.c       the background sweeper (launcher + per-database worker)
 *
 * Declared elsewhere: args.h (args.c, reading the SQL arguments), store.h
 * (direct.c, the table-AM writer, and what catalog.c and write.c share).
 * The SQL functions live in claim.c (idem_claim, idem_claim_many),
 * holder.c (the calls that present a token), lookup.c (idem_lookup),
 * forget.c (idem_forget) and sweep.c (idem_sweep); they declare nothing.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_H
#define IDEMPOTENCY_H

#include "access/xlogdefs.h"
#include "datatype/timestamp.h"
#include "storage/itemptr.h"
#include "utils/relcache.h"

#include "compat.h"

/*
 * The version of this library, as idem_version() reports it: major.minor is
 * the extension version (default_version in idempotency.control) whose
 * install script ships with it, the last number counts releases of the
 * library that leave the SQL objects alone.
 */
#define IDEM_VERSION			"1.8.2"

/* Limits of the SQL interface: key and scope length, fingerprint size. */
#define IDEM_MAX_KEY_CHARS		255
#define IDEM_FINGERPRINT_LEN	32	/* SHA-256 */

/* ---- module.c ---- */

/*
 * A part's shared memory, created once at server start by the registry in
 * module.c: its name (ShmemInitStruct's key), its size, and how the
 * part keeps its address and, the first time ("found" false), fills it in.
 * A part defines one of these; the registry lists it.
 */
typedef struct IdemShmemPart
{
	const char *name;
	Size		size;			/* fixed size, or 0: ask size_fn */
	Size		(*size_fn) (void);	/* a size that depends on settings */
	void		(*attach) (void *mem, bool found);
} IdemShmemPart;

/* ---- statuses (names in row.c) ---- */

/* Status of a stored key, as kept in idempotency.keys.status. */
typedef enum IdemStatus
{
	IDEM_PENDING,
	IDEM_SUCCEEDED,
	IDEM_FAILED,
	IDEM_NSTATUS
} IdemStatus;

/* The SQL name of each status (row.c), and the status of a name. */
extern const char *const idem_status_names[IDEM_NSTATUS];
extern bool idem_status_parse(const char *name, int len, IdemStatus *status);

/* ---- guc.c ---- */
extern int	idem_lease_ms;
extern int	idem_retention_s;
extern int	idem_remember_s;
extern int	idem_sweep_batch;
extern int	idem_max_response_size;
extern int	idem_sweep_interval_ms;
extern int	idem_stats_exact_limit;
#ifdef IDEM_TEST_PAUSES
extern int	idem_test_token_block;
#endif
extern void idem_guc_init(void);

/* ---- pause.c ---- */

/*
 * Pause points, only in test builds (make IDEM_TEST_PAUSES=1): a session
 * whose idempotency.test_pause names the point waits there while another
 * session holds pg_advisory_lock(IDEM_PAUSE_LOCK), so that an isolation
 * spec can stop it at an exact place.
 */
#define IDEM_PAUSE_LOCK			7655
#ifdef IDEM_TEST_PAUSES
extern void idem_pause_init(void);
extern void idem_pause(const char *point);
#define IDEM_PAUSE(point)		idem_pause(point)
#else
#define IDEM_PAUSE(point)		((void) 0)
#endif

/* ---- fingerprint.c ---- */
extern void idem_fingerprint(Datum jsonb, uint8 *out);
extern uint64 idem_key_hash(text *scope, text *key);

/* ---- row.c ---- */

/*
 * One key as the store last saw it.  "found" is false when no committed
 * row exists; "busy" is true when another transaction is inserting,
 * updating or deleting the row right now (its outcome is unknown, so
 * nobody may answer from it).  "locked" is set when another running
 * transaction holds a row lock (FOR UPDATE / SHARE) on it: readers may
 * answer from it, but a write would wait.  "mine" is set when the current
 * row was written by the caller's own open transaction.  When busy,
 * busy_xid is the transaction changing the row; busy_new says whether the
 * probe saw the new row version it writes (none: a delete), and busy_token
 * is that version's token (0 when NULL: a reset), so that the holder of a
 * token can tell a change that keeps its token current from a takeover.
 * busy_old says the probe saw the committed version being changed, with
 * its status and token: a token that version does not hold was dead
 * before the change began.
 */
typedef struct IdemRow
{
	bool		found;
	bool		busy;
	TransactionId busy_xid;
	bool		busy_new;
	int64		busy_token;
	bool		busy_old;
	IdemStatus	busy_old_status;
	bool		busy_old_has_token;
	int64		busy_old_token;
	int32		busy_old_attempt;
	TimestampTz busy_old_expires_at;
	bool		locked;			/* row-locked by another running transaction */
	bool		mine;
	ItemPointerData tid;
	TransactionId xmin;
	IdemStatus	status;
	bool		has_token;
	int64		token;
	int32		attempt;
	bool		has_fingerprint;
	uint8		fingerprint[IDEM_FINGERPRINT_LEN];
	bool		has_response_code;
	int32		response_code;
	Datum		response_body;	/* copy as stored (maybe a TOAST pointer), or
								 * 0 */
	TimestampTz created_at;
	bool		has_finished_at;
	TimestampTz finished_at;
	bool		has_lease_until;
	TimestampTz lease_until;
	TimestampTz expires_at;
	Interval	retention;
	TimestampTz sweep_at;
	/* 1.4 columns; NULL (0 / false) on a table of an older version */
	Datum		phase;			/* text copy (with the body), or 0 */
	Datum		phase_data;		/* copy as stored (with the body), or 0 */
	bool		has_owner_session;
	int64		owner_session;
	/* 1.7 column; NULL (false) on a table of an older version */
	bool		has_remember;
	Interval	remember;
	/* 1.8 column; 0 on a table of an older version */
	Datum		request;		/* the kept request, copy as stored (with the
								 * body), or 0 */
} IdemRow;

/* How a probe reads: the newest state (claims, writes) or a snapshot. */
typedef enum IdemProbeMode
{
	IDEM_PROBE_LATEST,			/* dirty snapshot: newest, flags "busy" */
	IDEM_PROBE_SNAPSHOT			/* the active MVCC snapshot (lookup) */
} IdemProbeMode;

extern char *idem_key_display(text *scope, text *key);
extern void idem_row_probe(text *scope, text *key, IdemProbeMode mode,
						   bool want_body, IdemRow *row);
extern void idem_row_check_snapshot(const IdemRow *row);
extern bool idem_row_remembered_until(const IdemRow *row, TimestampTz *until);
extern bool idem_row_remembered(const IdemRow *row, TimestampTz now);

/* An open table for a run of fetches by tid (the sweeper's). */
typedef struct IdemFetch
{
	Relation	heap;
	struct TupleTableSlot *slot;
} IdemFetch;

extern void idem_row_fetch_begin(IdemFetch *fetch);
extern void idem_row_fetch(IdemFetch *fetch, ItemPointer tid, text *scope,
						   text *key, IdemRow *row);
extern void idem_row_fetch_end(IdemFetch *fetch);
extern int	idem_row_sweep_candidates(TimestampTz now, int limit,
									  ItemPointerData **tids,
									  text ***scopes, text ***keys);
extern int	idem_row_session_candidates(int64 after, int limit,
										ItemPointerData **tids,
										text ***scopes, text ***keys,
										int64 **sessions);

/* A key of a scope that looked abandoned (idem_row_abandoned_candidates). */
typedef struct IdemAbandoned
{
	ItemPointerData tid;
	text	   *key;
	TimestampTz created_at;		/* when its first attempt claimed it */
} IdemAbandoned;

extern int	idem_row_abandoned_candidates(text *scope, TimestampTz now,
										  int limit, IdemAbandoned **found);
extern bool idem_row_abandoned(const IdemRow *row, TimestampTz now);

/* Where idem_row_count_keys took its counts from. */
typedef enum IdemKeyCountSource
{
	IDEM_COUNT_EXACT,			/* a scan of the table */
	IDEM_COUNT_ESTIMATE,		/* the planner's statistics */
	IDEM_COUNT_UNKNOWN			/* too large to scan, never analyzed */
} IdemKeyCountSource;

/* The key counts: one per status, then the remembered keys. */
#define IDEM_COUNT_REMEMBERED	IDEM_NSTATUS
#define IDEM_NCOUNTS			(IDEM_NSTATUS + 1)

extern IdemKeyCountSource idem_row_count_keys(TimestampTz now,
											  int exact_limit,
											  int64 counts[IDEM_NCOUNTS]);

/* ---- catalog.c ---- */
extern Oid	idem_catalog_lock_relation(const char *name);
extern void idem_catalog_select_scope(text *scope);
extern int	idem_catalog_local_count(void);
extern bool idem_catalog_select_local(int i);
extern bool idem_catalog_distributed(void);
extern Oid	idem_catalog_local_shard(Oid relid, const char *name);
extern void idem_catalog_check_member(Oid relid);
IDEM_NORETURN extern void idem_catalog_refuse_replaced(const char *what);
IDEM_NORETURN extern void idem_catalog_refuse_missing(const char *what);

/* ---- write.c ---- */
extern void idem_write_insert_claim(text *scope, text *key, int64 token,
									const uint8 *fingerprint,
									TimestampTz now, TimestampTz lease_until,
									TimestampTz expires_at,
									Interval *retention,
									int64 owner_session,
									Interval *remember, Datum request);
extern void idem_write_update_claim(const IdemRow *old, int64 token,
									int32 attempt, const uint8 *fingerprint,
									TimestampTz created_at,
									TimestampTz lease_until,
									TimestampTz expires_at,
									Interval *retention,
									int64 owner_session,
									Interval *remember, Datum request);
extern void idem_write_checkpoint(const IdemRow *old, Datum phase,
								  Datum data);
extern void idem_write_finish(const IdemRow *old, IdemStatus status,
							  bool has_code, int32 code, Datum body,
							  TimestampTz now, TimestampTz expires_at,
							  Interval *remember);
extern void idem_write_extend(const IdemRow *old, TimestampTz lease_until,
							  TimestampTz expires_at);
extern void idem_write_release(const IdemRow *old);

/* What a sweep does to a row. */
typedef enum IdemSweepWork
{
	IDEM_SWEEP_DELETE,			/* retention passed: the key goes */
	IDEM_SWEEP_RESET,			/* lease ended: the token dies */
	IDEM_SWEEP_RESCHEDULE,		/* found early: move sweep_at forward */
	IDEM_SWEEP_COMPACT,			/* retention passed, remembered: keep the
								 * outcome, drop the response */
	IDEM_SWEEP_NKINDS
} IdemSweepWork;

/*
 * One row a sweep writes: its version, and its new sweep_at (not a
 * delete); "done" says whether the write happened.
 */
typedef struct IdemSweepItem
{
	ItemPointerData tid;
	TimestampTz sweep_at;
	bool		done;
} IdemSweepItem;

extern int	idem_write_sweep(IdemSweepWork work, IdemSweepItem *items,
							 int n);

/* ---- token.c ---- */
extern const IdemShmemPart idem_token_shmem;
extern int64 idem_token_next(void);
extern int64 idem_token_claim(const IdemRow *old);

/* The token flush state of a batch around another (token.c). */
typedef struct IdemTokenBatch
{
	bool		deferred;
	XLogRecPtr	lsn;
} IdemTokenBatch;

extern void idem_token_defer_flush(IdemTokenBatch *outer);
extern void idem_token_flush(const IdemTokenBatch *outer, bool flush);

/* ---- keylock.c ---- */
extern const IdemShmemPart idem_key_shmem;
extern bool idem_key_lock(uint64 hash, bool wait);
extern void idem_key_unlock(uint64 hash);
extern void idem_key_wrote(uint64 hash);
extern bool idem_key_write_count(uint64 hash, uint64 *count);

/* ---- wait.c ---- */

/*
 * A waiting claim's publication (idem_wait_register .. idem_wait_unregister),
 * kept by the caller: whether it published, and whether it borrowed the slot
 * of an outer waiting claim, whose key it then puts back.
 */
typedef struct IdemWaitRegistration
{
	bool		published;
	bool		nested;
	uint64		outer_hash;		/* the outer claim's key, when nested */
} IdemWaitRegistration;

extern const IdemShmemPart idem_wait_shmem;
extern void idem_wait_init(void);
extern void idem_wait_register(uint64 hash, IdemWaitRegistration *reg);
extern void idem_wait_unregister(const IdemWaitRegistration *reg);
extern void idem_wait_remember(uint64 hash);
extern void idem_wait_wake_all(void);

/* ---- session.c ---- */
extern const IdemShmemPart idem_session_shmem;
extern int64 idem_session_bind(void);
extern bool idem_session_alive(int64 session);
extern uint64 idem_session_ends(void);

/* ---- citus.c (the rest of it, for catalog.c and write.c: store.h) ---- */
extern const IdemShmemPart idem_citus_shmem;
extern void idem_citus_sweep_workers(int batch, int64 *expired,
									 int64 *reset);

/* ---- stats.c ---- */

/*
 * The counters, in the order of the columns of idempotency.stats_counters()
 * after the database, and so of the idempotency.stats view: a new counter
 * goes at the end, with the column added in a new extension version.
 */
typedef enum IdemCounter
{
	IDEM_STAT_CLAIMS,
	IDEM_STAT_TAKEOVERS,
	IDEM_STAT_REPLAYS,
	IDEM_STAT_IN_PROGRESS,
	IDEM_STAT_MISMATCHES,
	IDEM_STAT_FINISHES,
	IDEM_STAT_RELEASES,
	IDEM_STAT_EXPIRED,
	IDEM_STAT_RESET,
	IDEM_STAT_CHECKPOINTS,		/* 1.4: after last_sweep_at, last_sweep_ms */
	IDEM_STAT_ABANDONED_TAKEOVERS,	/* 1.8 */
	IDEM_STAT_NCOUNTERS
} IdemCounter;

extern const IdemShmemPart idem_stats_shmem;
extern void idem_stats_count(IdemCounter counter, int64 n);
extern void idem_stats_sweep_done(TimestampTz at, double ms);

/* ---- tenant.c ---- */
extern void idem_tenant_check(text *scope);

/* ---- sweep.c ---- */
extern bool idem_sweep_batch_run(int batch, int max_fetches,
								 uint64 *sessions_seen, int64 *expired,
								 int64 *reset);

/* ---- worker.c ---- */
extern void idem_worker_init(void);
extern const IdemShmemPart idem_worker_shmem;

#endif							/* IDEMPOTENCY_H */
