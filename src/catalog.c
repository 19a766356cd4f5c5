/*-------------------------------------------------------------------------
 *
 * catalog.c
 *	  Finding the extension's relations, and refusing impostors.
 *
 * Owns the lookup of idempotency.keys, its two indexes, the token sequence
 * and (for tenant.c) any other relation of the extension's schema: by name,
 * locked, looked up again when invalidations arrived during the lock wait,
 * and checked to be what the extension created (members of the extension,
 * the columns and indexes the store reads directly), and what a write of
 * the table runs besides the store's own code: a user's code (write.c then
 * refuses callers with temporary tables), a deferred trigger, the columns
 * of its unique indexes (the row lock mode).  The result is cached
 * per backend and forgotten on any invalidation of those relations.  Every
 * refusal is an ERROR with a SQLSTATE (42704 when the extension is not
 * installed, 55000 when its objects are missing or replaced).
 *
 * When Citus distributes idempotency.keys by scope, the table the names
 * find is an empty shell and the rows live in shards (keys_<shardid>, with
 * indexes named likewise): every call first selects the shard that holds
 * its scope (idem_catalog_select_scope), which must be on this node, and
 * the store then reads and writes that shard's relations, never the
 * shell.  The sweep and the key counts visit each local shard in turn
 * (idem_catalog_select_local).  The shard map comes from Citus's metadata
 * and is forgotten with the shell's cache entry, which Citus invalidates
 * whenever a shard or placement changes.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/amapi.h"
#include "access/genam.h"
#include "access/xact.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/sysattr.h"
#include "access/transam.h"
#include "catalog/dependency.h"
#include "catalog/namespace.h"
#include "catalog/pg_am.h"
#include "catalog/pg_class.h"
#include "catalog/pg_index.h"
#include "catalog/pg_language.h"
#include "catalog/pg_proc.h"
#include "catalog/pg_type.h"
#include "commands/extension.h"
#include "nodes/makefuncs.h"
#include "nodes/nodeFuncs.h"
#include "storage/lmgr.h"
#include "storage/proc.h"
#include "storage/sinval.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/regproc.h"
#include "utils/syscache.h"
#include "utils/rel.h"
#include "utils/relcache.h"
#include "utils/resowner.h"

#include "store.h"

const KeysColumnDef idem_keys_columns[KEYS_NCOLS] = {
	[KEYS_COL_SCOPE - 1] = {"scope", TEXTOID, true},
	[KEYS_COL_KEY - 1] = {"key", TEXTOID, true},
	[KEYS_COL_STATUS - 1] = {"status", TEXTOID, true},
	[KEYS_COL_TOKEN - 1] = {"token", INT8OID},
	[KEYS_COL_ATTEMPT - 1] = {"attempt", INT4OID, true},
	[KEYS_COL_FINGERPRINT - 1] = {"fingerprint", BYTEAOID},
	[KEYS_COL_RESPONSE_CODE - 1] = {"response_code", INT4OID},
	[KEYS_COL_RESPONSE_BODY - 1] = {"response_body", JSONBOID},
	[KEYS_COL_CREATED_AT - 1] = {"created_at", TIMESTAMPTZOID, true},
	[KEYS_COL_FINISHED_AT - 1] = {"finished_at", TIMESTAMPTZOID},
	[KEYS_COL_LEASE_UNTIL - 1] = {"lease_until", TIMESTAMPTZOID},
	[KEYS_COL_EXPIRES_AT - 1] = {"expires_at", TIMESTAMPTZOID, true},
	[KEYS_COL_RETENTION - 1] = {"retention", INTERVALOID, true},
	[KEYS_COL_SWEEP_AT - 1] = {"sweep_at", TIMESTAMPTZOID, true},
	[KEYS_COL_PHASE - 1] = {"phase", TEXTOID},
	[KEYS_COL_PHASE_DATA - 1] = {"phase_data", JSONBOID},
	[KEYS_COL_OWNER_SESSION - 1] = {"owner_session", INT8OID},
	[KEYS_COL_REMEMBER - 1] = {"remember", INTERVALOID},
	[KEYS_COL_REQUEST - 1] = {"request", JSONBOID},
};

/* The cache, valid until an invalidation of one of its relations. */
static IdemCatalog cached;
static bool cached_valid = false;
static bool callback_registered = false;

