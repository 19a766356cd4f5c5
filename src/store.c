/*-------------------------------------------------------------------------
 *
 * store.c
 *	  The key store: idempotency.keys, its primary key and token sequence.
 *
 * Owns every access to the table:
 *	  - finding the extension's relations (cached, reset on invalidation);
 *	  - the probe: a direct primary-key index scan that reads one key either
 *	    at its newest state (a dirty snapshot, which also reports whether
 *	    another transaction is changing the row right now) or through the
 *	    caller's MVCC snapshot;
 *	  - the per-key advisory lock that serialises critical sections;
 *	  - the writes, run as the table owner, addressing the probed row by its
 *	    ctid: direct table-AM writes with index maintenance where the table
 *	    is as the extension made it, else SPI statements prepared once per
 *	    backend, every object and operator schema-qualified.
 * Must not decide outcomes (api.c and sweep.c do), and must never wait on
 * another transaction's row: callers write only under the key's lock,
 * after a probe showed that nobody else is changing the row (under the
 * lock, or, for a claim's insert, before it when the key's write counter
 * proves that nothing was written since), and count every write
 * (idem_wait_wrote) before releasing the lock.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/multixact.h"
#include "access/stratnum.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "access/xlog.h"
#include "catalog/dependency.h"
#include "catalog/namespace.h"
#include "catalog/pg_am.h"
#include "catalog/pg_class.h"
#include "catalog/pg_index.h"
#include "catalog/pg_type.h"
#include "commands/extension.h"
#include "commands/sequence.h"
#include "executor/executor.h"
#include "executor/spi.h"
#include "executor/tuptable.h"
#include "miscadmin.h"
#include "storage/bufmgr.h"
#include "storage/lmgr.h"
#include "storage/lock.h"
#include "storage/procarray.h"
#include "storage/sinval.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/datum.h"
#include "utils/fmgroids.h"
#include "utils/guc.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

#include "idempotency.h"

/*
 * The fourth field of our advisory lock tags.  pg_advisory_lock() uses 1
 * and 2; a private value keeps our per-key locks apart from the
 * application's own advisory lock numbers.
 */
#define IDEM_LOCKTAG_FIELD4		0x1de7

/* Columns of idempotency.keys, in table order. */
enum
{
	COL_SCOPE = 1,
	COL_KEY,
	COL_STATUS,
	COL_TOKEN,
	COL_ATTEMPT,
	COL_FINGERPRINT,
	COL_RESPONSE_CODE,
	COL_RESPONSE_BODY,
	COL_CREATED_AT,
	COL_FINISHED_AT,
	COL_LEASE_UNTIL,
	COL_EXPIRES_AT,
	COL_RETENTION,
	COL_SWEEP_AT,
	NUM_COLS = COL_SWEEP_AT
};

/* The extension's relations, looked up once and reset on invalidation. */
typedef struct StoreRels
{
	bool		valid;
	Oid			keys;
	Oid			pkey;
	Oid			sweep_idx;		/* keys_sweep_at_idx */
	Oid			token_seq;
	Oid			owner;			/* owner of idempotency.keys */
} StoreRels;

static StoreRels rels;
static bool callback_registered = false;

/* The prepared writes. */
typedef enum StorePlan
{
	PLAN_INSERT_CLAIM,
	PLAN_UPDATE_CLAIM,
	PLAN_FINISH,
	PLAN_EXTEND,
	PLAN_DELETE,
	PLAN_SWEEP_DELETE,
	PLAN_SWEEP_RESET,
	PLAN_SWEEP_RESCHEDULE,
	NUM_PLANS
} StorePlan;

/* The rows at the ctids $1 that a sweep statement may write: those it can lock now. */
#define SWEEP_ROWS \
	"ctid OPERATOR(pg_catalog.=) ANY (ARRAY(" \
	"SELECT ctid FROM idempotency.keys " \
	"WHERE ctid OPERATOR(pg_catalog.=) ANY ($1) FOR UPDATE SKIP LOCKED))"

/* The most parameters a prepared write takes (a takeover's update). */
#define PLAN_MAX_ARGS			9

typedef struct StorePlanDef
{
	const char *sql;
	int			nargs;
	Oid			argtypes[PLAN_MAX_ARGS];
	AttrNumber	params[PLAN_MAX_ARGS];	/* column of each $n (0: the row's ctid) */
} StorePlanDef;

static const StorePlanDef plan_defs[NUM_PLANS] = {
	[PLAN_INSERT_CLAIM] = {
		"INSERT INTO idempotency.keys (scope, key, status, token, attempt, "
		"fingerprint, response_code, response_body, created_at, finished_at, "
		"lease_until, expires_at, retention, sweep_at) "
		"VALUES ($1, $2, 'pending', $3, 1, $4, NULL, NULL, $5, NULL, "
		"$6, $7, $8, $6)",
		8, {TEXTOID, TEXTOID, INT8OID, BYTEAOID, TIMESTAMPTZOID,
		TIMESTAMPTZOID, TIMESTAMPTZOID, INTERVALOID},
		{COL_SCOPE, COL_KEY, COL_TOKEN, COL_FINGERPRINT, COL_CREATED_AT,
		COL_LEASE_UNTIL, COL_EXPIRES_AT, COL_RETENTION}
	},
	[PLAN_UPDATE_CLAIM] = {
		"UPDATE idempotency.keys SET status = 'pending', token = $2, "
		"attempt = $3, fingerprint = $4, response_code = NULL, "
		"response_body = NULL, created_at = $5, finished_at = NULL, "
		"lease_until = $6, expires_at = $7, retention = $8, sweep_at = $9 "
		"WHERE ctid OPERATOR(pg_catalog.=) $1",
		9, {TIDOID, INT8OID, INT4OID, BYTEAOID, TIMESTAMPTZOID,
		TIMESTAMPTZOID, TIMESTAMPTZOID, INTERVALOID, TIMESTAMPTZOID},
		{0, COL_TOKEN, COL_ATTEMPT, COL_FINGERPRINT, COL_CREATED_AT,
		COL_LEASE_UNTIL, COL_EXPIRES_AT, COL_RETENTION, COL_SWEEP_AT}
	},
	[PLAN_FINISH] = {
		"UPDATE idempotency.keys SET status = $2, response_code = $3, "
		"response_body = $4, finished_at = $5, lease_until = NULL, "
		"expires_at = $6, sweep_at = $7 "
		"WHERE ctid OPERATOR(pg_catalog.=) $1",
		7, {TIDOID, TEXTOID, INT4OID, JSONBOID, TIMESTAMPTZOID,
		TIMESTAMPTZOID, TIMESTAMPTZOID},
		{0, COL_STATUS, COL_RESPONSE_CODE, COL_RESPONSE_BODY, COL_FINISHED_AT,
		COL_EXPIRES_AT, COL_SWEEP_AT}
	},
	[PLAN_EXTEND] = {
		"UPDATE idempotency.keys SET lease_until = $2, expires_at = $3 "
		"WHERE ctid OPERATOR(pg_catalog.=) $1",
		3, {TIDOID, TIMESTAMPTZOID, TIMESTAMPTZOID},
		{0, COL_LEASE_UNTIL, COL_EXPIRES_AT}
	},
	[PLAN_DELETE] = {
		"DELETE FROM idempotency.keys WHERE ctid OPERATOR(pg_catalog.=) $1",
		1, {TIDOID}
	},
	/*
	 * The sweep's statements write only the rows they can lock without
	 * waiting (SWEEP_ROWS), like the direct deletes: a row someone changed
	 * or locked since the sweep read it is skipped, never waited on.
	 */
	[PLAN_SWEEP_DELETE] = {
		"DELETE FROM idempotency.keys WHERE " SWEEP_ROWS,
		1, {TIDARRAYOID}
	},
	[PLAN_SWEEP_RESET] = {
		"UPDATE idempotency.keys SET token = NULL, sweep_at = expires_at "
		"WHERE " SWEEP_ROWS,
		1, {TIDARRAYOID}
	},
	[PLAN_SWEEP_RESCHEDULE] = {
		"UPDATE idempotency.keys SET sweep_at = CASE "
		"WHEN status OPERATOR(pg_catalog.=) 'pending' AND token IS NOT NULL "
		"AND lease_until OPERATOR(pg_catalog.>) $2 THEN lease_until "
		"ELSE expires_at END "
		"WHERE " SWEEP_ROWS,
		2, {TIDARRAYOID, TIMESTAMPTZOID}
	},
};

