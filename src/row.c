/*-------------------------------------------------------------------------
 *
 * row.c
 *	  Reading idempotency.keys: one key by its primary key, or by ctid.
 *
 * Owns the probe, a direct primary-key index scan that reads one key either
 * at its newest state (a dirty snapshot, which also reports whether another
 * transaction is changing the row right now) or through the caller's MVCC
 * snapshot; the fetch of one row version by ctid for the sweeper; the
 * sweep's scan of keys_sweep_at_idx; the key counts of the stats view;
 * and decoding a stored row into an IdemRow (a row the functions never
 * write is refused with XX001).  Never waits on another transaction and
 * never writes.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <math.h>

#include "access/genam.h"
#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/multixact.h"
#include "access/stratnum.h"
#include "access/table.h"
#include "access/xact.h"
#include "catalog/pg_statistic.h"
#include "executor/executor.h"
#include "miscadmin.h"
#include "storage/bufmgr.h"
#include "storage/procarray.h"
#include "utils/builtins.h"
#include "utils/datum.h"
#include "utils/fmgroids.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"

#include "compat.h"
#include "args.h"
#include "store.h"

const char *const idem_status_names[IDEM_NSTATUS] = {
	[IDEM_PENDING] = "pending",
	[IDEM_SUCCEEDED] = "succeeded",
	[IDEM_FAILED] = "failed",
};

/*
 * Set *status to the status named by the "len" bytes at "name"; false if
 * none.
 */
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

/* Name a key in messages: "key" or "key" in scope "scope". */
char *
idem_key_display(text *scope, text *key)
{
	if (VARSIZE_ANY_EXHDR(scope) == 0)
		return psprintf("\"%s\"", text_to_cstring(key));
	return psprintf("\"%s\" in scope \"%s\"", text_to_cstring(key),
					text_to_cstring(scope));
}

/*
 * Raise XX001 unless every column declared NOT NULL has a value in the
 * row in "slot" (all attributes fetched).  The catalog refuses a table
 * whose constraints were dropped, so only a damaged page gets here; the
 * decoders below rely on the values and must never read a NULL datum.
 */
static void
row_check_not_null(TupleTableSlot *slot)
{
	bool	   *n = slot->tts_isnull;

	for (int i = 0; i < KEYS_NCOLS_1_0; i++)
	{
		if (!idem_keys_columns[i].not_null || !n[i])
			continue;
		ereport(ERROR,
				(errcode(ERRCODE_DATA_CORRUPTED),
				 errmsg("idempotency key %s has no value in column \"%s\"",
						(n[KEYS_COL_SCOPE - 1] || n[KEYS_COL_KEY - 1]) ? "(unknown)" :
						idem_key_display(DatumGetTextPP(slot->tts_values[KEYS_COL_SCOPE - 1]),
										 DatumGetTextPP(slot->tts_values[KEYS_COL_KEY - 1])),
						idem_keys_columns[i].name),
				 errhint("Someone changed idempotency.keys outside the extension's functions.")));
	}
}

/*
 * Decode the row in "slot" into *row; the stored payloads (response body,
 * phase, phase data) only when wanted.
 */