/*
 * The (sub)transaction whose lock on the cached table catalog_base took
 * last, owned by that (sub)transaction's resource owner, not by the portal
 * that happened to be running (a failed cursor's portal releases its locks
 * when it is closed): within it the lock is still held, so taking it again
 * would only add to its count.  A subtransaction's id is never reused
 * within a transaction, so one that ended (and released its locks, if it
 * aborted) never matches.
 */
static LocalTransactionId locked_lxid = InvalidLocalTransactionId;
static SubTransactionId locked_subxid = InvalidSubTransactionId;

/* Whether Citus distributes the cached table, and its colocation group. */
static bool cached_distributed = false;
static int32 cached_colocation = 0;

/*
 * The shards of the distributed table, by hash range, each with its
 * relations once checked (only local shards are ever checked).
 */
typedef struct ShardEntry
{
	IdemShard	shard;
	bool		checked;
	IdemCatalog catalog;
} ShardEntry;

static ShardEntry *shard_entries = NULL;
static int	nshard_entries = 0;
static bool shards_valid = false;
static MemoryContext shard_cxt = NULL;

/*
 * The shard relations the store works on in this transaction (on a
 * distributed table only), set by the selecting functions and forgotten
 * when the transaction ends.
 */
static const IdemCatalog *selected = NULL;

static bool
catalog_is_of(const IdemCatalog *c, Oid relid)
{
	return relid == c->keys || relid == c->pkey || relid == c->sweep_idx ||
		relid == c->session_idx || relid == c->abandoned_idx ||
		relid == c->token_seq;
}

/* Forget the cache when any of its relations changes. */
static void
catalog_relcache_callback(Datum arg, Oid relid)
{
	if (relid == InvalidOid || catalog_is_of(&cached, relid))
	{
		cached_valid = false;
		shards_valid = false;
	}
	for (int i = 0; i < nshard_entries; i++)
		if (shard_entries[i].checked &&
			(relid == InvalidOid || catalog_is_of(&shard_entries[i].catalog, relid)))
			shard_entries[i].checked = false;
}

/* A transaction's selection of shard relations ends with it. */
static void
catalog_xact_callback(XactEvent event, void *arg)
{
	selected = NULL;
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

/*
 * Raise 55000 for an extension object ("what") that is not as the
 * extension made it.
 */
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
 * of 1.8, or the first KEYS_NCOLS_1_7, KEYS_NCOLS_1_4 or KEYS_NCOLS_1_0 of
 * them (an installation not updated yet).  Returns how many the table has.
 */
static int
catalog_check_columns(Relation heap)
{
	TupleDesc	desc = RelationGetDescr(heap);
	char	   *what = psprintf("table \"idempotency.%s\"",
								RelationGetRelationName(heap));

	if (desc->natts != KEYS_NCOLS && desc->natts != KEYS_NCOLS_1_7 &&
		desc->natts != KEYS_NCOLS_1_4 && desc->natts != KEYS_NCOLS_1_0)
		idem_catalog_refuse_replaced(what);
	for (int i = 0; i < desc->natts; i++)
	{
		Form_pg_attribute att = TupleDescAttr(desc, i);

		if (att->atttypid != idem_keys_columns[i].type ||
			att->attisdropped ||
			strcmp(NameStr(att->attname), idem_keys_columns[i].name) != 0)
			idem_catalog_refuse_replaced(what);
		/* Readers take these columns' values as given. */
		if (idem_keys_columns[i].not_null && !att->attnotnull)
			ereport(ERROR,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("column \"%s\" of %s has lost its NOT NULL constraint",
							idem_keys_columns[i].name, what),
					 errdetail("Extension \"idempotency\" creates it NOT NULL and relies on a value in every row."),
					 errhint("Restore the constraint with ALTER TABLE idempotency.%s ALTER COLUMN %s SET NOT NULL.",
							 RelationGetRelationName(heap),
							 quote_identifier(idem_keys_columns[i].name))));
	}
	pfree(what);
	return desc->natts;
}

/*
 * Is the predicate of "index" exactly "col IS [NOT] NULL" ("test")?  Read
 * from the stored node tree as it is, so that nothing in it runs.
 */