static SPIPlanPtr plans[NUM_PLANS];

const char *const idem_status_names[IDEM_NSTATUS] = {
	[IDEM_PENDING] = "pending",
	[IDEM_SUCCEEDED] = "succeeded",
	[IDEM_FAILED] = "failed",
};

/* Set *status to the status named by the "len" bytes at "name"; false if none. */
bool
idem_status_parse(const char *name, int len, IdemStatus *status)
{
	for (int i = 0; i < IDEM_NSTATUS; i++)
	{
		if (strlen(idem_status_names[i]) == (size_t) len &&
			memcmp(idem_status_names[i], name, len) == 0)
		{
			*status = (IdemStatus) i;
			return true;
		}
	}
	return false;
}

/* Forget cached relation OIDs when any of our relations changes. */
static void
store_relcache_callback(Datum arg, Oid relid)
{
	if (relid == InvalidOid || relid == rels.keys || relid == rels.pkey ||
		relid == rels.sweep_idx || relid == rels.token_seq)
		rels.valid = false;
}

/*
 * Refuse a relation that is not a member of the extension: the schema is
 * found by name, and whoever owns it could rename it and plant look-alike
 * tables under the old name.
 */
void
idem_store_check_member(Oid relid)
{
	Oid			extoid = get_extension_oid("idempotency", true);

	if (!OidIsValid(extoid) ||
		getExtensionOfObject(RelationRelationId, relid) != extoid)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("relation \"%s\" is not a member of extension \"idempotency\"",
						get_rel_name(relid)),
				 errhint("Someone replaced the extension's objects; reinstall the extension.")));
}

/* Raise 55000 for an extension object ("what") that is not as the extension made it. */
void
idem_store_refuse_replaced(const char *what)
{
	ereport(ERROR,
			(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
			 errmsg("%s is not as extension \"idempotency\" created it", what),
			 errhint("Someone replaced the extension's objects; reinstall the extension.")));
}

/* The column types store_read_slot relies on, in table order. */
static void
store_check_columns(Relation heap)
{
	static const Oid types[NUM_COLS] = {
		TEXTOID, TEXTOID, TEXTOID, INT8OID, INT4OID, BYTEAOID, INT4OID,
		JSONBOID, TIMESTAMPTZOID, TIMESTAMPTZOID, TIMESTAMPTZOID,
		TIMESTAMPTZOID, INTERVALOID, TIMESTAMPTZOID
	};
	TupleDesc	desc = RelationGetDescr(heap);

	if (desc->natts != NUM_COLS)
		idem_store_refuse_replaced("table \"idempotency.keys\"");
	for (int i = 0; i < NUM_COLS; i++)
		if (TupleDescAttr(desc, i)->atttypid != types[i] ||
			TupleDescAttr(desc, i)->attisdropped)
			idem_store_refuse_replaced("table \"idempotency.keys\"");
}

/*
 * Refuse an index that is not the btree on "ncols" columns of the table
 * "keys" that we scan directly (indexes are not extension members: they
 * belong to their table, so check what they index).
 */
static void
store_check_index(Oid indexid, Oid keys, int ncols, AttrNumber col1,
				  AttrNumber col2)
{
	Relation	index = index_open(indexid, AccessShareLock);
	Form_pg_index form = index->rd_index;
	bool		ok;

	ok = form->indrelid == keys && form->indisvalid &&
		index->rd_rel->relam == BTREE_AM_OID &&
		form->indnkeyatts == ncols &&
		form->indkey.values[0] == col1 &&
		(ncols < 2 || form->indkey.values[1] == col2) &&
		heap_attisnull(index->rd_indextuple, Anum_pg_index_indexprs, NULL) &&
		heap_attisnull(index->rd_indextuple, Anum_pg_index_indpred, NULL);
	index_close(index, NoLock);
	if (!ok)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("index \"%s\" is not the index extension \"idempotency\" created",
						get_rel_name(indexid)),
				 errhint("Someone replaced the extension's objects; reinstall the extension.")));
}

/* Raise 55000 for an extension object ("what") that is gone. */
void
idem_store_refuse_missing(const char *what)
{
	ereport(ERROR,
			(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
			 errmsg("%s of extension \"idempotency\" is missing", what),
			 errhint("Someone dropped the extension's objects; reinstall the extension.")));
}

static void store_refuse_not_installed(void) pg_attribute_noreturn();

/* Raise 42704: the extension is not installed in this database. */
static void
store_refuse_not_installed(void)
{
	ereport(ERROR,
			(errcode(ERRCODE_UNDEFINED_OBJECT),
			 errmsg("extension \"idempotency\" is not installed in this database"),
			 errhint("Run CREATE EXTENSION idempotency.")));
}

/*
 * The relation "name" of the extension's schema, locked AccessShareLock (as
 * every use of it does) so that it cannot be dropped or replaced before the
 * transaction ends; InvalidOid when there is none.  A name may point to a
 * new relation by the time its lock is granted (a DROP and CREATE committed
 * while we waited): as RangeVarGetRelidExtended does, the name is looked up
 * again whenever invalidations arrived meanwhile.  The schema name is fixed
 * (the extension is not relocatable), so no search_path is involved.
 * Raises 42704 when the schema does not exist.
 */
Oid
idem_store_lock_relation(const char *name)
{
	for (;;)
	{
		uint64		inval_count = SharedInvalidMessageCounter;
		Oid			nsp = get_namespace_oid("idempotency", true);
		Oid			relid;

		if (!OidIsValid(nsp))
			store_refuse_not_installed();
		relid = get_relname_relid(name, nsp);
		if (!OidIsValid(relid))
			return InvalidOid;
		LockRelationOid(relid, AccessShareLock);
		if (inval_count == SharedInvalidMessageCounter)
			return relid;
	}
}