static void
row_decode(TupleTableSlot *slot, bool want_body, IdemRow *row)
{
	Datum	   *v;
	bool	   *n;
	text	   *status;

	slot_getallattrs(slot);
	row_check_not_null(slot);
	v = slot->tts_values;
	n = slot->tts_isnull;

	status = DatumGetTextPP(v[KEYS_COL_STATUS - 1]);
	if (!idem_status_parse(VARDATA_ANY(status), VARSIZE_ANY_EXHDR(status),
						   &row->status))
		ereport(ERROR,
				(errcode(ERRCODE_DATA_CORRUPTED),
				 errmsg("idempotency key has an unknown status \"%s\"",
						text_to_cstring(status)),
				 errhint("Someone changed idempotency.keys outside the extension's functions.")));
	row->has_token = !n[KEYS_COL_TOKEN - 1];
	row->token = row->has_token ? DatumGetInt64(v[KEYS_COL_TOKEN - 1]) : 0;
	row->attempt = DatumGetInt32(v[KEYS_COL_ATTEMPT - 1]);
	row->has_fingerprint = !n[KEYS_COL_FINGERPRINT - 1];
	if (row->has_fingerprint)
	{
		bytea	   *fp = DatumGetByteaPP(v[KEYS_COL_FINGERPRINT - 1]);

		if (VARSIZE_ANY_EXHDR(fp) != IDEM_FINGERPRINT_LEN)
			ereport(ERROR,
					(errcode(ERRCODE_DATA_CORRUPTED),
					 errmsg("idempotency key has a fingerprint of %d bytes, expected %d",
							(int) VARSIZE_ANY_EXHDR(fp), IDEM_FINGERPRINT_LEN),
					 errhint("Someone changed idempotency.keys outside the extension's functions.")));
		memcpy(row->fingerprint, VARDATA_ANY(fp), IDEM_FINGERPRINT_LEN);
	}
	row->has_response_code = !n[KEYS_COL_RESPONSE_CODE - 1];
	row->response_code = row->has_response_code ?
		DatumGetInt32(v[KEYS_COL_RESPONSE_CODE - 1]) : 0;
	/* Keep the body as stored (possibly a TOAST pointer): cheap to copy. */
	row->response_body = (want_body && !n[KEYS_COL_RESPONSE_BODY - 1]) ?
		datumCopy(v[KEYS_COL_RESPONSE_BODY - 1], false, -1) : (Datum) 0;
	row->created_at = DatumGetTimestampTz(v[KEYS_COL_CREATED_AT - 1]);
	row->has_finished_at = !n[KEYS_COL_FINISHED_AT - 1];
	row->finished_at = row->has_finished_at ?
		DatumGetTimestampTz(v[KEYS_COL_FINISHED_AT - 1]) : 0;
	row->has_lease_until = !n[KEYS_COL_LEASE_UNTIL - 1];
	row->lease_until = row->has_lease_until ?
		DatumGetTimestampTz(v[KEYS_COL_LEASE_UNTIL - 1]) : 0;
	row->expires_at = DatumGetTimestampTz(v[KEYS_COL_EXPIRES_AT - 1]);
	row->sweep_at = DatumGetTimestampTz(v[KEYS_COL_SWEEP_AT - 1]);
	memcpy(&row->retention, DatumGetIntervalP(v[KEYS_COL_RETENTION - 1]),
		   sizeof(Interval));
	if (slot->tts_tupleDescriptor->natts >= KEYS_COL_OWNER_SESSION)
	{
		row->phase = (want_body && !n[KEYS_COL_PHASE - 1]) ?
			PointerGetDatum(DatumGetTextPCopy(v[KEYS_COL_PHASE - 1])) : (Datum) 0;
		row->phase_data = (want_body && !n[KEYS_COL_PHASE_DATA - 1]) ?
			datumCopy(v[KEYS_COL_PHASE_DATA - 1], false, -1) : (Datum) 0;
		row->has_owner_session = !n[KEYS_COL_OWNER_SESSION - 1];
		row->owner_session = row->has_owner_session ?
			DatumGetInt64(v[KEYS_COL_OWNER_SESSION - 1]) : 0;
	}
	if (slot->tts_tupleDescriptor->natts >= KEYS_COL_REMEMBER)
	{
		row->has_remember = !n[KEYS_COL_REMEMBER - 1];
		if (row->has_remember)
			memcpy(&row->remember, DatumGetIntervalP(v[KEYS_COL_REMEMBER - 1]),
				   sizeof(Interval));
	}
	if (slot->tts_tupleDescriptor->natts >= KEYS_COL_REQUEST)
		row->request = (want_body && !n[KEYS_COL_REQUEST - 1]) ?
			datumCopy(v[KEYS_COL_REQUEST - 1], false, -1) : (Datum) 0;
}

/*
 * When the compact record of a finished key goes: its retention's end plus
 * its remember.  False for a key that is not remembered (pending, or
 * finished without remember).
 */
bool
idem_row_remembered_until(const IdemRow *row, TimestampTz *until)
{
	if (!row->found || row->status == IDEM_PENDING || !row->has_remember)
		return false;
	*until = idem_add_interval(row->expires_at, (Interval *) &row->remember);
	return true;
}

/*
 * Is the key remembered at "now": finished, past its retention, and not
 * past its remember?  Such a key is never run again; a claim answers
 * expired (or mismatch), whether or not a sweep has compacted it yet.
 */
bool
idem_row_remembered(const IdemRow *row, TimestampTz now)
{
	TimestampTz until;

	return row->expires_at <= now &&
		idem_row_remembered_until(row, &until) && until > now;
}

/*
 * Does a tuple header with this infomask and raw xmax say that another
 * transaction, still running, holds a row lock on it (FOR UPDATE / SHARE,
 * no update)?  A dirty snapshot shows such a tuple as plainly visible, but
 * writing it would wait for the locker.
 */
bool
idem_row_xmax_locks_other(uint16 infomask, TransactionId xmax)
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
row_read_xmax(TupleTableSlot *slot, uint16 *infomask, TransactionId *xmax)
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
row_locked_by_other(TupleTableSlot *slot)
{
	uint16		infomask;
	TransactionId xmax;

	row_read_xmax(slot, &infomask, &xmax);
	return idem_row_xmax_locks_other(infomask, xmax);
}

