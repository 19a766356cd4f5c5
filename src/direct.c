/*-------------------------------------------------------------------------
 *
 * direct.c
 *	  Writing rows of idempotency.keys through the table AM, without SQL.
 *
 * Owns the direct writer: a row is formed here, checked against the
 * table's NOT NULL and CHECK constraints, written through the table AM and
 * entered into every index of the table it belongs in (a user's own index
 * too), the way logical replication applies rows.  This skips SPI and the
 * executor's per-statement start-up, which is most of the CPU time of a
 * one-row write.  Only for a table as the extension creates it, without
 * triggers, rules, row security or generated columns: idem_direct_begin
 * refuses any other, and write.c then runs the SQL statement, so that
 * whatever a user attached to the table still fires.  Must not decide
 * which row to write or with what: write.c's rules do.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "catalog/index.h"
#include "executor/executor.h"
#include "storage/bufmgr.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"

#include "compat.h"
#include "store.h"

/*
 * May the store write this table directly?  Not when a user attached
 * something only the executor applies: triggers (a foreign key that
 * references the table is one), rules, row security, stored generated
 * columns.
 */
static bool
direct_allowed(Relation heap)
{
	TupleConstr *constr = RelationGetDescr(heap)->constr;

	return heap->trigdesc == NULL && heap->rd_rules == NULL &&
		!heap->rd_rel->relrowsecurity &&
		(constr == NULL || !constr->has_generated_stored);
}

/*
 * Open the table for direct writes; false (nothing open) when the table is
 * not one we may write directly.
 */
bool
idem_direct_begin(IdemDirect *direct)
{
	const IdemCatalog *catalog = idem_catalog();
	Relation	heap = table_open(catalog->keys, RowExclusiveLock);
	MemoryContext old;

	if (!direct_allowed(heap))
	{
		table_close(heap, NoLock);
		return false;
	}

	/*
	 * Like SPI before each statement: rows written earlier in this command
	 * (say, by idem_sweep in the same SELECT) become visible to the write.
	 */
	CommandCounterIncrement();
	direct->heap = heap;
	direct->estate = CreateExecutorState();
	old = MemoryContextSwitchTo(direct->estate->es_query_cxt);
	direct->rri = makeNode(ResultRelInfo);
	InitResultRelInfo(direct->rri, heap, 0, NULL, 0);
	direct->nindexes = -1;
	direct->session_idx = catalog->session_idx;
	direct->abandoned_idx = catalog->abandoned_idx;
	direct->slot = ExecInitExtraTupleSlot(direct->estate,
										  RelationGetDescr(heap),
										  table_slot_callbacks(heap));
	direct->old = ExecInitExtraTupleSlot(direct->estate,
										 RelationGetDescr(heap),
										 table_slot_callbacks(heap));
	MemoryContextSwitchTo(old);
	return true;
}

/* Add the opened index "i" to the indexes the executor is handed. */
static void
direct_hand_index(IdemDirect *direct, int i)
{
	ResultRelInfo *rri = direct->rri;

	rri->ri_IndexRelationDescs[rri->ri_NumIndices] = direct->index_rels[i];
	rri->ri_IndexRelationInfo[rri->ri_NumIndices++] = direct->index_infos[i];
}

/*
 * End a run of direct writes; the next command sees them, as after a
 * statement.
 */
void
idem_direct_end(IdemDirect *direct)
{
	if (direct->nindexes > 0)
	{
		/* hand the executor the indexes opened, to close as its own */
		direct->rri->ri_NumIndices = 0;
		for (int i = 0; i < direct->nindexes; i++)
			if (direct->index_rels[i] != NULL)
				direct_hand_index(direct, i);
		ExecCloseIndices(direct->rri);
	}
	ExecResetTupleTable(direct->estate->es_tupleTable, false);
	FreeExecutorState(direct->estate);
	table_close(direct->heap, NoLock);
	CommandCounterIncrement();
}

/*
 * List the table's indexes, once per run of writes.  Each is opened (and
 * locked, as the executor would) at the first row that goes into it.
 */
static void
direct_list_indexes(IdemDirect *direct)
{
	MemoryContext old = MemoryContextSwitchTo(direct->estate->es_query_cxt);
	List	   *oids = RelationGetIndexList(direct->heap);
	int			n = Max(list_length(oids), 1);
	ListCell   *lc;

	direct->nindexes = 0;
	direct->index_oids = palloc(sizeof(Oid) * n);
	direct->index_rels = palloc0(sizeof(Relation) * n);
	direct->index_infos = palloc0(sizeof(IndexInfo *) * n);
	foreach(lc, oids)
		direct->index_oids[direct->nindexes++] = lfirst_oid(lc);
	direct->rri->ri_IndexRelationDescs = palloc(sizeof(Relation) * n);
	direct->rri->ri_IndexRelationInfo = palloc(sizeof(IndexInfo *) * n);
	list_free(oids);
	MemoryContextSwitchTo(old);
}