/* Look the extension's relations up into *found, each locked. */
static void
store_find_rels(StoreRels *found)
{
	memset(found, 0, sizeof(StoreRels));
	found->keys = idem_store_lock_relation("keys");
	found->token_seq = idem_store_lock_relation("token_seq");
	if (!OidIsValid(found->keys) || !OidIsValid(found->token_seq))
		store_refuse_not_installed();
	found->pkey = idem_store_lock_relation("keys_pkey");
	if (!OidIsValid(found->pkey))
		idem_store_refuse_missing("index \"keys_pkey\"");
	found->sweep_idx = idem_store_lock_relation("keys_sweep_at_idx");
	if (!OidIsValid(found->sweep_idx))
		idem_store_refuse_missing("index \"keys_sweep_at_idx\"");
}

/*
 * Find the extension's relations and check them, then publish them in
 * "rels".  A name may point to a new relation by the time its lock is
 * granted (a DROP and CREATE INDEX committed while we waited): as
 * RangeVarGetRelidExtended does, look the names up again whenever
 * invalidations arrived meanwhile, until the OIDs we hold locks on are the
 * ones the names mean.  Nothing is published until every check passed, so
 * an error leaves the cache invalid and the next call looks again.
 */
static void
store_lookup_rels(void)
{
	StoreRels	found;

	/*
	 * The first lock this transaction takes on the table accepts the
	 * invalidations queued meanwhile (a REINDEX CONCURRENTLY of an index,
	 * say): take it before trusting the cache, not after.  Every caller
	 * opens the table next, so this costs a local lock table lookup.
	 */
	if (rels.valid)
	{
		LockRelationOid(rels.keys, AccessShareLock);
		if (rels.valid)
			return;
	}
	if (!callback_registered)
	{
		CacheRegisterRelcacheCallback(store_relcache_callback, (Datum) 0);
		callback_registered = true;
	}
	for (;;)
	{
		uint64		inval_count = SharedInvalidMessageCounter;
		Relation	heap;

		store_find_rels(&found);
		if (inval_count != SharedInvalidMessageCounter)
			continue;			/* a name may have moved: look again */
		idem_store_check_member(found.keys);
		idem_store_check_member(found.token_seq);
		heap = table_open(found.keys, AccessShareLock);
		store_check_columns(heap);
		found.owner = heap->rd_rel->relowner;
		table_close(heap, NoLock);
		store_check_index(found.pkey, found.keys, 2, COL_SCOPE, COL_KEY);
		store_check_index(found.sweep_idx, found.keys, 1, COL_SWEEP_AT, 0);
		if (inval_count == SharedInvalidMessageCounter)
			break;
	}

	/*
	 * Publish at once: an invalidation that arrives from here on clears
	 * "valid" through the callback, which compares against these OIDs.
	 */
	found.valid = true;
	rels = found;
}

/* Copy one column of a probed row into *row. */
static void
store_read_slot(TupleTableSlot *slot, bool want_body, IdemRow *row)
{
	Datum	   *v;
	bool	   *n;
	text	   *status;

	slot_getallattrs(slot);
	v = slot->tts_values;
	n = slot->tts_isnull;

	status = DatumGetTextPP(v[COL_STATUS - 1]);
	if (!idem_status_parse(VARDATA_ANY(status), VARSIZE_ANY_EXHDR(status),
						   &row->status))
		ereport(ERROR,
				(errcode(ERRCODE_DATA_CORRUPTED),
				 errmsg("idempotency key has an unknown status \"%s\"",
						text_to_cstring(status)),
				 errhint("Someone changed idempotency.keys outside the extension's functions.")));
	row->has_token = !n[COL_TOKEN - 1];
	row->token = row->has_token ? DatumGetInt64(v[COL_TOKEN - 1]) : 0;
	row->attempt = DatumGetInt32(v[COL_ATTEMPT - 1]);
	row->has_fingerprint = !n[COL_FINGERPRINT - 1];
	if (row->has_fingerprint)
	{
		bytea	   *fp = DatumGetByteaPP(v[COL_FINGERPRINT - 1]);

		if (VARSIZE_ANY_EXHDR(fp) != IDEM_FINGERPRINT_LEN)
			ereport(ERROR,
					(errcode(ERRCODE_DATA_CORRUPTED),
					 errmsg("idempotency key has a fingerprint of %d bytes, expected %d",
							(int) VARSIZE_ANY_EXHDR(fp), IDEM_FINGERPRINT_LEN),
					 errhint("Someone changed idempotency.keys outside the extension's functions.")));
		memcpy(row->fingerprint, VARDATA_ANY(fp), IDEM_FINGERPRINT_LEN);
	}
	row->has_response_code = !n[COL_RESPONSE_CODE - 1];
	row->response_code = row->has_response_code ?
		DatumGetInt32(v[COL_RESPONSE_CODE - 1]) : 0;
	/* Keep the body as stored (possibly a TOAST pointer): cheap to copy. */
	row->response_body = (want_body && !n[COL_RESPONSE_BODY - 1]) ?
		datumCopy(v[COL_RESPONSE_BODY - 1], false, -1) : (Datum) 0;
	row->created_at = DatumGetTimestampTz(v[COL_CREATED_AT - 1]);
	row->has_finished_at = !n[COL_FINISHED_AT - 1];
	row->finished_at = row->has_finished_at ?
		DatumGetTimestampTz(v[COL_FINISHED_AT - 1]) : 0;
	row->has_lease_until = !n[COL_LEASE_UNTIL - 1];
	row->lease_until = row->has_lease_until ?
		DatumGetTimestampTz(v[COL_LEASE_UNTIL - 1]) : 0;
	row->expires_at = DatumGetTimestampTz(v[COL_EXPIRES_AT - 1]);
	row->sweep_at = DatumGetTimestampTz(v[COL_SWEEP_AT - 1]);
	memcpy(&row->retention, DatumGetIntervalP(v[COL_RETENTION - 1]),
		   sizeof(Interval));
}

/*
 * Does a tuple header with this infomask and raw xmax say that another
 * transaction, still running, holds a row lock on it (FOR UPDATE / SHARE,
 * no update)?  A dirty snapshot shows such a tuple as plainly visible, but
 * writing it would wait for the locker.
 */
static bool
store_xmax_locks_other(uint16 infomask, TransactionId xmax)
{
	if ((infomask & HEAP_XMAX_INVALID) || !HEAP_XMAX_IS_LOCKED_ONLY(infomask))
		return false;
	if (infomask & HEAP_XMAX_IS_MULTI)
		return MultiXactIdIsRunning((MultiXactId) xmax, true);
	return !TransactionIdIsCurrentTransactionId(xmax) &&
		TransactionIdIsInProgress(xmax);
}

/*
 * The infomask and raw xmax of the tuple in "slot" (just fetched from its
 * buffer).  Its header lives in a shared buffer that other backends change
 * under the buffer's lock (a locker sets xmax and infomask, and an update
 * marks the old version locked for a moment while it finds room for the
 * new one), so read it under a share lock.
 */
