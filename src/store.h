/*-------------------------------------------------------------------------
 *
 * store.h
 *	  What the files of the key store share, and nobody else sees.
 *
 * The key store is idempotency.keys with its indexes and token sequence:
 *	  catalog.c  finds the extension's relations and checks them
 *	  row.c      reads rows: the probe, fetches by ctid, the sweep's scan
 *	  write.c    every change to a row, by one table of write rules
 *	  direct.c   the table-AM writer that write.c uses when it may
 *	  citus.c    what changes when Citus distributes the table
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_STORE_H
#define IDEMPOTENCY_STORE_H

#include "access/tableam.h"
#include "executor/tuptable.h"
#include "nodes/execnodes.h"

#include "idempotency.h"

/*
 * Columns of idempotency.keys, in table order.  idem_keys_columns (catalog.c)
 * gives the name and type of each: the catalog checks the table against it,
 * and write.c builds its statements from it.
 */
typedef enum KeysColumn
{
	KEYS_COL_SCOPE = 1,
	KEYS_COL_KEY,
	KEYS_COL_STATUS,
	KEYS_COL_TOKEN,
	KEYS_COL_ATTEMPT,
	KEYS_COL_FINGERPRINT,
	KEYS_COL_RESPONSE_CODE,
	KEYS_COL_RESPONSE_BODY,
	KEYS_COL_CREATED_AT,
	KEYS_COL_FINISHED_AT,
	KEYS_COL_LEASE_UNTIL,
	KEYS_COL_EXPIRES_AT,
	KEYS_COL_RETENTION,
	KEYS_COL_SWEEP_AT,
	/* appended in extension version 1.4 */
	KEYS_COL_PHASE,
	KEYS_COL_PHASE_DATA,
	KEYS_COL_OWNER_SESSION,
	/* appended in extension version 1.7 */
	KEYS_COL_REMEMBER,
	/* appended in extension version 1.8 */
	KEYS_COL_REQUEST,
	KEYS_NCOLS = KEYS_COL_REQUEST
} KeysColumn;

/*
 * The table as extension versions 1.0 to 1.3 create it: the first 14
 * columns.  One library serves every installed version, so the store
 * reads and writes only the columns the table has (IdemCatalog.ncols).
 */
#define KEYS_NCOLS_1_0			KEYS_COL_SWEEP_AT
/* ... and as versions 1.4 to 1.6 create it ... */
#define KEYS_NCOLS_1_4			KEYS_COL_OWNER_SESSION
/* ... and as version 1.7 creates it. */
#define KEYS_NCOLS_1_7			KEYS_COL_REMEMBER

/* The bit of column "col" in a set of columns (a write rule's). */
#define KEYS_COL_BIT(col)				(1u << ((col) - 1))

typedef struct KeysColumnDef
{
	const char *name;
	Oid			type;
	bool		not_null;		/* declared NOT NULL: readers rely on a value */
} KeysColumnDef;

/* Indexed by column number - 1. */
extern const KeysColumnDef idem_keys_columns[KEYS_NCOLS];

/* ---- catalog.c ---- */

/*
 * The extension's relations, each locked AccessShareLock by this
 * transaction.
 */
typedef struct IdemCatalog
{
	Oid			keys;
	Oid			pkey;			/* keys_pkey: (scope, key) */
	Oid			sweep_idx;		/* keys_sweep_at_idx: (sweep_at) */
	Oid			session_idx;	/* keys_owner_session_idx, or InvalidOid
								 * before 1.4 */
	Oid			abandoned_idx;	/* keys_abandoned_idx: (scope, created_at) of
								 * the keys a sweep reset, or InvalidOid
								 * before 1.8 */
	int			ncols;			/* KEYS_NCOLS, or KEYS_NCOLS_1_7 / _1_4 / _1_0
								 * on a table not updated yet */
	Oid			token_seq;
	Oid			owner;			/* owner of idempotency.keys */
	bool		user_code;		/* a write can run code a user attached to the
								 * table (catalog_runs_user_code) */
	bool		deferred_trigger;	/* a user's trigger fires at commit */
	uint32		key_columns;	/* the columns (KEYS_COL_BIT bits) in a unique
								 * index: an update of one locks the row FOR
								 * UPDATE, of others FOR NO KEY UPDATE */
	int64		shardid;		/* 0, or the Citus shard these relations are
								 * (keys_<shardid> and its indexes) */
} IdemCatalog;

extern const IdemCatalog *idem_catalog(void);

/* ---- citus.c ---- */

/* A shard of a Citus table. */
typedef struct IdemShard
{
	int64		shardid;
	int32		min;			/* its range of scope hashes */
	int32		max;
	int			index;			/* its position among the table's shards */
	bool		local;			/* this node holds an active placement */
} IdemShard;

extern bool idem_citus_table(Oid relid, char *method, int32 *colocationid,
							 char **column);
extern int	idem_citus_shards(Oid relid, IdemShard **shards,
							  MemoryContext cxt);
extern int32 idem_citus_hash(text *scope);
extern bool idem_citus_lock_shard(int32 colocationid, int index);
extern int64 idem_citus_claim_token(int64 token, int64 stored);

/* ---- row.c ---- */
extern bool idem_row_xmax_locks_other(uint16 infomask, TransactionId xmax);
extern void idem_row_hint_set(Relation heap, ItemPointer tid, Datum scope,
							  Datum key);

/* ---- direct.c ---- */

/*
 * An open direct writer (idem_direct_begin .. idem_direct_end): the table,
 * an executor state for its indexes and constraints, and a slot.
 */
typedef struct IdemDirect
{
	Relation	heap;
	EState	   *estate;
	ResultRelInfo *rri;
	int			nindexes;		/* the table's indexes; -1: not listed yet */
	Oid		   *index_oids;
	Relation   *index_rels;		/* each opened at the first row entered */
	IndexInfo **index_infos;
	Oid			session_idx;	/* the extension's partial indexes, judged */
	Oid			abandoned_idx;	/* here by their predicates */
	TupleTableSlot *slot;
	TupleTableSlot *old;
} IdemDirect;

/* What a direct write did to its row. */
typedef enum IdemDirectResult
{
	IDEM_DIRECT_DONE,			/* written */
	IDEM_DIRECT_GONE,			/* the version was updated or deleted since */
	IDEM_DIRECT_BUSY			/* another transaction changes or locks it */
} IdemDirectResult;

extern bool idem_direct_begin(IdemDirect *direct);
extern void idem_direct_insert(IdemDirect *direct, const Datum *values,
							   const bool *nulls);
extern IdemDirectResult idem_direct_update(IdemDirect *direct,
										   ItemPointer tid,
										   uint32 columns,
										   const Datum *values,
										   const bool *nulls, bool wait);
extern IdemDirectResult idem_direct_delete(IdemDirect *direct,
										   ItemPointer tid, bool wait);
extern void idem_direct_end(IdemDirect *direct);

#endif							/* IDEMPOTENCY_STORE_H */