static bool
catalog_index_predicate_is(Relation index, AttrNumber col, NullTestType test)
{
	Datum		datum;
	bool		isnull;
	List	   *clauses;
	NullTest   *clause;

	datum = SysCacheGetAttr(INDEXRELID, index->rd_indextuple,
							Anum_pg_index_indpred, &isnull);
	if (isnull)
		return false;
	clauses = make_ands_implicit((Expr *) stringToNode(TextDatumGetCString(datum)));
	if (list_length(clauses) != 1 || !IsA(linitial(clauses), NullTest))
		return false;
	clause = linitial_node(NullTest, clauses);
	return clause->nulltesttype == test && !clause->argisrow &&
		IsA(clause->arg, Var) && ((Var *) clause->arg)->varattno == col;
}

/*
 * Refuse an index that is not the btree on "ncols" columns of the table
 * "keys" that the store scans directly (indexes are not extension members:
 * they belong to their table, so check what they index).  A partial one
 * ("pred_col" not 0) must have the predicate the extension gave it,
 * "pred_col IS [NOT] NULL" ("pred_test"): a direct write skips the index
 * for a row that predicate leaves out, without evaluating it.
 */
static void
catalog_check_index(Oid indexid, Oid keys, int ncols, AttrNumber col1,
					AttrNumber col2, AttrNumber pred_col,
					NullTestType pred_test)
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
		(pred_col == 0 ?
		 heap_attisnull(index->rd_indextuple, Anum_pg_index_indpred, NULL) :
		 catalog_index_predicate_is(index, pred_col, pred_test));
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

/*
 * The index "name" + "suffix" of the extension's schema, locked; refuses
 * (55000) when it is missing.
 */
static Oid
catalog_lock_index(const char *name, const char *suffix)
{
	char	   *full = psprintf("%s%s", name, suffix);
	Oid			relid = idem_catalog_lock_relation(full);

	if (!OidIsValid(relid))
		idem_catalog_refuse_missing(psprintf("index \"%s\"", full));
	pfree(full);
	return relid;
}

/*
 * Is "funcid" a LANGUAGE sql function that PostgreSQL may inline into an
 * index expression: a body kept as text (not BEGIN ATOMIC), no SET clause,
 * not SECURITY DEFINER?  Such a body is parsed with the search_path of
 * whichever session first builds the index's expressions (planning any
 * query of the table does), and the parsed tree is then kept and run by
 * every write, the owner's too.
 */
static bool
catalog_inlinable_sql_function(Oid funcid, void *context)
{
	HeapTuple	tuple;
	bool		inlinable;

	if (funcid < FirstNormalObjectId)
		return false;
	tuple = SearchSysCache1(PROCOID, ObjectIdGetDatum(funcid));
	if (!HeapTupleIsValid(tuple))
		return false;
	inlinable = ((Form_pg_proc) GETSTRUCT(tuple))->prolang == SQLlanguageId &&
		!((Form_pg_proc) GETSTRUCT(tuple))->prosecdef &&
		heap_attisnull(tuple, Anum_pg_proc_proconfig, NULL) &&
		heap_attisnull(tuple, Anum_pg_proc_prosqlbody, NULL);
	if (inlinable)
		*(Oid *) context = funcid;
	ReleaseSysCache(tuple);
	return inlinable;
}

static bool
catalog_inlines_walker(Node *node, void *context)
{
	if (node == NULL)
		return false;
	if (check_functions_in_node(node, catalog_inlinable_sql_function, context))
		return true;
	return expression_tree_walker(node, catalog_inlines_walker, context);
}

/*
 * Refuse an index whose expressions or predicate (as stored, before any
 * inlining) call a LANGUAGE sql function that PostgreSQL may inline
 * (catalog_inlinable_sql_function): a caller could have the function's
 * unqualified names resolved in a schema of its own, and the owner's
 * writes would then run that code.
 */
static void
catalog_refuse_inlined_function(Relation index)
{
	Oid			funcid = InvalidOid;

	for (int attr = Anum_pg_index_indexprs; attr != 0;
		 attr = attr == Anum_pg_index_indexprs ? Anum_pg_index_indpred : 0)
	{
		bool		isnull;
		Datum		d = SysCacheGetAttr(INDEXRELID, index->rd_indextuple, attr,
										&isnull);

		if (!isnull &&
			catalog_inlines_walker(stringToNode(TextDatumGetCString(d)), &funcid))
			ereport(ERROR,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("index \"%s\" of idempotency.keys calls SQL function %s, whose body PostgreSQL inlines with the search_path of the session that plans it",
							RelationGetRelationName(index),
							format_procedure(funcid)),
					 errhint("Give the function a search_path (ALTER FUNCTION ... SET search_path = pg_catalog) or a BEGIN ATOMIC body, or drop the index.")));
	}
}