static void
store_read_xmax(TupleTableSlot *slot, uint16 *infomask, TransactionId *xmax)
{
	BufferHeapTupleTableSlot *bslot = (BufferHeapTupleTableSlot *) slot;
	HeapTupleHeader tup;

	Assert(TTS_IS_BUFFERTUPLE(slot));
	tup = bslot->base.tuple->t_data;
	if (BufferIsValid(bslot->buffer))
		LockBuffer(bslot->buffer, BUFFER_LOCK_SHARE);
	*infomask = tup->t_infomask;
	*xmax = HeapTupleHeaderGetRawXmax(tup);
	if (BufferIsValid(bslot->buffer))
		LockBuffer(bslot->buffer, BUFFER_LOCK_UNLOCK);
}

/* Is the tuple in "slot" row-locked by another running transaction? */
static bool
store_locked_by_other(TupleTableSlot *slot)
{
	uint16		infomask;
	TransactionId xmax;

	store_read_xmax(slot, &infomask, &xmax);
	return store_xmax_locks_other(infomask, xmax);
}

/* Record the probed tuple version in *row. */
static void
store_take_tuple(TupleTableSlot *slot, bool want_body, IdemRow *row)
{
	HeapTuple	tuple;
	bool		should_free;

	tuple = ExecFetchSlotHeapTuple(slot, false, &should_free);
	row->found = true;
	row->locked = store_locked_by_other(slot);
	row->tid = tuple->t_self;
	row->xmin = HeapTupleHeaderGetXmin(tuple->t_data);
	row->mine = TransactionIdIsCurrentTransactionId(row->xmin);
	store_read_slot(slot, want_body, row);
	if (should_free)
		heap_freetuple(tuple);
}

/*
 * Record that the tuple in "slot", which the dirty snapshot "dirty" just
 * returned, is being changed by another transaction: which one, and, when
 * the tuple is the newest version it writes, the token that version
 * carries.  A dirty snapshot returns every version the transaction wrote
 * (it looks no further than an in-progress xmin), so one that the same
 * transaction updated or deleted again is not the newest: its token says
 * nothing about what the transaction leaves behind.
 */
static void
store_note_busy(TupleTableSlot *slot, Snapshot dirty, IdemRow *row)
{
	row->busy = true;
	if (TransactionIdIsValid(dirty->xmin))
	{
		uint16		infomask;
		TransactionId xmax;
		bool		isnull;
		Datum		token;

		store_read_xmax(slot, &infomask, &xmax);
		row->busy_xid = dirty->xmin;
		if (!(infomask & HEAP_XMAX_INVALID) && !HEAP_XMAX_IS_LOCKED_ONLY(infomask))
			return;				/* changed again by the same transaction */
		token = slot_getattr(slot, COL_TOKEN, &isnull);
		row->busy_new = true;
		row->busy_token = isnull ? 0 : DatumGetInt64(token);
	}
	else if (!TransactionIdIsValid(row->busy_xid))
		row->busy_xid = dirty->xmax;
}

/* Does the row in "slot" hold (scope, key)? */
static bool
store_slot_is_key(TupleTableSlot *slot, text *scope, text *key)
{
	text	   *s = DatumGetTextPP(slot->tts_values[COL_SCOPE - 1]);
	text	   *k = DatumGetTextPP(slot->tts_values[COL_KEY - 1]);

	return VARSIZE_ANY_EXHDR(s) == VARSIZE_ANY_EXHDR(scope) &&
		VARSIZE_ANY_EXHDR(k) == VARSIZE_ANY_EXHDR(key) &&
		memcmp(VARDATA_ANY(s), VARDATA_ANY(scope), VARSIZE_ANY_EXHDR(s)) == 0 &&
		memcmp(VARDATA_ANY(k), VARDATA_ANY(key), VARSIZE_ANY_EXHDR(k)) == 0;
}

/* One scan of the key's primary-key entries (idem_store_probe). */
static void
store_probe_once(text *scope, text *key, IdemProbeMode mode, bool want_body,
				 IdemRow *row)
{
	Relation	heap;
	Relation	index;
	SnapshotData dirty;
	Snapshot	snapshot;
	ScanKeyData skey[2];
	IndexScanDesc scan;
	TupleTableSlot *slot;

	memset(row, 0, sizeof(IdemRow));
	store_lookup_rels();

	heap = table_open(rels.keys, AccessShareLock);
	index = index_open(rels.pkey, AccessShareLock);

	if (mode == IDEM_PROBE_LATEST)
	{
		InitDirtySnapshot(dirty);
		snapshot = &dirty;
	}
	else
		snapshot = GetActiveSnapshot();

	/* ScanKeyInit compares with the "C" collation, as the columns do. */
	ScanKeyInit(&skey[0], COL_SCOPE, BTEqualStrategyNumber, F_TEXTEQ,
				PointerGetDatum(scope));
	ScanKeyInit(&skey[1], COL_KEY, BTEqualStrategyNumber, F_TEXTEQ,
				PointerGetDatum(key));

	slot = table_slot_create(heap, NULL);
	scan = index_beginscan(heap, index, snapshot, 2, 0);
	index_rescan(scan, skey, 2, NULL, 0);
	/* index_getnext_slot, spelled out to put a pause point in the middle */
	while (scan->xs_heap_continue ||
		   index_getnext_tid(scan, ForwardScanDirection) != NULL)
	{
		/* The index page is read; the heap is not yet. */
		IDEM_PAUSE("probe-index-read");
		if (!index_fetch_heap(scan, slot))
			continue;
		if (mode == IDEM_PROBE_SNAPSHOT)
		{
			HeapTuple	tuple;
			bool		should_free;

			tuple = ExecFetchSlotHeapTuple(slot, false, &should_free);
			row->found = true;
			row->tid = tuple->t_self;
			store_read_slot(slot, want_body, row);
			if (should_free)
				heap_freetuple(tuple);
		}
		else if (TransactionIdIsValid(dirty.xmin) ||
				 TransactionIdIsValid(dirty.xmax))
			store_note_busy(slot, &dirty, row);
		else
			store_take_tuple(slot, want_body, row);
		/* One version is judged; the next is not read yet. */
		IDEM_PAUSE("probe-version-read");
	}
	index_endscan(scan);
	ExecDropSingleTupleTableSlot(slot);
	index_close(index, NoLock);
	table_close(heap, NoLock);
}

/*
 * Read one key through its primary key.
 *
 * IDEM_PROBE_LATEST reads with a dirty snapshot: it sees the newest
 * committed version and our own transaction's changes, and it marks the
 * row busy when another transaction has inserted, updated or deleted it
 * and not yet ended.  It never waits.  IDEM_PROBE_SNAPSHOT reads what the
 * active snapshot sees (idem_lookup, and hot standbys).
 *
 * A scan reads the key's row versions one after the other, so the change
 * it saw in flight may have committed or aborted before it read the next
 * version: it then saw the old version being changed and the new one
 * plainly, a state that never existed.  When the changing transaction has
 * ended by the end of the scan, the key is read once more.
 */
void
idem_store_probe(text *scope, text *key, IdemProbeMode mode, bool want_body,
				 IdemRow *row)
{
	store_probe_once(scope, key, mode, want_body, row);
	if (row->busy && !TransactionIdIsInProgress(row->busy_xid))
		store_probe_once(scope, key, mode, want_body, row);
}

/*
 * Read the row version at "tid" with a dirty snapshot, as a probe would,
 * but without the index descent (the sweeper got the tid from its query).
 * found is false when that version is gone (a committed update or delete
 * replaced it) or holds another key.  The relation and slot come from
 * idem_store_fetch_begin, so that a chunk of fetches shares them.
 */
