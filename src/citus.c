/*-------------------------------------------------------------------------
 *
 * citus.c
 *	  What the store needs to know when Citus distributes its table.
 *
 * Owns everything Citus-specific: whether idempotency.keys (or
 * scope_bindings) is a Citus table, read from Citus's metadata tables
 * (pg_dist_partition, pg_dist_shard, pg_dist_placement,
 * pg_dist_local_group) with plain SQL, because Citus exports no C API
 * another extension can link against; the hash of a scope, computed as
 * Citus computes it for a text distribution column; the lock Citus's
 * shard moves and splits take on a shard's metadata; and the floor that
 * keeps fencing tokens increasing per key when a key's shard moves to a
 * node whose token sequence is behind.  catalog.c turns a scope into the
 * local shard's relations with these.  Without Citus installed in the
 * database nothing here runs but one extension lookup per catalog load.
 * Must not write Citus's metadata or decide which shard holds a scope:
 * it only reads what Citus decided.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "catalog/pg_collation.h"
#include "catalog/pg_type.h"
#include "commands/extension.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "port/atomics.h"
#include "storage/ipc.h"
#include "storage/lock.h"
#include "storage/shmem.h"
#include "utils/builtins.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

#include "store.h"

/*
 * The advisory lock class of Citus's lock on the metadata of colocated
 * shards (its ADV_LOCKTAG_CLASS_CITUS_COLOCATED_SHARDS_METADATA): a shard
 * move or split takes it in ExclusiveLock before its final switch-over,
 * and every write through Citus holds it in ShareLock.
 */
#define CITUS_COLOCATED_SHARDS_METADATA_CLASS	8

/* The highest token this node issued for a distributed table. */
typedef struct CitusShared
{
	pg_atomic_uint64 token_floor;
} CitusShared;

static CitusShared *citus_shared = NULL;

/* Without shared memory (not preloaded): this backend's own floor. */
static uint64 backend_token_floor = 0;

static void
citus_shmem_attach(void *mem, bool found)
{
	citus_shared = (CitusShared *) mem;
	if (!found)
		pg_atomic_init_u64(&citus_shared->token_floor, 0);
}

const IdemShmemPart idem_citus_shmem = {
	"idempotency citus", sizeof(CitusShared), NULL, citus_shmem_attach
};

/*
 * The rows of a read-only query on Citus's metadata with one oid
 * parameter, copied into the caller's memory context with their
 * descriptor.  It runs under the latest snapshot, as PostgreSQL reads its
 * own catalogs: the statement's snapshot can predate a shard move that
 * committed while we waited for the shard's lock, and would still show
 * the shard here.  Returns how many rows.
 */
static int
citus_query(const char *sql, Oid relid, HeapTuple **rows, TupleDesc *desc)
{
	MemoryContext cxt = CurrentMemoryContext;
	MemoryContext old;
	Oid			argtypes[1] = {OIDOID};
	Datum		values[1] = {ObjectIdGetDatum(relid)};
	int			rc;
	int			n;

	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	PushActiveSnapshot(GetLatestSnapshot());
	rc = SPI_execute_with_args(sql, 1, argtypes, values, NULL, true, 0);
	PopActiveSnapshot();
	if (rc != SPI_OK_SELECT)
		elog(ERROR, "idempotency: reading Citus's metadata failed: %s",
			 SPI_result_code_string(rc));
	n = (int) SPI_processed;
	old = MemoryContextSwitchTo(cxt);
	*desc = CreateTupleDescCopy(SPI_tuptable->tupdesc);
	*rows = palloc(sizeof(HeapTuple) * Max(n, 1));
	for (int i = 0; i < n; i++)
		(*rows)[i] = heap_copytuple(SPI_tuptable->vals[i]);
	MemoryContextSwitchTo(old);
	if (SPI_finish() != SPI_OK_FINISH)
		elog(ERROR, "SPI_finish failed");
	return n;
}

/* Free what citus_query returned. */
static void
citus_query_free(HeapTuple *rows, int n, TupleDesc desc)
{
	for (int i = 0; i < n; i++)
		heap_freetuple(rows[i]);
	pfree(rows);
	FreeTupleDesc(desc);
}