/*
 * Can a write of the table run code that a user attached to it?  Triggers
 * (a foreign key that references the table has them), rules, row security
 * and stored generated columns run in the executor's statements; a CHECK
 * constraint and an index's expressions and predicate run in every write,
 * and may reach a user's code in ways no walk of the expression sees (a
 * domain's CHECK, a cast, a built-in that runs SQL or looks names up): so
 * any CHECK constraint and any index expression or predicate counts, but
 * the predicates of the extension's own partial indexes; so
 * do an access method, operator class or exclusion operator that is not
 * PostgreSQL's own.  Read from the catalog as stored, so the answer does
 * not depend on the session that asks.
 */
static bool
catalog_runs_user_code(Relation heap, const IdemCatalog *catalog)
{
	TupleConstr *constr = RelationGetDescr(heap)->constr;
	List	   *indexes;
	ListCell   *lc;
	bool		found = false;

	if (heap->trigdesc != NULL || heap->rd_rules != NULL ||
		heap->rd_rel->relrowsecurity ||
		heap->rd_rel->relam >= FirstNormalObjectId ||
		(constr != NULL && (constr->has_generated_stored || constr->num_check > 0)))
		found = true;
	indexes = RelationGetIndexList(heap);
	foreach(lc, indexes)
	{
		Relation	index = index_open(lfirst_oid(lc), AccessShareLock);
		int			nprocs = IndexRelationGetNumberOfKeyAttributes(index) *
			index->rd_indam->amsupport;

		catalog_refuse_inlined_function(index);
		found = found || index->rd_rel->relam >= FirstNormalObjectId ||
			!heap_attisnull(index->rd_indextuple, Anum_pg_index_indexprs, NULL) ||
			(RelationGetRelid(index) != catalog->session_idx &&
			 RelationGetRelid(index) != catalog->abandoned_idx &&
			 !heap_attisnull(index->rd_indextuple, Anum_pg_index_indpred, NULL));
		for (int i = 0; i < nprocs && !found; i++)
			found = index->rd_support[i] >= FirstNormalObjectId;
		if (index->rd_index->indisexclusion && !found)
		{
			Oid		   *operators;
			Oid		   *procs;
			uint16	   *strategies;

			RelationGetExclusionInfo(index, &operators, &procs, &strategies);
			for (int i = 0; i < IndexRelationGetNumberOfKeyAttributes(index); i++)
				found = found || procs[i] >= FirstNormalObjectId;
		}
		index_close(index, NoLock);
	}
	list_free(indexes);
	return found;
}

/*
 * The columns of the table that PostgreSQL's row locks count as its key:
 * those of any unique index (the primary key's scope and key, and any a
 * user added, say on token for a foreign key to reference).
 */
static uint32
catalog_key_columns(Relation heap, int ncols)
{
	Bitmapset  *attrs = RelationGetIndexAttrBitmap(heap, INDEX_ATTR_BITMAP_KEY);
	uint32		columns = 0;

	for (int col = 1; col <= ncols; col++)
		if (bms_is_member(col - FirstLowInvalidHeapAttributeNumber, attrs))
			columns |= KEYS_COL_BIT(col);
	bms_free(attrs);
	return columns;
}

/*
 * Does the table have a deferred (or deferrable) trigger that a user
 * wrote?  It fires at commit, outside the write that queued it, where the
 * extension can neither restrict it nor pin its search_path (and from
 * PostgreSQL 18 on it fires as the role that queued it: the table's
 * owner).  PostgreSQL's own foreign-key triggers are not such code.
 */
static bool
catalog_has_deferred_trigger(Relation heap)
{
	TriggerDesc *trigdesc = heap->trigdesc;

	for (int i = 0; trigdesc != NULL && i < trigdesc->numtriggers; i++)
		if (trigdesc->triggers[i].tgdeferrable &&
			trigdesc->triggers[i].tgfoid >= FirstNormalObjectId)
			return true;
	return false;
}

/*
 * Lock the indexes of the table found->keys, named as the extension names
 * them followed by "suffix" (Citus names a shard's relations after the
 * table's, with "_<shardid>" appended), and check the table and its
 * indexes: the columns the store uses, its owner, and the indexes it
 * scans directly.
 */