void
idem_store_fetch(IdemFetch *fetch, ItemPointer tid, text *scope, text *key,
				 IdemRow *row)
{
	SnapshotData dirty;

	memset(row, 0, sizeof(IdemRow));
	InitDirtySnapshot(dirty);
	if (table_tuple_fetch_row_version(fetch->heap, tid, &dirty, fetch->slot))
	{
		if (TransactionIdIsValid(dirty.xmin) ||
			TransactionIdIsValid(dirty.xmax))
			store_note_busy(fetch->slot, &dirty, row);
		else
		{
			store_take_tuple(fetch->slot, false, row);
			if (!store_slot_is_key(fetch->slot, scope, key))
				row->found = false;
		}
		ExecClearTuple(fetch->slot);
	}
}

/* Open the table for a run of idem_store_fetch calls. */
void
idem_store_fetch_begin(IdemFetch *fetch)
{
	store_lookup_rels();
	fetch->heap = table_open(rels.keys, AccessShareLock);
	fetch->slot = table_slot_create(fetch->heap, NULL);
}

/* End a run of idem_store_fetch calls. */
void
idem_store_fetch_end(IdemFetch *fetch)
{
	ExecDropSingleTupleTableSlot(fetch->slot);
	table_close(fetch->heap, NoLock);
}

/*
 * Under REPEATABLE READ and SERIALIZABLE a write may only build on a row
 * that the transaction's snapshot sees; a newer row means a concurrent
 * change, which these levels report as a serialization failure.
 */
void
idem_store_check_snapshot(const IdemRow *row)
{
	if (!IsolationUsesXactSnapshot() || !row->found || row->mine)
		return;
	if (XidInMVCCSnapshot(row->xmin, GetTransactionSnapshot()))
		ereport(ERROR,
				(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
				 errmsg("could not serialize access due to concurrent update of an idempotency key"),
				 errhint("Retry the transaction.")));
}

/* Fill the advisory lock tag of a key hash. */
static void
store_locktag(LOCKTAG *tag, uint64 hash)
{
	SET_LOCKTAG_ADVISORY(*tag, MyDatabaseId, (uint32) (hash >> 32),
						 (uint32) hash, IDEM_LOCKTAG_FIELD4);
}

/*
 * Take the key's advisory lock, transaction-level so that an ERROR inside
 * the critical section releases it with the (sub)transaction.  Returns
 * false when "wait" is false and another backend holds it.  Critical
 * sections never wait on anything, so a waiting acquire is short.
 */
bool
idem_store_lock(uint64 hash, bool wait)
{
	LOCKTAG		tag;

	store_locktag(&tag, hash);
	return LockAcquire(&tag, ExclusiveLock, false, !wait) !=
		LOCKACQUIRE_NOT_AVAIL;
}

/*
 * Release the key's lock at the end of the critical section, so nothing is
 * held per key until commit (a batch of 10,000 claims must not fill the
 * lock table).
 */
void
idem_store_unlock(uint64 hash)
{
	LOCKTAG		tag;

	store_locktag(&tag, hash);
	LockRelease(&tag, ExclusiveLock, false);
}

/*
 * The next fencing token: larger than every token issued before, even
 * across a crash.  A sequence logs its position ahead (every 32 values and
 * after each checkpoint) but leaves flushing that record to the commit, so
 * a token handed out by a transaction that never commits could be issued
 * again after a crash.  The caller may already have passed that token to
 * a downstream system, so when nextval wrote WAL, flush it now: one flush
 * per 32 tokens at most.
 */
int64
idem_store_next_token(void)
{
	XLogRecPtr	before = XactLastRecEnd;
	int64		token;

	store_lookup_rels();
	token = nextval_internal(rels.token_seq, false);
	if (XactLastRecEnd != before)
		XLogFlush(XactLastRecEnd);
	return token;
}

/* Prepare (once per backend) and return one of the store's statements. */
static SPIPlanPtr
store_plan(StorePlan which)
{
	if (plans[which] == NULL)
	{
		const StorePlanDef *def = &plan_defs[which];
		SPIPlanPtr	plan;

		plan = SPI_prepare_cursor(def->sql, def->nargs,
								  (Oid *) def->argtypes,
								  CURSOR_OPT_GENERIC_PLAN);
		if (plan == NULL)
			elog(ERROR, "could not prepare idempotency statement: %s",
				 SPI_result_code_string(SPI_result));
		if (SPI_keepplan(plan) != 0)
			elog(ERROR, "could not keep idempotency statement");
		plans[which] = plan;
	}
	return plans[which];
}

/*
 * Open a store section: connect SPI and act as the table's owner, with
 * restricted security, until idem_store_end.  The caller keeps the saved
 * identity in *section (on its stack), so that a section opened inside
 * another one (a trigger on the table that calls these functions) restores
 * what its own caller had.  An ERROR in between is cleaned up by
 * transaction abort (SPI and the user id both).
 */
void
idem_store_begin(IdemStoreSection *section)
{
	store_lookup_rels();
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	GetUserIdAndSecContext(&section->saved_userid, &section->saved_sec_context);
	SetUserIdAndSecContext(rels.owner, section->saved_sec_context |
						   SECURITY_LOCAL_USERID_CHANGE |
						   SECURITY_RESTRICTED_OPERATION);
}

/* Close the store section "section" opened by idem_store_begin. */
void
idem_store_end(IdemStoreSection *section)
{
	SetUserIdAndSecContext(section->saved_userid, section->saved_sec_context);
	if (SPI_finish() != SPI_OK_FINISH)
		elog(ERROR, "SPI_finish failed");
}

/*
 * Execute one of the store's prepared statements (each addresses rows by
 * ctid).  Its generic plan is built at the first execution (and again
 * after an invalidation); if the table looks empty to the planner then
 * (freshly vacuumed), a Seq Scan costs nothing and would be kept for every
 * later call on a growing table.  So seq scans are disabled while the
 * statement runs (and may be planned), the way a function's SET clause
 * does it: in a GUC nesting level of its own, so that a trigger on the
 * table that changes the setting (SET LOCAL) inside the statement is
 * unwound with it, and an ERROR unwinds it with the (sub)transaction.
 */
static int
store_execute(SPIPlanPtr plan, Datum *values, const char *nulls)
{
	int			save_nestlevel = NewGUCNestLevel();
	int			rc;

	(void) set_config_option("enable_seqscan", "off", PGC_USERSET,
							 PGC_S_SESSION, GUC_ACTION_SAVE, true, 0, false);
	rc = SPI_execute_plan(plan, values, nulls, false, 0);
	AtEOXact_GUC(true, save_nestlevel);
	return rc;
}

/*
 * A write found fewer rows than it probed under their locks: under
 * REPEATABLE READ or SERIALIZABLE the statement's snapshot predates a
 * concurrent change (a serialization failure); otherwise it cannot happen.
 */
static void
store_raise_vanished(void)
{
	if (IsolationUsesXactSnapshot())
		ereport(ERROR,
				(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
				 errmsg("could not serialize access due to concurrent update of an idempotency key"),
				 errhint("Retry the transaction.")));
	elog(ERROR, "idempotency key row vanished during a write");
}