/*
 * Does the row in the slot go into the index "oid"?  Only the extension's
 * own partial indexes are judged here, by their predicates, which the
 * catalog checks are exactly these: keys_owner_session_idx holds the rows
 * with an owner_session, keys_abandoned_idx those without a token.  A
 * fresh claim is in neither, so its write neither opens them nor prepares
 * their predicates.  Every other index is the executor's to judge.
 */
static bool
direct_row_in_index(IdemDirect *direct, Oid oid)
{
	TupleTableSlot *slot = direct->slot;

	if (oid == direct->session_idx)
		return !slot->tts_isnull[KEYS_COL_OWNER_SESSION - 1];
	if (oid == direct->abandoned_idx)
		return slot->tts_isnull[KEYS_COL_TOKEN - 1];
	return true;
}

/*
 * Enter the row in the slot into the table's indexes after the table AM
 * wrote it (an update calls this only when it was not a HOT update): into
 * each index it belongs in, opened at the first row that needs it.  A run
 * of HOT updates (a finish, an extend) opens none, as the table AM decides
 * HOT from the table's relcache entry, which the table's lock keeps
 * current; an update that changes only what a summarizing index (BRIN)
 * covers opens the row's indexes and enters it into those alone.
 */
static void
direct_index(IdemDirect *direct, bool update, bool only_summarizing)
{
	ResultRelInfo *rri = direct->rri;

	if (direct->nindexes < 0)
		direct_list_indexes(direct);
	rri->ri_NumIndices = 0;
	for (int i = 0; i < direct->nindexes; i++)
	{
		if (!direct_row_in_index(direct, direct->index_oids[i]))
			continue;
		if (direct->index_rels[i] == NULL)
		{
			MemoryContext old = MemoryContextSwitchTo(direct->estate->es_query_cxt);

			direct->index_rels[i] = index_open(direct->index_oids[i],
											   RowExclusiveLock);
			direct->index_infos[i] = BuildIndexInfo(direct->index_rels[i]);
			MemoryContextSwitchTo(old);
		}
		direct_hand_index(direct, i);
	}
	if (rri->ri_NumIndices > 0)
		list_free(idem_insert_index_tuples(rri, direct->slot, direct->estate,
										   update, only_summarizing));
}

/* Check the row in the slot against the table's constraints. */
static void
direct_check(IdemDirect *direct)
{
	if (RelationGetDescr(direct->heap)->constr != NULL)
		ExecConstraints(direct->rri, direct->slot, direct->estate);
}

/*
 * Is the tuple at "tid" row-locked (no update) by our own transaction and
 * nobody else still running?  Then writing it does not wait.
 */
static bool
direct_locked_only_by_me(Relation heap, ItemPointer tid)
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
			!idem_row_xmax_locks_other(tup->t_infomask,
									   HeapTupleHeaderGetRawXmax(tup));
	}
	UnlockReleaseBuffer(buf);
	return mine;
}

/*
 * What a table AM write result means for the caller.  Without "wait", a
 * row that another transaction changes or row-locks is reported busy, not
 * waited on; one row-locked only by our own transaction is written anyway
 * (the caller retries with wait, which then does not wait).
 */
static IdemDirectResult
direct_result(TM_Result result, const char *what)
{
	switch (result)
	{
		case TM_Ok:
			return IDEM_DIRECT_DONE;
		case TM_Updated:
		case TM_Deleted:
			return IDEM_DIRECT_GONE;
		case TM_BeingModified:
		case TM_WouldBlock:
			return IDEM_DIRECT_BUSY;
		default:
			elog(ERROR, "unexpected result %d %s an idempotency key",
				 (int) result, what);
	}
	pg_unreachable();
}

/*
 * Tell the probe where the row version just written is.  The table AM
 * formed that version from the slot's values and left them stale (an
 * update's unchanged columns point into the old version's copy, freed by
 * now): read scope and key from the stored version.
 */
static void
direct_hint(IdemDirect *direct)
{
	TupleTableSlot *slot = direct->slot;

	slot_getsomeattrs(slot, KEYS_COL_KEY);
	idem_row_hint_set(direct->heap, &slot->tts_tid,
					  slot->tts_values[KEYS_COL_SCOPE - 1],
					  slot->tts_values[KEYS_COL_KEY - 1]);
}