static void
catalog_check_store(IdemCatalog *found, const char *suffix)
{
	Relation	heap;

	found->pkey = catalog_lock_index("keys_pkey", suffix);
	found->sweep_idx = catalog_lock_index("keys_sweep_at_idx", suffix);
	heap = table_open(found->keys, AccessShareLock);
	found->ncols = catalog_check_columns(heap);
	found->owner = heap->rd_rel->relowner;
	found->deferred_trigger = catalog_has_deferred_trigger(heap);
	table_close(heap, NoLock);
	catalog_check_index(found->pkey, found->keys, 2, KEYS_COL_SCOPE, KEYS_COL_KEY,
						0, IS_NULL);
	catalog_check_index(found->sweep_idx, found->keys, 1, KEYS_COL_SWEEP_AT, 0,
						0, IS_NULL);
	if (found->ncols >= KEYS_COL_OWNER_SESSION)
	{
		found->session_idx = catalog_lock_index("keys_owner_session_idx",
												suffix);
		catalog_check_index(found->session_idx, found->keys, 1,
							KEYS_COL_OWNER_SESSION, 0,
							KEYS_COL_OWNER_SESSION, IS_NOT_NULL);
	}
	if (found->ncols >= KEYS_COL_REQUEST)
	{
		found->abandoned_idx = catalog_lock_index("keys_abandoned_idx",
												  suffix);
		catalog_check_index(found->abandoned_idx, found->keys, 2,
							KEYS_COL_SCOPE, KEYS_COL_CREATED_AT,
							KEYS_COL_TOKEN, IS_NULL);
	}
	heap = table_open(found->keys, AccessShareLock);
	found->user_code = catalog_runs_user_code(heap, found);
	found->key_columns = catalog_key_columns(heap, found->ncols);
	table_close(heap, NoLock);
}

/*
 * Is the table Citus distributes the one the extension made, distributed
 * the one way the store can serve: by hash of scope?  Sets
 * cached_distributed and cached_colocation for "found".
 */
static void
catalog_check_distribution(const IdemCatalog *found)
{
	char		method;
	int32		colocation;
	char	   *column;

	cached_distributed = false;
	if (!idem_citus_table(found->keys, &method, &colocation, &column))
		return;
	if (method != 'h' || column == NULL || strcmp(column, "scope") != 0)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("idempotency.keys is a Citus table not distributed by hash of scope"),
				 errhint("Undistribute it (undistribute_table) and run SELECT idempotency.distribute().")));
	cached_distributed = true;
	cached_colocation = colocation;
}

/*
 * The extension's relations, found and checked, each locked by this
 * transaction.  The names are looked up again as long as invalidations
 * arrive during the lookup, until the OIDs we hold locks on are the ones
 * the names mean.  Nothing is cached until every check passed, so an error
 * leaves the cache invalid and the next call looks again.  On a table
 * Citus distributes, these are the shell's.
 */
static const IdemCatalog *
catalog_base(void)
{
	IdemCatalog found;

	/*
	 * The first lock this transaction takes on the table accepts the
	 * invalidations queued meanwhile (a REINDEX CONCURRENTLY of an index,
	 * say): take it before trusting the cache, not after.  Once this
	 * (sub)transaction holds it, taking it again would accept nothing (a lock
	 * already held skips that step), so a call made under it returns the
	 * cache at once; a call makes a dozen of these per claim.
	 */
	if (cached_valid)
	{
		ResourceOwner owner = CurrentResourceOwner;

		if (locked_lxid == IDEM_MY_LXID &&
			locked_subxid == GetCurrentSubTransactionId())
			return &cached;
		CurrentResourceOwner = CurTransactionResourceOwner;
		LockRelationOid(cached.keys, AccessShareLock);
		CurrentResourceOwner = owner;
		if (cached_valid)
		{
			locked_lxid = IDEM_MY_LXID;
			locked_subxid = GetCurrentSubTransactionId();
			return &cached;
		}
	}
	if (!callback_registered)
	{
		CacheRegisterRelcacheCallback(catalog_relcache_callback, (Datum) 0);
		RegisterXactCallback(catalog_xact_callback, NULL);
		callback_registered = true;
	}
	for (;;)
	{
		uint64		inval_count = SharedInvalidMessageCounter;

		memset(&found, 0, sizeof(found));
		found.keys = idem_catalog_lock_relation("keys");
		found.token_seq = idem_catalog_lock_relation("token_seq");
		if (!OidIsValid(found.keys) || !OidIsValid(found.token_seq))
			catalog_refuse_not_installed();
		if (inval_count != SharedInvalidMessageCounter)
			continue;			/* a name may have moved: look again */
		idem_catalog_check_member(found.keys);
		idem_catalog_check_member(found.token_seq);
		catalog_check_store(&found, "");
		catalog_check_distribution(&found);
		if (inval_count == SharedInvalidMessageCounter)
			break;
	}

	/*
	 * Publish at once: an invalidation that arrives from here on clears the
	 * cache through the callback, which compares against these OIDs.  The
	 * next call takes the table's lock once more, under the transaction's own
	 * resource owner.
	 */
	cached = found;
	cached_valid = true;
	locked_lxid = InvalidLocalTransactionId;
	return &cached;
}