/*
 * A write's new column values.  "set" marks the columns it writes; both the
 * direct path and the prepared statements write exactly these values.
 */
typedef struct StoreChange
{
	Datum		values[NUM_COLS];
	bool		nulls[NUM_COLS];
	bool		set[NUM_COLS];
} StoreChange;

static void
change_set(StoreChange *change, AttrNumber col, Datum value)
{
	change->values[col - 1] = value;
	change->nulls[col - 1] = false;
	change->set[col - 1] = true;
}

static void
change_null(StoreChange *change, AttrNumber col)
{
	change->values[col - 1] = (Datum) 0;
	change->nulls[col - 1] = true;
	change->set[col - 1] = true;
}

/* A bytea fingerprint column, or NULL. */
static void
change_fingerprint(StoreChange *change, const uint8 *fingerprint)
{
	bytea	   *b;

	if (fingerprint == NULL)
	{
		change_null(change, COL_FINGERPRINT);
		return;
	}
	b = palloc(VARHDRSZ + IDEM_FINGERPRINT_LEN);
	SET_VARSIZE(b, VARHDRSZ + IDEM_FINGERPRINT_LEN);
	memcpy(VARDATA(b), fingerprint, IDEM_FINGERPRINT_LEN);
	change_set(change, COL_FINGERPRINT, PointerGetDatum(b));
}

/*
 * Run one prepared write that must touch exactly the probed row, its
 * parameters taken from "change" (and the row's ctid).  Zero rows means the
 * row is not visible to this statement's snapshot, which only happens under
 * REPEATABLE READ or SERIALIZABLE after a concurrent change.
 */
static void
store_write(StorePlan which, const ItemPointerData *tid,
			const StoreChange *change, int ok_rc)
{
	const StorePlanDef *def = &plan_defs[which];
	Datum		values[PLAN_MAX_ARGS];
	char		nulls[PLAN_MAX_ARGS];
	int			rc;

	for (int i = 0; i < def->nargs; i++)
	{
		AttrNumber	col = def->params[i];

		values[i] = col == 0 ? PointerGetDatum(tid) : change->values[col - 1];
		nulls[i] = col != 0 && change->nulls[col - 1] ? 'n' : ' ';
	}
	rc = store_execute(store_plan(which), values, nulls);
	if (rc != ok_rc)
		elog(ERROR, "idempotency statement failed: %s",
			 SPI_result_code_string(rc));
	if (SPI_processed != 1)
		store_raise_vanished();
}

/*
 * Direct writes.  A claim's insert and the updates of claim, finish and
 * extend skip SPI and the executor's per-statement start-up, which was most
 * of their CPU time: the row is formed here, checked
 * against the table's NOT NULL and CHECK constraints, written through the
 * table AM and entered into every index of the table (a user's own index
 * too), the way logical replication applies rows.  Only for a table as the
 * extension creates it, without triggers, rules, row security or generated
 * columns; otherwise the prepared statements run,
 * so that whatever a user attached to the table still fires.
 */
typedef struct StoreDirect
{
	Relation	heap;
	EState	   *estate;
	ResultRelInfo *rri;
	TupleTableSlot *slot;
} StoreDirect;

/*
 * May the store write this table directly?  Not when a user attached
 * something only the executor applies: triggers (a foreign key that
 * references the table is one), rules, row security, stored generated
 * columns.  The sweep's deletes follow the same rule.
 */
static bool
store_direct_ok(Relation heap)
{
	TupleConstr *constr = RelationGetDescr(heap)->constr;

	return heap->trigdesc == NULL && heap->rd_rules == NULL &&
		!heap->rd_rel->relrowsecurity &&
		(constr == NULL || !constr->has_generated_stored);
}

static bool
store_direct_begin(StoreDirect *direct)
{
	Relation	heap = table_open(rels.keys, RowExclusiveLock);
	MemoryContext old;

	if (!store_direct_ok(heap))
	{
		table_close(heap, NoLock);
		return false;
	}
	/*
	 * Like SPI before each statement: rows written earlier in this command
	 * (say, by idem_sweep in the same SELECT) become visible to the update.
	 */
	CommandCounterIncrement();
	direct->heap = heap;
	direct->estate = CreateExecutorState();
	old = MemoryContextSwitchTo(direct->estate->es_query_cxt);
	direct->rri = makeNode(ResultRelInfo);
	InitResultRelInfo(direct->rri, heap, 0, NULL, 0);
	ExecOpenIndices(direct->rri, false);
	direct->slot = ExecInitExtraTupleSlot(direct->estate,
										  RelationGetDescr(heap),
										  table_slot_callbacks(heap));
	MemoryContextSwitchTo(old);
	return true;
}

/*
 * Enter the row in the slot into the table's indexes after the table AM
 * wrote it (an update calls this only when it was not a HOT update).
 */
static void
store_direct_index(StoreDirect *direct, bool update, bool only_summarizing)
{
	if (direct->rri->ri_NumIndices == 0)
		return;
	list_free(ExecInsertIndexTuples(direct->rri, direct->slot, direct->estate,
									update, false, NULL, NIL
#if PG_VERSION_NUM >= 160000
									,only_summarizing
#endif
									));
}

static void
store_direct_insert(StoreDirect *direct, const StoreChange *change)
{
	TupleTableSlot *slot = direct->slot;

	ExecClearTuple(slot);
	memcpy(slot->tts_values, change->values, sizeof(change->values));
	memcpy(slot->tts_isnull, change->nulls, sizeof(change->nulls));
	ExecStoreVirtualTuple(slot);
	if (RelationGetDescr(direct->heap)->constr != NULL)
		ExecConstraints(direct->rri, slot, direct->estate);
	table_tuple_insert(direct->heap, slot, GetCurrentCommandId(true), 0, NULL);
	store_direct_index(direct, false, false);
}

/*
 * Update the row version at "tid" (the newest, probed under the key's
 * lock).  A concurrent change by someone outside the extension's functions
 * since the probe is reported like the SQL statement would report it.
 */
static void
store_direct_update(StoreDirect *direct, const ItemPointerData *tid,
					const StoreChange *change)
{
	MemoryContext caller = MemoryContextSwitchTo(direct->estate->es_query_cxt);
	TupleTableSlot *old = ExecInitExtraTupleSlot(direct->estate,
												 RelationGetDescr(direct->heap),
												 table_slot_callbacks(direct->heap));
	TupleTableSlot *slot = direct->slot;
	ItemPointerData otid = *tid;
	TM_FailureData tmfd;
	LockTupleMode lockmode;
	TM_Result	result;
#if PG_VERSION_NUM >= 160000
	TU_UpdateIndexes update_indexes;
#else
	bool		update_indexes;
#endif

	/* A publication that publishes updates needs the replica identity. */
	CheckCmdReplicaIdentity(direct->heap, CMD_UPDATE);
	if (!table_tuple_fetch_row_version(direct->heap, &otid, SnapshotAny, old))
		store_raise_vanished();
	ExecMaterializeSlot(old);	/* its copy lives until store_direct_end */
	slot_getallattrs(old);
	MemoryContextSwitchTo(caller);

	ExecClearTuple(slot);
	for (int i = 0; i < NUM_COLS; i++)
	{
		slot->tts_values[i] = change->set[i] ? change->values[i] : old->tts_values[i];
		slot->tts_isnull[i] = change->set[i] ? change->nulls[i] : old->tts_isnull[i];
	}
	ExecStoreVirtualTuple(slot);
	if (RelationGetDescr(direct->heap)->constr != NULL)
		ExecConstraints(direct->rri, slot, direct->estate);

	result = table_tuple_update(direct->heap, &otid, slot,
								GetCurrentCommandId(true),
								ActiveSnapshotSet() ? GetActiveSnapshot() : InvalidSnapshot,
								InvalidSnapshot, true, &tmfd, &lockmode,
								&update_indexes);
	if (result == TM_Updated || result == TM_Deleted)
		store_raise_vanished();
	if (result != TM_Ok)
		elog(ERROR, "unexpected result %d updating an idempotency key",
			 (int) result);
#if PG_VERSION_NUM >= 160000
	if (update_indexes != TU_None)
		store_direct_index(direct, true, update_indexes == TU_Summarizing);
#else
	if (update_indexes)
		store_direct_index(direct, true, false);
#endif
}

