/*-------------------------------------------------------------------------
 *
 * stats.c
 *	  Counters behind the idempotency.stats view.
 *
 * Owns a small shared-memory array of per-database counters (claims,
 * takeovers, replays, in_progress, mismatches, finishes, releases,
 * expired, reset, and the last sweep's time and duration), the
 * SQL-callable functions that read and reset them, and the one that
 * reports the view's key counts (row.c counts them: exactly on a small
 * table, from the planner's statistics on a large one).  Counters live since
 * server start and only exist when the library is preloaded; without it,
 * counting is a no-op and the reader returns no rows (the view shows
 * NULLs).  Counters are atomics, so counting never takes a lock.  A
 * database takes an entry at its first event or read (with zeroes); when
 * all entries are taken, those of dropped databases are given back.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "port/atomics.h"
#include "storage/ipc.h"
#include "storage/shmem.h"
#include "storage/spin.h"
#include "access/xact.h"
#include "catalog/namespace.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"

#include "idempotency.h"

/* Databases with counters of their own; later ones are not counted. */
#define STATS_MAX_DATABASES		256

typedef struct StatsEntry
{
	Oid			dbid;			/* InvalidOid: free */
	pg_atomic_uint64 counters[IDEM_STAT_NCOUNTERS];
	slock_t		mutex;			/* protects the two sweep fields */
	TimestampTz last_sweep_at;	/* 0: never */
	double		last_sweep_ms;
} StatsEntry;

typedef struct StatsShared
{
	slock_t		mutex;			/* protects dbid allocation */
	StatsEntry	entries[STATS_MAX_DATABASES];
} StatsShared;

static StatsShared *stats_shared = NULL;

/* This backend's entry, found once per database. */
static StatsEntry *my_entry = NULL;
static Oid	my_entry_db = InvalidOid;

static void stats_claim_entry(void);

PG_FUNCTION_INFO_V1(idem_stats_counters);
PG_FUNCTION_INFO_V1(idem_stats_reset);
PG_FUNCTION_INFO_V1(idem_stats_key_counts);

static void
stats_shmem_attach(void *mem, bool found)
{
	stats_shared = (StatsShared *) mem;
	if (!found)
	{
		SpinLockInit(&stats_shared->mutex);
		for (int i = 0; i < STATS_MAX_DATABASES; i++)
		{
			StatsEntry *e = &stats_shared->entries[i];

			e->dbid = InvalidOid;
			SpinLockInit(&e->mutex);
			e->last_sweep_at = 0;
			e->last_sweep_ms = 0;
			for (int c = 0; c < IDEM_STAT_NCOUNTERS; c++)
				pg_atomic_init_u64(&e->counters[c], 0);
		}
	}
}

const IdemShmemPart idem_stats_shmem = {
	"idempotency stats", sizeof(StatsShared), NULL, stats_shmem_attach
};

/*
 * Free the entries of databases that no longer exist (needs a transaction
 * for the catalog lookups; called only when every entry is taken).
 */
static void
stats_forget_dropped(void)
{
	Oid			dbids[STATS_MAX_DATABASES];

	for (int i = 0; i < STATS_MAX_DATABASES; i++)
		dbids[i] = stats_shared->entries[i].dbid;
	for (int i = 0; i < STATS_MAX_DATABASES; i++)
	{
		if (!OidIsValid(dbids[i]) ||
			SearchSysCacheExists1(DATABASEOID, ObjectIdGetDatum(dbids[i])))
			continue;
		SpinLockAcquire(&stats_shared->mutex);
		if (stats_shared->entries[i].dbid == dbids[i])
			stats_shared->entries[i].dbid = InvalidOid;
		SpinLockRelease(&stats_shared->mutex);
	}
}

/*
 * The entry of this database, allocated on first use (with zeroed
 * counters); NULL without preloading or when all entries are taken by
 * existing databases.
 */