/* Record the probed tuple version in *row. */
static void
row_take(TupleTableSlot *slot, bool want_body, IdemRow *row)
{
	HeapTuple	tuple;
	bool		should_free;

	tuple = ExecFetchSlotHeapTuple(slot, false, &should_free);
	row->found = true;
	row->locked = row_locked_by_other(slot);
	row->tid = tuple->t_self;
	row->xmin = HeapTupleHeaderGetXmin(tuple->t_data);
	row->mine = TransactionIdIsCurrentTransactionId(row->xmin);
	row_decode(slot, want_body, row);
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
row_note_busy(TupleTableSlot *slot, Snapshot dirty, IdemRow *row)
{
	row->busy = true;
	if (TransactionIdIsValid(dirty->xmin))
	{
		uint16		infomask;
		TransactionId xmax;
		bool		isnull;
		Datum		token;

		row_read_xmax(slot, &infomask, &xmax);
		row->busy_xid = dirty->xmin;
		if (!(infomask & HEAP_XMAX_INVALID) && !HEAP_XMAX_IS_LOCKED_ONLY(infomask))
			return;				/* changed again by the same transaction */
		token = slot_getattr(slot, KEYS_COL_TOKEN, &isnull);
		row->busy_new = true;
		row->busy_token = isnull ? 0 : DatumGetInt64(token);
	}
	else
	{
		/*
		 * The committed version another transaction is changing: whose token
		 * it holds tells a token holder whether its token was dead already,
		 * whatever that change turns out to be.
		 */
		bool		isnull;
		Datum		d;

		if (!TransactionIdIsValid(row->busy_xid))
			row->busy_xid = dirty->xmax;
		d = slot_getattr(slot, KEYS_COL_STATUS, &isnull);
		if (!isnull &&
			idem_status_parse(VARDATA_ANY(DatumGetTextPP(d)),
							  VARSIZE_ANY_EXHDR(DatumGetTextPP(d)),
							  &row->busy_old_status))
		{
			d = slot_getattr(slot, KEYS_COL_TOKEN, &isnull);
			row->busy_old = true;
			row->busy_old_has_token = !isnull;
			row->busy_old_token = isnull ? 0 : DatumGetInt64(d);
			d = slot_getattr(slot, KEYS_COL_ATTEMPT, &isnull);
			row->busy_old_attempt = isnull ? 0 : DatumGetInt32(d);
			d = slot_getattr(slot, KEYS_COL_EXPIRES_AT, &isnull);
			row->busy_old_expires_at = isnull ? 0 : DatumGetTimestampTz(d);
		}
	}
}

/* Are two texts the same bytes, as the "C" collation compares them? */
static bool
row_text_equal(text *a, text *b)
{
	return VARSIZE_ANY_EXHDR(a) == VARSIZE_ANY_EXHDR(b) &&
		memcmp(VARDATA_ANY(a), VARDATA_ANY(b), VARSIZE_ANY_EXHDR(a)) == 0;
}

/* Does the row in "slot" hold (scope, key)? */
static bool
row_is_key(TupleTableSlot *slot, text *scope, text *key)
{
	return row_text_equal(DatumGetTextPP(slot->tts_values[KEYS_COL_SCOPE - 1]), scope) &&
		row_text_equal(DatumGetTextPP(slot->tts_values[KEYS_COL_KEY - 1]), key);
}

/*
 * Where this backend last wrote a key: the table (its OID and file, which a
 * rewrite changes), the row version's ctid and the key.  A claim and its
 * finish usually run on the same connection, so the finish's probe reads
 * that version first and descends the primary key only when it is not the
 * key's live, newest version.  Keys too long for the buffer leave no hint.
 */
#define ROW_HINT_BYTES 512

static struct
{
	bool		valid;
	Oid			relid;
	Oid			relfilenode;
	ItemPointerData tid;
	int			scope_len;
	int			key_len;
	char		data[ROW_HINT_BYTES];
}			row_hint;

/*
 * Remember that this backend wrote the version "tid" of (scope, key) in
 * "heap" (direct.c, after each insert and update).  "scope" and "key" are
 * the row's column values as stored.
 */
void
idem_row_hint_set(Relation heap, ItemPointer tid, Datum scope, Datum key)
{
	struct varlena *s = (struct varlena *) DatumGetPointer(scope);
	struct varlena *k = (struct varlena *) DatumGetPointer(key);

	row_hint.valid = false;
	if (VARATT_IS_EXTENDED(s) && !VARATT_IS_SHORT(s))
		return;
	if (VARATT_IS_EXTENDED(k) && !VARATT_IS_SHORT(k))
		return;
	if (VARSIZE_ANY_EXHDR(s) + VARSIZE_ANY_EXHDR(k) > ROW_HINT_BYTES)
		return;
	row_hint.relid = RelationGetRelid(heap);
	row_hint.relfilenode = heap->rd_rel->relfilenode;
	row_hint.tid = *tid;
	row_hint.scope_len = VARSIZE_ANY_EXHDR(s);
	row_hint.key_len = VARSIZE_ANY_EXHDR(k);
	memcpy(row_hint.data, VARDATA_ANY(s), row_hint.scope_len);
	memcpy(row_hint.data + row_hint.scope_len, VARDATA_ANY(k),
		   row_hint.key_len);
	row_hint.valid = true;
}

/*
 * Probe (scope, key) at its newest state through the hint alone, when the
 * hint names this key in "heap" as it is now: true, with *row taken, when
 * the hinted version is the key's live, newest version, which no other
 * transaction is changing.  Any other answer (the version was updated,
 * deleted, pruned, truncated away, or is being changed) is left to the
 * index probe, which alone can tell which version is newest then.
 *
 * A visible version with no transaction in flight on it is the key's one
 * live version: the primary key admits no second one, and the version
 * that replaces it makes this one invisible.  That is the version the
 * index probe would take, with the same result.
 */
static bool
row_probe_hinted(Relation heap, text *scope, text *key, bool want_body,
				 IdemRow *row)
{
	SnapshotData dirty;
	TupleTableSlot *slot;
	ItemPointerData tid;
	Buffer		buffer;
	bool		taken = false;

	if (!row_hint.valid || row_hint.relid != RelationGetRelid(heap) ||
		row_hint.relfilenode != heap->rd_rel->relfilenode ||
		row_hint.scope_len != VARSIZE_ANY_EXHDR(scope) ||
		row_hint.key_len != VARSIZE_ANY_EXHDR(key) ||
		memcmp(row_hint.data, VARDATA_ANY(scope), row_hint.scope_len) != 0 ||
		memcmp(row_hint.data + row_hint.scope_len, VARDATA_ANY(key),
			   row_hint.key_len) != 0)
		return false;
	/* a VACUUM may have cut the table's empty end off since */
	tid = row_hint.tid;
	if (ItemPointerGetBlockNumber(&tid) >= RelationGetNumberOfBlocks(heap))
		return false;

	/* The row version is known; the heap is not read yet. */
	IDEM_PAUSE("probe-index-read");

	/*
	 * Prune the page first, as an index fetch does: the key's dead versions
	 * hold room that a finish's HOT update needs on this page.
	 */
	buffer = ReadBuffer(heap, ItemPointerGetBlockNumber(&tid));
	heap_page_prune_opt(heap, buffer);
	InitDirtySnapshot(dirty);
	slot = table_slot_create(heap, NULL);
	if (table_tuple_fetch_row_version(heap, &tid, &dirty, slot) &&
		!TransactionIdIsValid(dirty.xmin) &&
		!TransactionIdIsValid(dirty.xmax))
	{
		slot_getsomeattrs(slot, KEYS_COL_KEY);
		if (row_is_key(slot, scope, key))
		{
			row_take(slot, want_body, row);
			taken = true;
			IDEM_PAUSE("probe-version-read");
		}
	}
	ExecDropSingleTupleTableSlot(slot);
	ReleaseBuffer(buffer);
	return taken;
}

/* One scan of the key's primary-key entries (idem_row_probe). */
static void
row_probe_once(text *scope, text *key, IdemProbeMode mode, bool want_body,
			   IdemRow *row)
{
	const IdemCatalog *catalog;
	Relation	heap;
	Relation	index;
	SnapshotData dirty;
	Snapshot	snapshot;
	ScanKeyData skey[2];
	IndexScanDesc scan;
	TupleTableSlot *slot;

	memset(row, 0, sizeof(IdemRow));
	catalog = idem_catalog();
	heap = table_open(catalog->keys, AccessShareLock);
	if (mode == IDEM_PROBE_LATEST &&
		row_probe_hinted(heap, scope, key, want_body, row))
	{
		table_close(heap, NoLock);
		return;
	}
	index = index_open(catalog->pkey, AccessShareLock);

	if (mode == IDEM_PROBE_LATEST)
	{
		InitDirtySnapshot(dirty);
		snapshot = &dirty;
	}
	else
		snapshot = GetActiveSnapshot();

	/* ScanKeyInit compares with the "C" collation, as the columns do. */
	ScanKeyInit(&skey[0], KEYS_COL_SCOPE, BTEqualStrategyNumber, F_TEXTEQ,
				PointerGetDatum(scope));
	ScanKeyInit(&skey[1], KEYS_COL_KEY, BTEqualStrategyNumber, F_TEXTEQ,
				PointerGetDatum(key));

	/* made at the first entry found: a new key's probe finds none */
	slot = NULL;
	scan = idem_index_beginscan(heap, index, snapshot, 2, 0);
	index_rescan(scan, skey, 2, NULL, 0);
	/* index_getnext_slot, spelled out to put a pause point in the middle */
	while (scan->xs_heap_continue ||
		   index_getnext_tid(scan, ForwardScanDirection) != NULL)
	{
		/* The index page is read; the heap is not yet. */
		IDEM_PAUSE("probe-index-read");
		if (slot == NULL)
			slot = table_slot_create(heap, NULL);
		if (!index_fetch_heap(scan, slot))
			continue;
		if (mode == IDEM_PROBE_SNAPSHOT)
		{
			HeapTuple	tuple;
			bool		should_free;

			tuple = ExecFetchSlotHeapTuple(slot, false, &should_free);
			row->found = true;
			row->tid = tuple->t_self;
			row_decode(slot, want_body, row);
			if (should_free)
				heap_freetuple(tuple);
		}
		else if (TransactionIdIsValid(dirty.xmin) ||
				 TransactionIdIsValid(dirty.xmax))
			row_note_busy(slot, &dirty, row);
		else
			row_take(slot, want_body, row);
		/* One version is judged; the next is not read yet. */
		IDEM_PAUSE("probe-version-read");
	}
	index_endscan(scan);
	if (slot != NULL)
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
idem_row_probe(text *scope, text *key, IdemProbeMode mode, bool want_body,
			   IdemRow *row)
{
	row_probe_once(scope, key, mode, want_body, row);
	if (row->busy && !TransactionIdIsInProgress(row->busy_xid))
		row_probe_once(scope, key, mode, want_body, row);
}

/*
 * Read the row version at "tid" with a dirty snapshot, as a probe would,
 * but without the index descent (the sweeper got the tid from its query).
 * found is false when that version is gone (a committed update or delete
 * replaced it) or holds another key.  The relation and slot come from
 * idem_row_fetch_begin, so that a chunk of fetches shares them.
 */
void
idem_row_fetch(IdemFetch *fetch, ItemPointer tid, text *scope, text *key,
			   IdemRow *row)
{
	SnapshotData dirty;

	memset(row, 0, sizeof(IdemRow));
	InitDirtySnapshot(dirty);
	if (table_tuple_fetch_row_version(fetch->heap, tid, &dirty, fetch->slot))
	{
		if (TransactionIdIsValid(dirty.xmin) ||
			TransactionIdIsValid(dirty.xmax))
			row_note_busy(fetch->slot, &dirty, row);
		else
		{
			row_take(fetch->slot, false, row);
			if (!row_is_key(fetch->slot, scope, key))
				row->found = false;
		}
		ExecClearTuple(fetch->slot);
	}
}

/* Open the table for a run of idem_row_fetch calls. */
void
idem_row_fetch_begin(IdemFetch *fetch)
{
	fetch->heap = table_open(idem_catalog()->keys, AccessShareLock);
	fetch->slot = table_slot_create(fetch->heap, NULL);
}

/* End a run of idem_row_fetch calls. */
void
idem_row_fetch_end(IdemFetch *fetch)
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
idem_row_check_snapshot(const IdemRow *row)
{
	if (!IsolationUsesXactSnapshot() || !row->found || row->mine)
		return;
	if (XidInMVCCSnapshot(row->xmin, GetTransactionSnapshot()))
		ereport(ERROR,
				(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
				 errmsg("could not serialize access due to concurrent update of an idempotency key"),
				 errhint("Retry the transaction.")));
}

/*
 * Is this row, as decoded, a key whose attempt was abandoned at "now":
 * pending, within its retention, and with no live owner (a sweep reset
 * it, its lease ended, or the session its claim was bound to ended)?
 */
bool
idem_row_abandoned(const IdemRow *row, TimestampTz now)
{
	return row->found && row->status == IDEM_PENDING &&
		row->expires_at > now &&
		(!row->has_token || row->lease_until <= now ||
		 (row->has_owner_session && !idem_session_alive(row->owner_session)));
}

/*
 * What a visitor of row_index_scan is given: the row (its columns up to
 * the scan's "lastcol" read), and its own state.  It returns false to end
 * the scan.
 */
typedef bool (*RowVisitor) (TupleTableSlot *slot, void *arg);

/*
 * Visit the rows of the index "indexid" that match "skey" (nkeys: 0 to 2),
 * in index order, at most "limit" of them: a direct index scan (no
 * executor, no tuple copies), through the snapshot a statement would get
 * now, so that each fetch sees this transaction's earlier writes.  Each
 * row's columns up to "lastcol" are read, and its scope and key checked
 * for a value.
 */
static void
row_index_scan(Oid indexid, ScanKey skey, int nkeys, int64 limit,
			   AttrNumber lastcol, RowVisitor visit, void *arg)
{
	const IdemCatalog *catalog;
	Relation	heap;
	Relation	index;
	IndexScanDesc scan;
	TupleTableSlot *slot;
	int64		seen = 0;

	catalog = idem_catalog();
	heap = table_open(catalog->keys, AccessShareLock);
	index = index_open(indexid, AccessShareLock);
	CommandCounterIncrement();
	PushCopiedSnapshot(GetTransactionSnapshot());
	UpdateActiveSnapshotCommandId();

	slot = table_slot_create(heap, NULL);
	scan = idem_index_beginscan(heap, index, GetActiveSnapshot(), nkeys, 0);
	index_rescan(scan, skey, nkeys, NULL, 0);
	while (seen++ < limit && index_getnext_slot(scan, ForwardScanDirection, slot))
	{
		/* A backlog can be millions of keys: stay cancellable. */
		CHECK_FOR_INTERRUPTS();
		slot_getsomeattrs(slot, lastcol);
		if (slot->tts_isnull[KEYS_COL_SCOPE - 1] || slot->tts_isnull[KEYS_COL_KEY - 1])
			ereport(ERROR,
					(errcode(ERRCODE_DATA_CORRUPTED),
					 errmsg("an idempotency key has no value in column \"%s\"",
							slot->tts_isnull[KEYS_COL_SCOPE - 1] ? "scope" : "key"),
					 errhint("Someone changed idempotency.keys outside the extension's functions.")));
		if (!visit(slot, arg))
			break;
	}
	index_endscan(scan);
	ExecDropSingleTupleTableSlot(slot);
	PopActiveSnapshot();
	index_close(index, NoLock);
	table_close(heap, NoLock);
}

/* The candidates row_index_candidates collects. */
typedef struct CandidateList
{
	int			n;
	int			alloc;
	int			limit;
	ItemPointerData *tids;
	text	  **scopes;
	text	  **keys;
	int64	   *sessions;		/* or NULL */
} CandidateList;

static bool
candidate_add(TupleTableSlot *slot, void *arg)
{
	CandidateList *list = (CandidateList *) arg;

	if (list->n == list->alloc)
	{
		list->alloc = Min((int64) list->alloc * 2, (int64) list->limit);
		list->tids = repalloc(list->tids, sizeof(ItemPointerData) * list->alloc);
		list->scopes = repalloc(list->scopes, sizeof(text *) * list->alloc);
		list->keys = repalloc(list->keys, sizeof(text *) * list->alloc);
		if (list->sessions)
			list->sessions = repalloc(list->sessions, sizeof(int64) * list->alloc);
	}
	list->tids[list->n] = slot->tts_tid;
	list->scopes[list->n] = DatumGetTextPCopy(slot->tts_values[KEYS_COL_SCOPE - 1]);
	list->keys[list->n] = DatumGetTextPCopy(slot->tts_values[KEYS_COL_KEY - 1]);
	if (list->sessions)
		list->sessions[list->n] = slot->tts_isnull[KEYS_COL_OWNER_SESSION - 1] ? 0 :
			DatumGetInt64(slot->tts_values[KEYS_COL_OWNER_SESSION - 1]);
	list->n++;
	return true;
}

/*
 * Up to "limit" rows of the index "indexid" that match "skey" (nkeys: 0 or
 * 1), in index order.  The arrays and texts are allocated in the current
 * memory context.  With "sessions", the owner_session of each row too (0
 * when NULL).  Returns how many.
 */
static int
row_index_candidates(Oid indexid, ScanKey skey, int nkeys, int limit,
					 ItemPointerData **tids, text ***scopes, text ***keys,
					 int64 **sessions)
{
	CandidateList list;

	list.n = 0;
	list.limit = limit;
	list.alloc = Min(limit, 256);
	list.tids = palloc(sizeof(ItemPointerData) * list.alloc);
	list.scopes = palloc(sizeof(text *) * list.alloc);
	list.keys = palloc(sizeof(text *) * list.alloc);
	list.sessions = sessions ? palloc(sizeof(int64) * list.alloc) : NULL;
	row_index_scan(indexid, skey, nkeys, limit,
				   sessions ? KEYS_COL_OWNER_SESSION : KEYS_COL_KEY,
				   candidate_add, &list);
	*tids = list.tids;
	*scopes = list.scopes;
	*keys = list.keys;
	if (sessions)
		*sessions = list.sessions;
	return list.n;
}

/*
 * Up to "limit" keys the sweeper may have work on at "now", oldest first:
 * a scan of keys_sweep_at_idx up to "now".
 */
int
idem_row_sweep_candidates(TimestampTz now, int limit,
						  ItemPointerData **tids, text ***scopes,
						  text ***keys)
{
	ScanKeyData skey;

	ScanKeyInit(&skey, 1, BTLessEqualStrategyNumber, F_TIMESTAMPTZ_LE,
				TimestampTzGetDatum(now));
	return row_index_candidates(idem_catalog()->sweep_idx, &skey, 1, limit,
								tids, scopes, keys, NULL);
}

/*
 * Up to "limit" keys bound to a session numbered above "after"
 * (keys_owner_session_idx holds the session-bound claims still pending), in
 * session order, with the session of each.  None before extension version
 * 1.4.
 */
int
idem_row_session_candidates(int64 after, int limit, ItemPointerData **tids,
							text ***scopes, text ***keys, int64 **sessions)
{
	const IdemCatalog *catalog = idem_catalog();
	ScanKeyData skey;

	if (!OidIsValid(catalog->session_idx))
	{
		*tids = NULL;
		*scopes = *keys = NULL;
		*sessions = NULL;
		return 0;
	}
	ScanKeyInit(&skey, 1, BTGreaterStrategyNumber, F_INT8GT,
				Int64GetDatum(after));
	return row_index_candidates(catalog->session_idx, &skey, 1, limit,
								tids, scopes, keys, sessions);
}

/*
 * How many index entries idem_row_abandoned_candidates reads in the
 * indexes shared by all scopes, per key it may return: a bound on what one
 * call costs behind a sweep backlog, where the keys it does not reach are
 * found once a sweep has reset them.
 */
#define ABANDONED_SCAN_FACTOR	16
#define ABANDONED_SCAN_MIN		1024

/*
 * The ways a key is abandoned, one per index that finds it, so that no
 * key is found twice: a sweep reset it (its token is NULL), its lease
 * ended, or, under a running lease, its session-bound owner's session
 * ended.
 */
typedef enum AbandonedWay
{
	ABANDONED_RESET,
	ABANDONED_LEASE_ENDED,
	ABANDONED_SESSION_ENDED
} AbandonedWay;

/* The candidates idem_row_abandoned_candidates collects. */
typedef struct AbandonedList
{
	text	   *scope;
	TimestampTz now;
	AbandonedWay way;			/* what the current index scan looks for */
	int			n;
	int			limit;
	IdemAbandoned *items;
} AbandonedList;

static bool
abandoned_add(TupleTableSlot *slot, void *arg)
{
	AbandonedList *list = (AbandonedList *) arg;
	text	   *scope = DatumGetTextPP(slot->tts_values[KEYS_COL_SCOPE - 1]);
	IdemRow		row;

	if (!row_text_equal(scope, list->scope))
		return true;
	memset(&row, 0, sizeof(row));
	row.found = true;
	row_decode(slot, false, &row);
	if (!idem_row_abandoned(&row, list->now))
		return true;
	switch (list->way)
	{
		case ABANDONED_RESET:
			if (row.has_token)
				return true;
			break;
		case ABANDONED_LEASE_ENDED:
			if (!row.has_token || row.lease_until > list->now)
				return true;
			break;
		case ABANDONED_SESSION_ENDED:
			if (!row.has_token || row.lease_until <= list->now)
				return true;
			break;
	}
	list->items[list->n].tid = slot->tts_tid;
	list->items[list->n].key =
		DatumGetTextPCopy(slot->tts_values[KEYS_COL_KEY - 1]);
	list->items[list->n].created_at = row.created_at;
	return ++list->n < list->limit;
}

static int
abandoned_cmp(const void *a, const void *b)
{
	const IdemAbandoned *x = (const IdemAbandoned *) a;
	const IdemAbandoned *y = (const IdemAbandoned *) b;
	int			cmp;

	if (x->created_at != y->created_at)
		return x->created_at < y->created_at ? -1 : 1;
	cmp = memcmp(VARDATA_ANY(x->key), VARDATA_ANY(y->key),
				 Min(VARSIZE_ANY_EXHDR(x->key), VARSIZE_ANY_EXHDR(y->key)));
	if (cmp != 0)
		return cmp;
	return (int) VARSIZE_ANY_EXHDR(x->key) - (int) VARSIZE_ANY_EXHDR(y->key);
}

/*
 * Up to "limit" keys of "scope" that look abandoned at "now" (as
 * idem_row_abandoned judges them; the caller judges each again under its
 * lock), oldest first (by when their first attempt claimed them).  Three
 * places hold them: keys_abandoned_idx, the keys a sweep reset, of this
 * scope only, oldest first; keys_sweep_at_idx up to
 * "now", where a pending key whose lease ended stays until a sweep visits
 * it; keys_owner_session_idx, the pending session-bound keys, whose
 * owner's session may have ended.  The last two are shared by every scope,
 * so only the first ABANDONED_SCAN_FACTOR entries per key (at least
 * ABANDONED_SCAN_MIN) of each are read.
 */
int
idem_row_abandoned_candidates(text *scope, TimestampTz now, int limit,
							  IdemAbandoned **found)
{
	const IdemCatalog *catalog = idem_catalog();
	int64		cap = Max((int64) limit * ABANDONED_SCAN_FACTOR,
						  ABANDONED_SCAN_MIN);
	AbandonedList list;
	ScanKeyData skey;

	list.scope = scope;
	list.now = now;
	list.way = ABANDONED_RESET;
	list.n = 0;
	list.limit = limit;
	list.items = palloc(sizeof(IdemAbandoned) * limit);

	if (OidIsValid(catalog->abandoned_idx))
	{
		ScanKeyInit(&skey, 1, BTEqualStrategyNumber, F_TEXTEQ,
					PointerGetDatum(scope));
		row_index_scan(catalog->abandoned_idx, &skey, 1, PG_INT64_MAX,
					   catalog->ncols, abandoned_add, &list);
	}
	if (list.n < limit)
	{
		list.way = ABANDONED_LEASE_ENDED;
		ScanKeyInit(&skey, 1, BTLessEqualStrategyNumber, F_TIMESTAMPTZ_LE,
					TimestampTzGetDatum(now));
		row_index_scan(catalog->sweep_idx, &skey, 1, cap, catalog->ncols,
					   abandoned_add, &list);
	}
	if (list.n < limit && OidIsValid(catalog->session_idx))
	{
		list.way = ABANDONED_SESSION_ENDED;
		ScanKeyInit(&skey, 1, BTGreaterStrategyNumber, F_INT8GT,
					Int64GetDatum(0));
		row_index_scan(catalog->session_idx, &skey, 1, cap, catalog->ncols,
					   abandoned_add, &list);
	}
	qsort(list.items, list.n, sizeof(IdemAbandoned), abandoned_cmp);
	*found = list.items;
	return list.n;
}

/*
 * The share of the rows of "relid" whose timestamptz column "col" is at or
 * before "at", by the histogram ANALYZE recorded for it (0 without one):
 * the histogram's bounds split the non-null rows into equal parts.
 */
static double
row_share_before(Oid relid, AttrNumber col, TimestampTz at)
{
	HeapTuple	statstup;
	AttStatsSlot sslot;
	double		share = 0;

	statstup = SearchSysCache3(STATRELATTINH, ObjectIdGetDatum(relid),
							   Int16GetDatum(col), BoolGetDatum(false));
	if (!HeapTupleIsValid(statstup))
		return 0;
	if (get_attstatsslot(&sslot, statstup, STATISTIC_KIND_HISTOGRAM,
						 InvalidOid, ATTSTATSSLOT_VALUES))
	{
		int			below = 0;

		while (below < sslot.nvalues &&
			   DatumGetTimestampTz(sslot.values[below]) <= at)
			below++;
		if (sslot.nvalues > 1)
			share = (double) Max(below - 1, 0) / (sslot.nvalues - 1);
		if (below == sslot.nvalues)
			share = 1;
		free_attstatsslot(&sslot);
	}
	ReleaseSysCache(statstup);
	return share;
}

/*
 * Count the keys of each status, and the remembered keys
 * (counts[IDEM_COUNT_REMEMBERED]).  While the table has at most exact_limit
 * blocks (-1: whatever its size) the count is exact: a scan through the
 * active snapshot in which a key whose retention ended before now counts
 * only as remembered, if it is.  Above that a scan would make every poll of
 * the stats view read the whole table, so the counts are the planner's
 * estimate instead: the tuple density pg_class recorded at the last VACUUM
 * or ANALYZE, scaled to the table's current size, split by the share of
 * rows whose expires_at ANALYZE's histogram puts before now (past their
 * retention: counted as remembered, which on a swept table they are; 0
 * before 1.7), and the rest by each status's share among the most common
 * values ANALYZE recorded for the status column (a status its sample held
 * fewer than twice is not among them, and estimates as 0).  A table
 * too large to scan that was never analyzed (or was emptied by TRUNCATE
 * since its last VACUUM or ANALYZE, which resets pg_class's figures) has no
 * estimate.  A row with a status the functions never write, or with NULL
 * where the table says NOT NULL, is not counted: a monitoring query must
 * keep answering.
 */
IdemKeyCountSource
idem_row_count_keys(TimestampTz now, int exact_limit, int64 counts[IDEM_NCOUNTS])
{
	const IdemCatalog *catalog = idem_catalog();
	Relation	heap;
	BlockNumber nblocks;
	IdemKeyCountSource source;

	memset(counts, 0, sizeof(int64) * IDEM_NCOUNTS);
	heap = table_open(catalog->keys, AccessShareLock);
	nblocks = RelationGetNumberOfBlocks(heap);

	if (exact_limit < 0 || nblocks <= (BlockNumber) exact_limit)
	{
		TableScanDesc scan;
		TupleTableSlot *slot = table_slot_create(heap, NULL);

		scan = table_beginscan(heap, GetActiveSnapshot(), 0, NULL);
		while (table_scan_getnextslot(scan, ForwardScanDirection, slot))
		{
			text	   *status;
			IdemStatus	st;
			TimestampTz expires_at;

			CHECK_FOR_INTERRUPTS();
			slot_getsomeattrs(slot, KEYS_COL_EXPIRES_AT);
			/* NULLs only in a table someone altered: not a key, not counted */
			if (slot->tts_isnull[KEYS_COL_STATUS - 1] ||
				slot->tts_isnull[KEYS_COL_EXPIRES_AT - 1])
				continue;
			status = DatumGetTextPP(slot->tts_values[KEYS_COL_STATUS - 1]);
			if (!idem_status_parse(VARDATA_ANY(status), VARSIZE_ANY_EXHDR(status), &st))
				continue;
			expires_at = DatumGetTimestampTz(slot->tts_values[KEYS_COL_EXPIRES_AT - 1]);
			if (expires_at > now)
				counts[st]++;
			else if (st != IDEM_PENDING && catalog->ncols >= KEYS_COL_REMEMBER)
			{
				slot_getsomeattrs(slot, KEYS_COL_REMEMBER);
				if (!slot->tts_isnull[KEYS_COL_REMEMBER - 1] &&
					idem_add_interval(expires_at,
									  DatumGetIntervalP(slot->tts_values[KEYS_COL_REMEMBER - 1])) > now)
					counts[IDEM_COUNT_REMEMBERED]++;
			}
		}
		table_endscan(scan);
		ExecDropSingleTupleTableSlot(slot);
		source = IDEM_COUNT_EXACT;
	}
	else
	{
		double		reltuples = heap->rd_rel->reltuples;
		BlockNumber relpages = heap->rd_rel->relpages;
		HeapTuple	statstup;
		AttStatsSlot sslot;

		source = IDEM_COUNT_UNKNOWN;
		statstup = SearchSysCache3(STATRELATTINH,
								   ObjectIdGetDatum(catalog->keys),
								   Int16GetDatum(KEYS_COL_STATUS),
								   BoolGetDatum(false));
		/* reltuples is -1 until the first VACUUM or ANALYZE */
		if (HeapTupleIsValid(statstup) && reltuples >= 0 && relpages > 0)
		{
			double		total = reltuples / relpages * nblocks;
			double		past = catalog->ncols >= KEYS_COL_REMEMBER ?
				row_share_before(catalog->keys, KEYS_COL_EXPIRES_AT, now) : 0;

			counts[IDEM_COUNT_REMEMBERED] = (int64) rint(total * past);
			total -= total * past;

			if (get_attstatsslot(&sslot, statstup, STATISTIC_KIND_MCV, InvalidOid,
								 ATTSTATSSLOT_VALUES | ATTSTATSSLOT_NUMBERS))
			{
				for (int i = 0; i < sslot.nvalues; i++)
				{
					text	   *status = DatumGetTextPP(sslot.values[i]);
					IdemStatus	st;

					if (idem_status_parse(VARDATA_ANY(status),
										  VARSIZE_ANY_EXHDR(status), &st))
						counts[st] = (int64) rint(total * sslot.numbers[i]);
				}
				free_attstatsslot(&sslot);
			}
			source = IDEM_COUNT_ESTIMATE;
		}
		if (HeapTupleIsValid(statstup))
			ReleaseSysCache(statstup);
	}
	table_close(heap, AccessShareLock);
	return source;
}