/*
 * The relations the store reads and writes: the extension's, or on a
 * distributed table those of the shard this transaction selected last.
 */
const IdemCatalog *
idem_catalog(void)
{
	const IdemCatalog *base = catalog_base();

	if (!cached_distributed)
		return base;
	if (selected == NULL)
		elog(ERROR, "idempotency: no shard of the distributed idempotency.keys is selected");
	return selected;
}

/* Does Citus distribute idempotency.keys? */
bool
idem_catalog_distributed(void)
{
	(void) catalog_base();
	return cached_distributed;
}

/* Load the shard map of the distributed table. */
static void
catalog_load_shards(void)
{
	IdemShard  *shards;
	int			n;

	if (shard_cxt == NULL)
		shard_cxt = AllocSetContextCreate(TopMemoryContext,
										  "idempotency shard map",
										  ALLOCSET_SMALL_SIZES);
	selected = NULL;
	MemoryContextReset(shard_cxt);
	shard_entries = NULL;
	nshard_entries = 0;
	n = idem_citus_shards(cached.keys, &shards, CurrentMemoryContext);
	shard_entries = MemoryContextAllocZero(shard_cxt,
										   sizeof(ShardEntry) * Max(n, 1));
	for (int i = 0; i < n; i++)
		shard_entries[i].shard = shards[i];
	nshard_entries = n;
	pfree(shards);
	shards_valid = true;
}

/* The shard whose hash range holds "hash", or NULL. */
static ShardEntry *
catalog_shard_of(int32 hash)
{
	int			lo = 0;
	int			hi = nshard_entries - 1;

	while (lo <= hi)
	{
		int			mid = lo + (hi - lo) / 2;
		ShardEntry *e = &shard_entries[mid];

		if (hash < e->shard.min)
			hi = mid - 1;
		else if (hash > e->shard.max)
			lo = mid + 1;
		else
			return e;
	}
	return NULL;
}

/*
 * Lock and check the relations of a local shard (Citus names them by its
 * id).
 */
static void
catalog_check_shard(ShardEntry *e)
{
	IdemCatalog found;
	char	   *suffix = psprintf("_" INT64_FORMAT, e->shard.shardid);
	char	   *name = psprintf("keys%s", suffix);

	memset(&found, 0, sizeof(found));
	found.shardid = e->shard.shardid;
	found.token_seq = cached.token_seq;
	found.keys = idem_catalog_lock_relation(name);
	if (!OidIsValid(found.keys))
		idem_catalog_refuse_missing(psprintf("shard \"%s\"", name));
	catalog_check_store(&found, suffix);
	pfree(name);
	pfree(suffix);
	e->catalog = found;
	e->checked = true;
}

/*
 * Select the local shard "e" for the rest of the transaction: Citus's lock
 * on its metadata first (a move waits for us, or we for it), then its
 * relations.  False when the shard map changed meanwhile: look again.
 */
static bool
catalog_select_shard(ShardEntry *e)
{
	if (idem_citus_lock_shard(cached_colocation, e->shard.index))
		AcceptInvalidationMessages();
	if (!cached_valid || !shards_valid)
		return false;
	if (!e->checked)
		catalog_check_shard(e);
	else
		LockRelationOid(e->catalog.keys, AccessShareLock);
	if (!shards_valid || !e->checked)
		return false;
	selected = &e->catalog;
	return true;
}