/*
 * Is "relid" a Citus table?  When it is, *method is its distribution
 * method ('h' hash, 'n' reference or local), *colocationid its colocation
 * group and *column the name of its distribution column (NULL when it has
 * none), allocated in the caller's memory context.
 */
bool
idem_citus_table(Oid relid, char *method, int32 *colocationid, char **column)
{
	HeapTuple  *rows;
	TupleDesc	desc;
	int			n;
	bool		isnull;
	Datum		d;

	if (!OidIsValid(get_extension_oid("citus", true)))
		return false;
	n = citus_query("SELECT p.partmethod::pg_catalog.text, p.colocationid,"
					" CASE WHEN p.partkey IS NOT NULL THEN"
					" pg_catalog.column_to_column_name(p.logicalrelid, p.partkey) END"
					" FROM pg_catalog.pg_dist_partition p"
					" WHERE p.logicalrelid OPERATOR(pg_catalog.=) $1",
					relid, &rows, &desc);
	if (n > 0)
	{
		d = heap_getattr(rows[0], 1, desc, &isnull);
		*method = isnull ? '?' : *TextDatumGetCString(d);
		d = heap_getattr(rows[0], 2, desc, &isnull);
		*colocationid = isnull ? 0 : DatumGetInt32(d);
		d = heap_getattr(rows[0], 3, desc, &isnull);
		*column = isnull ? NULL : TextDatumGetCString(d);
	}
	citus_query_free(rows, n, desc);
	return n > 0;
}

/*
 * The shards of the Citus table "relid", ordered by the start of their hash
 * range, each with its position in that order (Citus's shard index) and
 * whether this node holds an active placement of it.  The array is
 * allocated in "cxt".  Returns how many.
 */
int
idem_citus_shards(Oid relid, IdemShard **shards, MemoryContext cxt)
{
	HeapTuple  *rows;
	TupleDesc	desc;
	int			n;

	n = citus_query("SELECT s.shardid,"
					" COALESCE(s.shardminvalue::pg_catalog.int4, -2147483648),"
					" COALESCE(s.shardmaxvalue::pg_catalog.int4, 2147483647),"
					" EXISTS (SELECT FROM pg_catalog.pg_dist_placement p"
					"   WHERE p.shardid OPERATOR(pg_catalog.=) s.shardid"
					"   AND p.shardstate OPERATOR(pg_catalog.=) 1"
					"   AND p.groupid OPERATOR(pg_catalog.=)"
					"     (SELECT g.groupid FROM pg_catalog.pg_dist_local_group g))"
					" FROM pg_catalog.pg_dist_shard s"
					" WHERE s.logicalrelid OPERATOR(pg_catalog.=) $1"
					" ORDER BY 2, 1",
					relid, &rows, &desc);
	*shards = MemoryContextAllocZero(cxt, sizeof(IdemShard) * Max(n, 1));
	for (int i = 0; i < n; i++)
	{
		bool		isnull;
		IdemShard  *s = &(*shards)[i];

		s->shardid = DatumGetInt64(heap_getattr(rows[i], 1, desc, &isnull));
		s->min = DatumGetInt32(heap_getattr(rows[i], 2, desc, &isnull));
		s->max = DatumGetInt32(heap_getattr(rows[i], 3, desc, &isnull));
		s->local = DatumGetBool(heap_getattr(rows[i], 4, desc, &isnull));
		s->index = i;
	}
	citus_query_free(rows, n, desc);
	return n;
}

/*
 * The hash Citus places a scope by: the text type's hash function under
 * the column's collation ("C"; text hashes its bytes under any
 * deterministic collation).
 */
int32
idem_citus_hash(text *scope)
{
	return DatumGetInt32(DirectFunctionCall1Coll(hashtext, C_COLLATION_OID,
												 PointerGetDatum(scope)));
}

/*
 * Take Citus's lock on the metadata of the shard at "index" of colocation
 * group "colocationid" in ShareLock, as Citus's own writes do, until the
 * transaction ends: a shard move cannot switch the shard to another node
 * while we read and write it here.  Returns true when the lock was not
 * held yet (the caller then looks at the metadata again: a move may have
 * finished while we waited).
 */