/* End a direct write; the next command sees it, as after a statement. */
static void
store_direct_end(StoreDirect *direct)
{
	ExecCloseIndices(direct->rri);
	ExecResetTupleTable(direct->estate->es_tupleTable, false);
	FreeExecutorState(direct->estate);
	table_close(direct->heap, NoLock);
	CommandCounterIncrement();
}

/*
 * Write "change" in a store section of its own: insert it as a new row (tid
 * NULL), delete the row version at "tid" (PLAN_DELETE), or apply it to that
 * version, directly when the table allows, else with the prepared statement
 * "which".
 */
static void
store_apply(StorePlan which, const ItemPointerData *tid,
			const StoreChange *change)
{
	IdemStoreSection section;
	StoreDirect direct;

	idem_store_begin(&section);
	if (which != PLAN_DELETE && store_direct_begin(&direct))
	{
		if (tid == NULL)
			store_direct_insert(&direct, change);
		else
			store_direct_update(&direct, tid, change);
		store_direct_end(&direct);
	}
	else
		store_write(which, tid, change,
					which == PLAN_DELETE ? SPI_OK_DELETE :
					tid == NULL ? SPI_OK_INSERT : SPI_OK_UPDATE);
	idem_store_end(&section);
}

/*
 * The sweep_at of an existing row that a write makes due at "due": never
 * later than it was.  The sweeper finds a row whose sweep_at passed before
 * its time and moves it forward then; leaving sweep_at where it is, when
 * that is earlier, keeps the write a HOT update (sweep_at is indexed).
 */
static TimestampTz
store_sweep_at(const IdemRow *row, TimestampTz due)
{
	return Min(row->sweep_at, due);
}

/* The columns of a new pending attempt, whether inserted or taking a row over. */
static void
change_pending(StoreChange *change, int64 token, int32 attempt,
			   const uint8 *fingerprint, TimestampTz created_at,
			   TimestampTz lease_until, TimestampTz expires_at,
			   Interval *retention, TimestampTz sweep_at)
{
	memset(change, 0, sizeof(StoreChange));
	change_set(change, COL_STATUS, CStringGetTextDatum(idem_status_names[IDEM_PENDING]));
	change_set(change, COL_TOKEN, Int64GetDatum(token));
	change_set(change, COL_ATTEMPT, Int32GetDatum(attempt));
	change_fingerprint(change, fingerprint);
	change_null(change, COL_RESPONSE_CODE);
	change_null(change, COL_RESPONSE_BODY);
	change_set(change, COL_CREATED_AT, TimestampTzGetDatum(created_at));
	change_null(change, COL_FINISHED_AT);
	change_set(change, COL_LEASE_UNTIL, TimestampTzGetDatum(lease_until));
	change_set(change, COL_EXPIRES_AT, TimestampTzGetDatum(expires_at));
	change_set(change, COL_RETENTION, IntervalPGetDatum(retention));
	change_set(change, COL_SWEEP_AT, TimestampTzGetDatum(sweep_at));
}

/* Insert a new pending key (first attempt). */
void
idem_store_insert_claim(text *scope, text *key, int64 token,
						const uint8 *fingerprint, TimestampTz now,
						TimestampTz lease_until, TimestampTz expires_at,
						Interval *retention)
{
	StoreChange change;

	change_pending(&change, token, 1, fingerprint, now, lease_until,
				   expires_at, retention, lease_until);
	change_set(&change, COL_SCOPE, PointerGetDatum(scope));
	change_set(&change, COL_KEY, PointerGetDatum(key));
	store_apply(PLAN_INSERT_CLAIM, NULL, &change);
}

/*
 * Turn the probed row into a new pending attempt: a takeover (attempt + 1)
 * or a fresh claim over a row past its retention (attempt 1).
 */
void
idem_store_update_claim(const IdemRow *row, int64 token, int32 attempt,
						const uint8 *fingerprint, TimestampTz created_at,
						TimestampTz lease_until, TimestampTz expires_at,
						Interval *retention)
{
	StoreChange change;

	change_pending(&change, token, attempt, fingerprint, created_at,
				   lease_until, expires_at, retention,
				   store_sweep_at(row, lease_until));
	store_apply(PLAN_UPDATE_CLAIM, &row->tid, &change);
}

/* Store the result of the probed pending row. */
void
idem_store_finish(const IdemRow *row, IdemStatus status, bool has_code,
				  int32 code, Datum body, TimestampTz now,
				  TimestampTz expires_at)
{
	StoreChange change;

	memset(&change, 0, sizeof(change));
	change_set(&change, COL_STATUS, CStringGetTextDatum(idem_status_names[status]));
	if (has_code)
		change_set(&change, COL_RESPONSE_CODE, Int32GetDatum(code));
	else
		change_null(&change, COL_RESPONSE_CODE);
	if (body != (Datum) 0)
		change_set(&change, COL_RESPONSE_BODY, body);
	else
		change_null(&change, COL_RESPONSE_BODY);
	change_set(&change, COL_FINISHED_AT, TimestampTzGetDatum(now));
	change_null(&change, COL_LEASE_UNTIL);
	change_set(&change, COL_EXPIRES_AT, TimestampTzGetDatum(expires_at));
	change_set(&change, COL_SWEEP_AT,
			   TimestampTzGetDatum(store_sweep_at(row, expires_at)));
	store_apply(PLAN_FINISH, &row->tid, &change);
}

/* Push the lease (and the pending expiry) of the probed row. */
void
idem_store_extend(const IdemRow *row, TimestampTz lease_until,
				  TimestampTz expires_at)
{
	StoreChange change;

	memset(&change, 0, sizeof(change));
	change_set(&change, COL_LEASE_UNTIL, TimestampTzGetDatum(lease_until));
	change_set(&change, COL_EXPIRES_AT, TimestampTzGetDatum(expires_at));
	store_apply(PLAN_EXTEND, &row->tid, &change);
}

/* Delete the probed row (release, or a sweep of an expired key). */
void
idem_store_delete(const IdemRow *row)
{
	StoreChange change;

	memset(&change, 0, sizeof(change));
	store_apply(PLAN_DELETE, &row->tid, &change);
}