/* Is this session one of Citus's own connections (a delegated call)? */
static bool
catalog_citus_connection(void)
{
	const char *name = GetConfigOption("application_name", true, false);

	return name != NULL && strncmp(name, "citus_internal", 14) == 0;
}

/*
 * Make the store work on the relations that hold "scope"'s keys: nothing
 * to do on a table Citus does not distribute; else the shard of the
 * scope, which must be on this node.  A call reaches the right node when
 * Citus delegates it there (SELECT * FROM idempotency.idem_claim(...) on
 * the coordinator, with the functions distributed by scope).
 */
void
idem_catalog_select_scope(text *scope)
{
	bool		was_local = false;
	int32		hash;

	(void) catalog_base();
	if (!cached_distributed)
		return;
	hash = idem_citus_hash(scope);
	for (;;)
	{
		ShardEntry *e;

		if (!cached_valid)
		{
			(void) catalog_base();
			if (!cached_distributed)
				return;
		}
		if (!shards_valid)
			catalog_load_shards();
		e = catalog_shard_of(hash);
		if (e == NULL)
			ereport(ERROR,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("no shard of idempotency.keys holds scope \"%s\"",
							text_to_cstring(scope))));
		if (!e->shard.local)
		{
			/*
			 * Citus sent this call here (its connections name themselves
			 * citus_internal) by metadata that a shard move changed since:
			 * retryable, like a move that finished while we waited.
			 */
			if (was_local || catalog_citus_connection())
				ereport(ERROR,
						(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
						 errmsg("the shard holding idempotency scope \"%s\" moved to another node",
								text_to_cstring(scope)),
						 errhint("Retry the call.")));
			ereport(ERROR,
					(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
					 errmsg("idempotency scope \"%s\" is stored on another node",
							text_to_cstring(scope)),
					 errdetail("Citus distributes idempotency.keys; shard " INT64_FORMAT " holds this scope and this node has no placement of it.",
							   e->shard.shardid),
					 errhint("Call the function on its own in a SELECT on the coordinator, so that Citus delegates it to that node; run SELECT idempotency.distribute() to set the functions up for that.")));
		}
		was_local = true;
		if (catalog_select_shard(e))
			return;
	}
}

/*
 * How many relations hold keys on this node: 1, or on a distributed table
 * the number of shards placed here (0 on a coordinator that holds none).
 * The shard map it counts stays as it is until the transaction selects a
 * shard by scope or the map is invalidated.
 */
int
idem_catalog_local_count(void)
{
	int			n = 0;

	(void) catalog_base();
	if (!cached_distributed)
		return 1;
	if (!shards_valid)
		catalog_load_shards();
	for (int i = 0; i < nshard_entries; i++)
		if (shard_entries[i].shard.local)
			n++;
	return n;
}

/*
 * Select the "i"th relation of idem_catalog_local_count's.  Returns false
 * when it is gone (the shard map changed since it was counted: a shard
 * moved away); the caller skips it.
 */
bool
idem_catalog_select_local(int i)
{
	(void) catalog_base();
	if (!cached_distributed)
		return true;
	if (!shards_valid)
		return false;
	for (int j = 0; j < nshard_entries; j++)
	{
		ShardEntry *e = &shard_entries[j];

		if (!e->shard.local)
			continue;
		if (i-- == 0)
			return catalog_select_shard(e) && selected == &e->catalog;
	}
	return false;
}

/*
 * The relation this node reads for the extension's table "relid" (found as
 * "name"): the table itself, or when Citus made it a reference table the
 * local placement of its one shard.  A reference table without a local
 * placement is refused: this node cannot see its rows.
 */
Oid
idem_catalog_local_shard(Oid relid, const char *name)
{
	char		method;
	int32		colocation;
	char	   *column;
	IdemShard  *shards;
	int			n;
	Oid			shard = InvalidOid;

	if (!idem_citus_table(relid, &method, &colocation, &column))
		return relid;
	n = idem_citus_shards(relid, &shards, CurrentMemoryContext);
	if (method == 'n' && n == 1 && shards[0].local)
		shard = idem_catalog_lock_relation(psprintf("%s_" INT64_FORMAT, name,
													shards[0].shardid));
	if (!OidIsValid(shard))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("this node holds no placement of idempotency.%s", name),
				 errhint("Run SELECT idempotency.distribute() on the coordinator.")));
	return shard;
}