/* Insert a new row with these column values. */
void
idem_direct_insert(IdemDirect *direct, const Datum *values, const bool *nulls)
{
	TupleTableSlot *slot = direct->slot;

	ResetPerTupleExprContext(direct->estate);
	ExecClearTuple(slot);
	/* the table's columns: KEYS_NCOLS, or fewer before an update (store.h) */
	memcpy(slot->tts_values, values,
		   sizeof(Datum) * slot->tts_tupleDescriptor->natts);
	memcpy(slot->tts_isnull, nulls,
		   sizeof(bool) * slot->tts_tupleDescriptor->natts);
	ExecStoreVirtualTuple(slot);
	direct_check(direct);
	table_tuple_insert(direct->heap, slot, GetCurrentCommandId(true), 0, NULL);
	direct_index(direct, false, false);
	direct_hint(direct);
}

/*
 * Update the row version at "tid": the columns in "columns" (KEYS_COL_BIT
 * bits) get the new values, the others keep theirs.  With "wait", a row
 * being changed by another transaction is waited for, as the SQL statement
 * would.
 */
IdemDirectResult
idem_direct_update(IdemDirect *direct, ItemPointer tid, uint32 columns,
				   const Datum *values, const bool *nulls, bool wait)
{
	TupleTableSlot *old = direct->old;
	TupleTableSlot *slot = direct->slot;
	ItemPointerData otid = *tid;
	TM_FailureData tmfd;
	LockTupleMode lockmode;
	TM_Result	result;
	IdemDirectResult done;
	IdemUpdateIndexes update_indexes;

	ResetPerTupleExprContext(direct->estate);
	/* A publication that publishes updates needs the replica identity. */
	CheckCmdReplicaIdentity(direct->heap, CMD_UPDATE);
	if (!wait)
	{
		/*
		 * The table AM's update has no "no wait": it waits for a row that
		 * another transaction changes or locks (and an assert-enabled server
		 * stops on the request).  So a write that must not wait first locks
		 * the row as SELECT ... FOR UPDATE SKIP LOCKED does, which also reads
		 * it; the update then finds it locked by this transaction alone and
		 * does not wait.  A row that only this transaction locks is locked at
		 * once.  The lock is in the mode of the update itself: FOR UPDATE
		 * when it sets a column of a unique index, else FOR NO KEY UPDATE.
		 * After a weaker lock the update would have to wait to strengthen it;
		 * after a stronger one, it keeps the stronger mode and counts as a
		 * change of the key, which a FOR KEY SHARE lock (a foreign key's
		 * check) has to wait for.
		 */
		result = table_tuple_lock(direct->heap, &otid, InvalidSnapshot, old,
								  GetCurrentCommandId(true),
								  (columns & idem_catalog()->key_columns) != 0 ?
								  LockTupleExclusive : LockTupleNoKeyExclusive,
								  LockWaitSkip, 0, &tmfd);
		if (result != TM_Ok)
			return direct_result(result, "locking");
	}
	else if (!table_tuple_fetch_row_version(direct->heap, &otid, SnapshotAny,
											old))
		return IDEM_DIRECT_GONE;

	/*
	 * a copy of its own: the new row is formed from it after the page moves
	 * on
	 */
	ExecMaterializeSlot(old);
	slot_getallattrs(old);

	ExecClearTuple(slot);
	for (int i = 0; i < slot->tts_tupleDescriptor->natts; i++)
	{
		bool		set = (columns & KEYS_COL_BIT(i + 1)) != 0;

		slot->tts_values[i] = set ? values[i] : old->tts_values[i];
		slot->tts_isnull[i] = set ? nulls[i] : old->tts_isnull[i];
	}
	ExecStoreVirtualTuple(slot);
	direct_check(direct);

	result = table_tuple_update(direct->heap, &otid, slot,
								GetCurrentCommandId(true),
								ActiveSnapshotSet() ? GetActiveSnapshot() : InvalidSnapshot,
								InvalidSnapshot, true, &tmfd, &lockmode,
								&update_indexes);
	done = direct_result(result, "updating");
	ExecClearTuple(old);
	if (done != IDEM_DIRECT_DONE)
		return done;
	if (IDEM_UPDATE_NEEDS_INDEXES(update_indexes))
		direct_index(direct, true,
					 IDEM_UPDATE_ONLY_SUMMARIZING(update_indexes));
	direct_hint(direct);
	return IDEM_DIRECT_DONE;
}

/* Delete the row version at "tid"; "wait" as for idem_direct_update. */
IdemDirectResult
idem_direct_delete(IdemDirect *direct, ItemPointer tid, bool wait)
{
	CommandId	cid = GetCurrentCommandId(true);
	TM_FailureData tmfd;
	TM_Result	result;

	/* A publication that publishes deletes needs the replica identity. */
	CheckCmdReplicaIdentity(direct->heap, CMD_DELETE);
	for (;;)
	{
		result = table_tuple_delete(direct->heap, tid, cid, InvalidSnapshot,
									InvalidSnapshot, wait, &tmfd, false);
		if (wait || result != TM_BeingModified ||
			!direct_locked_only_by_me(direct->heap, tid))
			break;
		wait = true;
	}
	return direct_result(result, "deleting");
}
