/*-------------------------------------------------------------------------
 *
 * catalog.c
 *	  Finding the extension's relations, and refusing impostors.
 *
 * Owns the lookup of idempotency.keys, its two indexes, the token sequence
 * and (for tenant.c) any other relation of the extension's schema: by name,
 * locked, looked up again when invalidations arrived during the lock wait,
 * and checked to be what the extension created (members of the extension,
 * the columns and indexes the store reads directly).  The result is cached
 * per backend and forgotten on any invalidation of those relations.  Every
 * refusal is an ERROR with a SQLSTATE (42704 when the extension is not
 * installed, 55000 when its objects are missing or replaced).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "catalog/dependency.h"
#include "catalog/namespace.h"
#include "catalog/pg_am.h"
#include "catalog/pg_class.h"
#include "catalog/pg_index.h"
#include "catalog/pg_type.h"
#include "commands/extension.h"
#include "storage/lmgr.h"
#include "storage/sinval.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"

#include "store.h"

const KeysColumnDef idem_keys_columns[NUM_COLS] = {
	[COL_SCOPE - 1] = {"scope", TEXTOID},
	[COL_KEY - 1] = {"key", TEXTOID},
	[COL_STATUS - 1] = {"status", TEXTOID},
	[COL_TOKEN - 1] = {"token", INT8OID},
	[COL_ATTEMPT - 1] = {"attempt", INT4OID},
	[COL_FINGERPRINT - 1] = {"fingerprint", BYTEAOID},
	[COL_RESPONSE_CODE - 1] = {"response_code", INT4OID},
	[COL_RESPONSE_BODY - 1] = {"response_body", JSONBOID},
	[COL_CREATED_AT - 1] = {"created_at", TIMESTAMPTZOID},
	[COL_FINISHED_AT - 1] = {"finished_at", TIMESTAMPTZOID},
	[COL_LEASE_UNTIL - 1] = {"lease_until", TIMESTAMPTZOID},
	[COL_EXPIRES_AT - 1] = {"expires_at", TIMESTAMPTZOID},
	[COL_RETENTION - 1] = {"retention", INTERVALOID},
	[COL_SWEEP_AT - 1] = {"sweep_at", TIMESTAMPTZOID},
	[COL_PHASE - 1] = {"phase", TEXTOID},
	[COL_PHASE_DATA - 1] = {"phase_data", JSONBOID},
	[COL_OWNER_SESSION - 1] = {"owner_session", INT8OID},
};

/* The cache, valid until an invalidation of one of its relations. */
static IdemCatalog cached;
static bool cached_valid = false;
static bool callback_registered = false;

/* Forget the cache when any of its relations changes. */
static void
catalog_relcache_callback(Datum arg, Oid relid)
{
	if (relid == InvalidOid || relid == cached.keys || relid == cached.pkey ||
		relid == cached.sweep_idx || relid == cached.session_idx ||
		relid == cached.token_seq)
		cached_valid = false;
}

/*
 * Refuse a relation that is not a member of the extension: the schema is
 * found by name, and whoever owns it could rename it and plant look-alike
 * tables under the old name.
 */
void
idem_catalog_check_member(Oid relid)
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
idem_catalog_refuse_replaced(const char *what)
{
	ereport(ERROR,
			(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
			 errmsg("%s is not as extension \"idempotency\" created it", what),
			 errhint("Someone replaced the extension's objects; reinstall the extension.")));
}

/* Raise 55000 for an extension object ("what") that is gone. */
void
idem_catalog_refuse_missing(const char *what)
{
	ereport(ERROR,
			(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
			 errmsg("%s of extension \"idempotency\" is missing", what),
			 errhint("Someone dropped the extension's objects; reinstall the extension.")));
}

IDEM_NORETURN static void catalog_refuse_not_installed(void);

/* Raise 42704: the extension is not installed in this database. */
static void
catalog_refuse_not_installed(void)
{
	ereport(ERROR,
			(errcode(ERRCODE_UNDEFINED_OBJECT),
			 errmsg("extension \"idempotency\" is not installed in this database"),
			 errhint("Run CREATE EXTENSION idempotency.")));
}

/*
 * The columns the store reads and writes by number, with their types: those
 * of 1.4, or the first NUM_COLS_1_0 of them (an installation not updated
 * yet).  Returns how many the table has.
 */