static StatsEntry *
stats_entry(void)
{
	if (stats_shared == NULL || !OidIsValid(MyDatabaseId))
		return NULL;
	if (my_entry != NULL && my_entry_db == MyDatabaseId &&
		my_entry->dbid == MyDatabaseId)
		return my_entry;
	my_entry = NULL;
	my_entry_db = InvalidOid;

	for (int attempt = 0; attempt < 2 && my_entry == NULL; attempt++)
	{
		if (attempt == 1)
		{
			if (!IsTransactionState())
				break;
			stats_forget_dropped();
		}
		stats_claim_entry();
	}
	return my_entry;
}

/* Find or take this database's entry (zeroing a newly taken one). */
static void
stats_claim_entry(void)
{
	SpinLockAcquire(&stats_shared->mutex);
	for (int i = 0; i < STATS_MAX_DATABASES && my_entry == NULL; i++)
	{
		StatsEntry *e = &stats_shared->entries[i];

		if (e->dbid == MyDatabaseId)
		{
			my_entry = e;
			my_entry_db = MyDatabaseId;
		}
	}
	for (int i = 0; i < STATS_MAX_DATABASES && my_entry == NULL; i++)
	{
		StatsEntry *e = &stats_shared->entries[i];

		if (e->dbid == InvalidOid)
		{
			for (int c = 0; c < IDEM_STAT_NCOUNTERS; c++)
				pg_atomic_write_u64(&e->counters[c], 0);
			e->last_sweep_at = 0;
			e->last_sweep_ms = 0;
			/* Readers check dbid without the lock: zeroes first, then dbid. */
			pg_write_barrier();
			e->dbid = MyDatabaseId;
			my_entry = e;
			my_entry_db = MyDatabaseId;
		}
	}
	SpinLockRelease(&stats_shared->mutex);
}

/* Add n to one counter of this database. */
void
idem_stats_count(IdemCounter counter, int64 n)
{
	StatsEntry *e = stats_entry();

	if (e != NULL && n != 0)
		pg_atomic_fetch_add_u64(&e->counters[counter], (uint64) n);
}

/* Record when a sweep of this database ended and how long it took. */
void
idem_stats_sweep_done(TimestampTz at, double ms)
{
	StatsEntry *e = stats_entry();

	if (e == NULL)
		return;
	SpinLockAcquire(&e->mutex);
	e->last_sweep_at = at;
	e->last_sweep_ms = ms;
	SpinLockRelease(&e->mutex);
}

/*
 * idempotency.stats_counters(): one row per database that has counters.
 * No rows without preloading.
 */
Datum
idem_stats_counters(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;

	InitMaterializedSRF(fcinfo, 0);
	if (stats_shared == NULL)
		PG_RETURN_VOID();
	(void) stats_entry();		/* this database's row, zeroes if new */

	for (int i = 0; i < STATS_MAX_DATABASES; i++)
	{
		StatsEntry *e = &stats_shared->entries[i];

		/* dbid, the 1.0 counters, the last sweep, the later counters */
		Datum		values[IDEM_STAT_NCOUNTERS + 3];
		bool		nulls[IDEM_STAT_NCOUNTERS + 3] = {0};
		const int	sweep_col = IDEM_STAT_CHECKPOINTS + 1;
		TimestampTz at;
		double		ms;

		Oid			dbid = e->dbid;

		if (dbid == InvalidOid)
			continue;
		pg_read_barrier();		/* pairs with the claim's write barrier */
		values[0] = ObjectIdGetDatum(dbid);
		for (int c = 0; c < IDEM_STAT_NCOUNTERS; c++)
			values[c < IDEM_STAT_CHECKPOINTS ? c + 1 : c + 3] =
				Int64GetDatum((int64) pg_atomic_read_u64(&e->counters[c]));
		SpinLockAcquire(&e->mutex);
		at = e->last_sweep_at;
		ms = e->last_sweep_ms;
		SpinLockRelease(&e->mutex);
		values[sweep_col] = TimestampTzGetDatum(at);
		nulls[sweep_col] = (at == 0);
		values[sweep_col + 1] = Float8GetDatum(ms);
		nulls[sweep_col + 1] = (at == 0);
		/* a 1.3 installation declares fewer columns: they come first */
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values,
							 nulls);
	}
	PG_RETURN_VOID();
}