/*
 * Is the tuple at "tid" row-locked (no update) by our own transaction and
 * nobody else still running?  Then deleting it does not wait.
 */
static bool
store_locked_only_by_me(Relation heap, ItemPointer tid)
{
	Buffer		buf = ReadBuffer(heap, ItemPointerGetBlockNumber(tid));
	Page		page;
	OffsetNumber off = ItemPointerGetOffsetNumber(tid);
	bool		mine = false;

	LockBuffer(buf, BUFFER_LOCK_SHARE);
	page = BufferGetPage(buf);
	if (off >= FirstOffsetNumber && off <= PageGetMaxOffsetNumber(page) &&
		ItemIdIsNormal(PageGetItemId(page, off)))
	{
		HeapTupleHeader tup = (HeapTupleHeader)
			PageGetItem(page, PageGetItemId(page, off));

		mine = !(tup->t_infomask & HEAP_XMAX_INVALID) &&
			HEAP_XMAX_IS_LOCKED_ONLY(tup->t_infomask) &&
			!store_xmax_locks_other(tup->t_infomask,
									HeapTupleHeaderGetRawXmax(tup));
	}
	UnlockReleaseBuffer(buf);
	return mine;
}

/*
 * Delete the row versions at "tids" without the executor: heap_delete with
 * wait = false, so a row that another transaction changed or row-locked
 * since our re-read is skipped, never waited on (waiting could deadlock
 * with, say, an administrator's DELETE that is waiting for this sweep).  A
 * row locked only by our own transaction (a caller that locked its keys FOR
 * UPDATE before sweeping) is deleted anyway, which does not wait.  Only
 * used when store_direct_ok allows.  Returns how many rows it deleted.
 */
static int
store_sweep_delete_direct(Relation heap, ItemPointerData *tids, int n)
{
	CommandId	cid = GetCurrentCommandId(true);
	int			deleted = 0;

	CheckCmdReplicaIdentity(heap, CMD_DELETE);
	for (int i = 0; i < n; i++)
	{
		TM_FailureData tmfd;
		TM_Result	result;

		CHECK_FOR_INTERRUPTS();
		result = table_tuple_delete(heap, &tids[i], cid, InvalidSnapshot,
									InvalidSnapshot, false, &tmfd, false);
		if (result == TM_BeingModified &&
			store_locked_only_by_me(heap, &tids[i]))
			result = table_tuple_delete(heap, &tids[i], cid, InvalidSnapshot,
										InvalidSnapshot, true, &tmfd, false);
		if (result == TM_Ok)
			deleted++;
	}
	return deleted;
}

/*
 * Apply one kind of sweep work to the rows at "tids" (all locked by the
 * caller and probed at exactly these versions): delete them, reset them
 * (their tokens die), or move their sweep_at to when they are due.  One
 * statement for the whole chunk, or direct deletes (see above).  Returns
 * how many rows it changed.
 */
int
idem_store_sweep_apply(IdemSweepWork work, ItemPointerData *tids, int n,
					   TimestampTz now)
{
	static const StorePlan work_plans[] = {
		[IDEM_SWEEP_DELETE] = PLAN_SWEEP_DELETE,
		[IDEM_SWEEP_RESET] = PLAN_SWEEP_RESET,
		[IDEM_SWEEP_RESCHEDULE] = PLAN_SWEEP_RESCHEDULE,
	};
	Datum	   *elems;
	Datum		values[2];
	int			rc;

	if (n == 0)
		return 0;
	if (work == IDEM_SWEEP_DELETE)
	{
		Relation	heap = table_open(rels.keys, RowExclusiveLock);
		int			deleted = -1;

		if (store_direct_ok(heap))
			deleted = store_sweep_delete_direct(heap, tids, n);
		table_close(heap, NoLock);
		if (deleted >= 0)
			return deleted;
	}

	elems = palloc(sizeof(Datum) * n);
	for (int i = 0; i < n; i++)
		elems[i] = PointerGetDatum(&tids[i]);
	values[0] = PointerGetDatum(construct_array(elems, n, TIDOID,
												sizeof(ItemPointerData),
												false, TYPALIGN_SHORT));
	values[1] = TimestampTzGetDatum(now);
	rc = store_execute(store_plan(work_plans[work]), values, NULL);
	if (rc != (work == IDEM_SWEEP_DELETE ? SPI_OK_DELETE : SPI_OK_UPDATE))
		elog(ERROR, "idempotency sweep statement failed: %s",
			 SPI_result_code_string(rc));
	return (int) SPI_processed;
}

/*
 * Up to "limit" keys the sweeper may have work on at "now", oldest first:
 * a direct scan of keys_sweep_at_idx (no executor, no tuple copies beyond
 * the scope and key), through the snapshot a statement would get now, so
 * that each fetch sees this sweep's earlier writes.  The arrays and texts
 * are allocated in the current memory context.  Returns how many.
 */
int
idem_store_sweep_candidates(TimestampTz now, int limit,
							ItemPointerData **tids, text ***scopes,
							text ***keys)
{
	Relation	heap;
	Relation	index;
	ScanKeyData skey;
	IndexScanDesc scan;
	TupleTableSlot *slot;
	int			n = 0;
	int			alloc = Min(limit, 256);

	store_lookup_rels();
	*tids = palloc(sizeof(ItemPointerData) * alloc);
	*scopes = palloc(sizeof(text *) * alloc);
	*keys = palloc(sizeof(text *) * alloc);

	heap = table_open(rels.keys, AccessShareLock);
	index = index_open(rels.sweep_idx, AccessShareLock);
	CommandCounterIncrement();
	PushCopiedSnapshot(GetTransactionSnapshot());
	UpdateActiveSnapshotCommandId();

	ScanKeyInit(&skey, 1, BTLessEqualStrategyNumber, F_TIMESTAMPTZ_LE,
				TimestampTzGetDatum(now));
	slot = table_slot_create(heap, NULL);
	scan = index_beginscan(heap, index, GetActiveSnapshot(), 1, 0);
	index_rescan(scan, &skey, 1, NULL, 0);
	while (n < limit && index_getnext_slot(scan, ForwardScanDirection, slot))
	{
		/* A backlog can be millions of keys: stay cancellable. */
		CHECK_FOR_INTERRUPTS();
		if (n == alloc)
		{
			alloc = Min((int64) alloc * 2, (int64) limit);
			*tids = repalloc(*tids, sizeof(ItemPointerData) * alloc);
			*scopes = repalloc(*scopes, sizeof(text *) * alloc);
			*keys = repalloc(*keys, sizeof(text *) * alloc);
		}
		slot_getsomeattrs(slot, COL_KEY);
		(*tids)[n] = slot->tts_tid;
		(*scopes)[n] = DatumGetTextPCopy(slot->tts_values[COL_SCOPE - 1]);
		(*keys)[n] = DatumGetTextPCopy(slot->tts_values[COL_KEY - 1]);
		n++;
	}
	index_endscan(scan);
	ExecDropSingleTupleTableSlot(slot);
	PopActiveSnapshot();
	index_close(index, NoLock);
	table_close(heap, NoLock);
	return n;
}