static int
catalog_check_columns(Relation heap)
{
	TupleDesc	desc = RelationGetDescr(heap);

	if (desc->natts != NUM_COLS && desc->natts != NUM_COLS_1_0)
		idem_catalog_refuse_replaced("table \"idempotency.keys\"");
	for (int i = 0; i < desc->natts; i++)
		if (TupleDescAttr(desc, i)->atttypid != idem_keys_columns[i].type ||
			TupleDescAttr(desc, i)->attisdropped ||
			strcmp(NameStr(TupleDescAttr(desc, i)->attname),
				   idem_keys_columns[i].name) != 0)
			idem_catalog_refuse_replaced("table \"idempotency.keys\"");
	return desc->natts;
}

/*
 * Refuse an index that is not the btree on "ncols" columns of the table
 * "keys" that the store scans directly (indexes are not extension members:
 * they belong to their table, so check what they index).  "partial" says
 * whether it has a predicate; readers of a partial index check each row
 * they get from it anyway.
 */
static void
catalog_check_index(Oid indexid, Oid keys, int ncols, AttrNumber col1,
					AttrNumber col2, bool partial)
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
		heap_attisnull(index->rd_indextuple, Anum_pg_index_indpred, NULL) != partial;
	index_close(index, NoLock);
	if (!ok)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("index \"%s\" is not the index extension \"idempotency\" created",
						get_rel_name(indexid)),
				 errhint("Someone replaced the extension's objects; reinstall the extension.")));
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
idem_catalog_lock_relation(const char *name)
{
	for (;;)
	{
		uint64		inval_count = SharedInvalidMessageCounter;
		Oid			nsp = get_namespace_oid("idempotency", true);
		Oid			relid;

		if (!OidIsValid(nsp))
			catalog_refuse_not_installed();
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
catalog_find(IdemCatalog *found)
{
	memset(found, 0, sizeof(IdemCatalog));
	found->keys = idem_catalog_lock_relation("keys");
	found->token_seq = idem_catalog_lock_relation("token_seq");
	if (!OidIsValid(found->keys) || !OidIsValid(found->token_seq))
		catalog_refuse_not_installed();
	found->pkey = idem_catalog_lock_relation("keys_pkey");
	if (!OidIsValid(found->pkey))
		idem_catalog_refuse_missing("index \"keys_pkey\"");
	found->sweep_idx = idem_catalog_lock_relation("keys_sweep_at_idx");
	if (!OidIsValid(found->sweep_idx))
		idem_catalog_refuse_missing("index \"keys_sweep_at_idx\"");
}

/*
 * The extension's relations, found and checked, each locked by this
 * transaction.  The names are looked up again as long as invalidations
 * arrive during the lookup, until the OIDs we hold locks on are the ones
 * the names mean.  Nothing is cached until every check passed, so an error
 * leaves the cache invalid and the next call looks again.
 */
const IdemCatalog *
idem_catalog(void)
{
	IdemCatalog found;

	/*
	 * The first lock this transaction takes on the table accepts the
	 * invalidations queued meanwhile (a REINDEX CONCURRENTLY of an index,
	 * say): take it before trusting the cache, not after.  Every caller
	 * opens the table next, so this costs a local lock table lookup.
	 */
	if (cached_valid)
	{
		LockRelationOid(cached.keys, AccessShareLock);
		if (cached_valid)
			return &cached;
	}
	if (!callback_registered)
	{
		CacheRegisterRelcacheCallback(catalog_relcache_callback, (Datum) 0);
		callback_registered = true;
	}
	for (;;)
	{
		uint64		inval_count = SharedInvalidMessageCounter;
		Relation	heap;

		catalog_find(&found);
		if (inval_count != SharedInvalidMessageCounter)
			continue;			/* a name may have moved: look again */
		idem_catalog_check_member(found.keys);
		idem_catalog_check_member(found.token_seq);
		heap = table_open(found.keys, AccessShareLock);
		found.ncols = catalog_check_columns(heap);
		found.owner = heap->rd_rel->relowner;
		table_close(heap, NoLock);
		catalog_check_index(found.pkey, found.keys, 2, COL_SCOPE, COL_KEY,
							false);
		catalog_check_index(found.sweep_idx, found.keys, 1, COL_SWEEP_AT, 0,
							false);
		if (found.ncols >= COL_OWNER_SESSION)
		{
			found.session_idx = idem_catalog_lock_relation("keys_owner_session_idx");
			if (!OidIsValid(found.session_idx))
				idem_catalog_refuse_missing("index \"keys_owner_session_idx\"");
			catalog_check_index(found.session_idx, found.keys, 1,
								COL_OWNER_SESSION, 0, true);
		}
		if (inval_count == SharedInvalidMessageCounter)
			break;
	}

	/*
	 * Publish at once: an invalidation that arrives from here on clears the
	 * cache through the callback, which compares against these OIDs.
	 */
	cached = found;
	cached_valid = true;
	return &cached;
}