/*
 * idempotency.stats_reset(): zero the counters of every database.  Not
 * granted to PUBLIC.  A no-op without preloading.
 */
Datum
idem_stats_reset(PG_FUNCTION_ARGS)
{
	if (stats_shared == NULL)
		PG_RETURN_VOID();
	for (int i = 0; i < STATS_MAX_DATABASES; i++)
	{
		StatsEntry *e = &stats_shared->entries[i];

		for (int c = 0; c < IDEM_STAT_NCOUNTERS; c++)
			pg_atomic_write_u64(&e->counters[c], 0);
		SpinLockAcquire(&e->mutex);
		e->last_sweep_at = 0;
		e->last_sweep_ms = 0;
		SpinLockRelease(&e->mutex);
	}
	PG_RETURN_VOID();
}

/*
 * The counts are read in C, with no privilege on the table, so they take
 * the stats view's: a role may read them, however it asks, only if it may
 * read the view.  An administrator who revokes SELECT on the view from a
 * role hides the counts from that role too.
 */
static void
stats_check_view_privilege(void)
{
	Oid			nsp = get_namespace_oid("idempotency", true);
	Oid			view = OidIsValid(nsp) ? get_relname_relid("stats", nsp) : InvalidOid;
	AclResult	aclresult;

	if (!OidIsValid(view))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_TABLE),
				 errmsg("relation \"idempotency.stats\" does not exist")));
	aclresult = pg_class_aclcheck(view, GetUserId(), ACL_SELECT);
	if (aclresult != ACLCHECK_OK)
		aclcheck_error(aclresult, OBJECT_VIEW, "stats");
}

/*
 * idempotency.stats_key_counts(): this database's keys by status (on
 * Citus, those of the shards this node holds), whether the counts are
 * exact (see idem_row_count_keys; the limit is
 * idempotency.stats_exact_limit) and, from 1.7, the remembered keys (an
 * older installation declares the first four columns, and gets those).
 * Without an estimate the counts are NULL.
 */
Datum
idem_stats_key_counts(PG_FUNCTION_ARGS)
{
	TupleDesc	tupdesc;
	Datum		values[IDEM_NCOUNTS + 1];
	bool		nulls[IDEM_NCOUNTS + 1] = {0};
	int64		counts[IDEM_NCOUNTS];
	IdemKeyCountSource source;

	if (get_call_result_type(fcinfo, NULL, &tupdesc) != TYPEFUNC_COMPOSITE)
		elog(ERROR, "return type must be a row type");
	stats_check_view_privilege();
	/* on Citus, the keys of the shards this node holds */
	source = IDEM_COUNT_EXACT;
	memset(counts, 0, sizeof(counts));
	for (int r = 0, nrel = idem_catalog_local_count(); r < nrel; r++)
	{
		int64		rel_counts[IDEM_NCOUNTS];
		IdemKeyCountSource rel_source;

		if (!idem_catalog_select_local(r))
			continue;
		rel_source = idem_row_count_keys(GetCurrentTimestamp(),
										 idem_stats_exact_limit, rel_counts);
		for (int i = 0; i < IDEM_NCOUNTS; i++)
			counts[i] += rel_counts[i];
		if (rel_source == IDEM_COUNT_UNKNOWN ||
			(rel_source == IDEM_COUNT_ESTIMATE && source == IDEM_COUNT_EXACT))
			source = rel_source;
	}
	for (int i = 0; i < IDEM_NSTATUS; i++)
	{
		values[i] = Int64GetDatum(counts[i]);
		nulls[i] = (source == IDEM_COUNT_UNKNOWN);
	}
	values[IDEM_NSTATUS] = BoolGetDatum(source == IDEM_COUNT_EXACT);
	values[IDEM_NSTATUS + 1] = Int64GetDatum(counts[IDEM_COUNT_REMEMBERED]);
	nulls[IDEM_NSTATUS + 1] = (source == IDEM_COUNT_UNKNOWN);
	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(BlessTupleDesc(tupdesc),
													  values, nulls)));
}