bool
idem_citus_lock_shard(int32 colocationid, int index)
{
	LOCKTAG		tag;

	SET_LOCKTAG_ADVISORY(tag, MyDatabaseId, (uint32) index,
						 (uint32) colocationid,
						 CITUS_COLOCATED_SHARDS_METADATA_CLASS);
	return LockAcquire(&tag, ShareLock, false, false) !=
		LOCKACQUIRE_ALREADY_HELD;
}

/*
 * The token for a claim on a distributed table, given "token" from this
 * node's sequence and the key's current token ("stored", 0 for none).
 * Each node has a sequence of its own, and a key's shard can move to a
 * node whose sequence is behind, so the token is also at least the key's
 * current token + 1, at least the clock in microseconds since 2000 (which
 * is above what any node handed out a lease ago, while the nodes' clocks
 * agree that closely: this covers a key whose token died in a reset, or
 * that was deleted and claimed again), and above every token this node
 * issued since it started (so no two claims here get the same one).
 */
int64
idem_citus_claim_token(int64 token, int64 stored)
{
	uint64		want = (uint64) Max(token, GetCurrentTimestamp());
	uint64		cur;

	if (stored > 0 && (uint64) stored + 1 > want)
		want = (uint64) stored + 1;
	if (citus_shared == NULL)
	{
		want = Max(want, backend_token_floor + 1);
		backend_token_floor = want;
		return (int64) want;
	}
	cur = pg_atomic_read_u64(&citus_shared->token_floor);
	for (;;)
	{
		uint64		next = Max(want, cur + 1);

		if (pg_atomic_compare_exchange_u64(&citus_shared->token_floor, &cur,
										   next))
			return (int64) next;
	}
}

/*
 * On the coordinator, sweep the shards of every worker as well: run
 * idem_sweep there through Citus (each worker in a transaction of its
 * own) and add what they did to *expired and *reset.  Nothing on a worker.
 * A worker that fails the sweep fails the call.
 */
void
idem_citus_sweep_workers(int batch, int64 *expired, int64 *reset)
{
	Oid			argtypes[1] = {TEXTOID};
	Datum		values[1];
	int			rc;
	HeapTuple	tup;
	TupleDesc	desc;
	bool		isnull;

	values[0] = CStringGetTextDatum(psprintf("SELECT idempotency.idem_sweep(%d)",
											 batch));
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	rc = SPI_execute_with_args(
							   "SELECT pg_catalog.count(*) FILTER (WHERE NOT r.success),"
							   " pg_catalog.min(r.nodename OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) r.nodeport"
							   "   OPERATOR(pg_catalog.||) ': ' OPERATOR(pg_catalog.||) r.result) FILTER (WHERE NOT r.success),"
							   " COALESCE(pg_catalog.sum(pg_catalog.split_part(pg_catalog.btrim(r.result, '()'), ',', 1)::pg_catalog.int8)"
							   "   FILTER (WHERE r.success), 0)::pg_catalog.int8,"
							   " COALESCE(pg_catalog.sum(pg_catalog.split_part(pg_catalog.btrim(r.result, '()'), ',', 2)::pg_catalog.int8)"
							   "   FILTER (WHERE r.success), 0)::pg_catalog.int8"
							   " FROM pg_catalog.run_command_on_workers($1) r"
							   " WHERE (SELECT g.groupid FROM pg_catalog.pg_dist_local_group g)"
							   "   OPERATOR(pg_catalog.=) 0",
							   1, argtypes, values, NULL, false, 0);
	if (rc != SPI_OK_SELECT || SPI_processed != 1)
		elog(ERROR, "idempotency: sweeping the workers failed: %s",
			 SPI_result_code_string(rc));
	tup = SPI_tuptable->vals[0];
	desc = SPI_tuptable->tupdesc;
	if (DatumGetInt64(SPI_getbinval(tup, desc, 1, &isnull)) > 0)
		ereport(ERROR,
				(errcode(ERRCODE_CONNECTION_FAILURE),
				 errmsg("idem_sweep failed on a worker: %s",
						SPI_getvalue(tup, desc, 2))));
	*expired += DatumGetInt64(SPI_getbinval(tup, desc, 3, &isnull));
	*reset += DatumGetInt64(SPI_getbinval(tup, desc, 4, &isnull));
	if (SPI_finish() != SPI_OK_FINISH)
		elog(ERROR, "SPI_finish failed");
}
