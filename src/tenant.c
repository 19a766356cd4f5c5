/*-------------------------------------------------------------------------
 *
 * tenant.c
 *	  Scope bindings: which scopes a role may use.
 *
 * Owns the check that binds a calling role to its scope prefix
 * (idempotency.scope_bindings) and the backend-local cache of that table.
 * The role checked is the current user at the moment of the call: the
 * client functions are not SECURITY DEFINER, so that is the role that
 * called them.  The cache is reloaded, with the latest snapshot, after any
 * change to the table: its statement trigger sends a relcache invalidation
 * that every backend receives.  With no bindings at all the check costs a
 * cached boolean.
 * Must not read idempotency.keys, but for whether Citus distributes it:
 * then the bindings must be a reference table, read from this node's
 * placement.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/table.h"
#include "catalog/pg_type.h"
#include "commands/trigger.h"
#include "access/tableam.h"
#include "executor/tuptable.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/inval.h"
#include "utils/memutils.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"
#include "storage/lmgr.h"

#include "idempotency.h"

typedef struct Binding
{
	Oid			role;
	char	   *prefix;
	int			prefix_len;
} Binding;

/*
 * The published cache.  A load builds a new list aside and publishes it
 * only once complete: an error in the middle of a load (a lock timeout, a
 * cancel, out of memory) leaves cache_valid false, so the next call loads
 * again instead of trusting a half-read list.  An empty list that is
 * valid means "nobody is bound", which lets every role through.
 */
static bool cache_valid = false;
static Binding *bindings = NULL;
static int	nbindings = 0;
static MemoryContext cache_cxt = NULL;

/*
 * Set by the relcache callback.  A load clears it once it holds its lock on
 * the table and publishes the list as valid only if it is still clear at
 * the end: a change that committed while we were reading invalidates what
 * we read.
 */
static bool invalidated_during_load = false;
static Oid	bindings_relid = InvalidOid;
static bool callback_registered = false;

/*
 * The relation the bindings are read from: the table itself, or on Citus
 * the local placement of the reference table it was made.  Citus writes a
 * reference table's placements on every node without firing the table's
 * trigger there, so nothing tells a node's backends that the bindings
 * changed: on Citus the list is read again at every call.
 */
static Oid	read_relid = InvalidOid;
static Oid	bindings_relid_read_for = InvalidOid;
static bool read_relid_valid = false;

PG_FUNCTION_INFO_V1(idem_scope_bindings_changed);

/* Drop the cache when the bindings table changes (or on a full reset). */
static void
tenant_relcache_callback(Datum arg, Oid relid)
{
	if (relid == InvalidOid || relid == bindings_relid)
	{
		cache_valid = false;
		invalidated_during_load = true;
		read_relid_valid = false;
	}
}

/* Append one binding to the list under construction. */
static void
tenant_add(Binding **list, int *n, int *allocated, MemoryContext cxt,
		   Oid role, const char *prefix)
{
	if (*n == *allocated)
	{
		*allocated = Max(8, *allocated * 2);
		*list = *list == NULL ?
			MemoryContextAlloc(cxt, sizeof(Binding) * *allocated) :
			repalloc(*list, sizeof(Binding) * *allocated);
	}
	(*list)[*n].role = role;
	(*list)[*n].prefix = MemoryContextStrdup(cxt, prefix);
	(*list)[*n].prefix_len = strlen(prefix);
	(*n)++;
}

/*
 * Load every binding and publish the list.  Reads the table directly with
 * the latest snapshot, as PostgreSQL's own caches read catalogs: the
 * transaction's snapshot (REPEATABLE READ) could predate the change whose
 * invalidation made us reload, and we would keep the stale list.
 *
 * The list is built in a memory context that belongs to the current
 * transaction until the load completes, so an error anywhere in between
 * frees it with the transaction and leaves the published cache untouched
 * and invalid.
 */
static void
tenant_load(void)
{
	Oid			relid;
	Relation	rel;
	TableScanDesc scan;
	TupleTableSlot *slot;
	Snapshot	snapshot;
	MemoryContext load_cxt;
	Binding    *list = NULL;
	int			n = 0;
	int			allocated = 0;

	if (!callback_registered)
	{
		CacheRegisterRelcacheCallback(tenant_relcache_callback, (Datum) 0);
		callback_registered = true;
	}
	load_cxt = AllocSetContextCreate(CurrentMemoryContext,
									 "idempotency scope bindings",
									 ALLOCSET_SMALL_SIZES);

	/*
	 * A missing table refuses the call: without it nobody can tell which
	 * roles are bound.
	 */
	relid = idem_catalog_lock_relation("scope_bindings");
	if (!OidIsValid(relid))
		idem_catalog_refuse_missing("table \"idempotency.scope_bindings\"");
	/* The callback recognises the table from here on. */
	bindings_relid = relid;
	/* Invalidations queued before the lock are in what we read now. */
	invalidated_during_load = false;
	idem_catalog_check_member(relid);
	if (!read_relid_valid || relid != bindings_relid_read_for)
	{
		read_relid = idem_catalog_local_shard(relid, "scope_bindings");
		bindings_relid_read_for = relid;
		read_relid_valid = true;
	}
	else if (read_relid != relid)
		LockRelationOid(read_relid, AccessShareLock);

	/*
	 * With keys distributed, bindings kept in a plain table would be seen by
	 * the node where they were made only: refuse rather than let a bound role
	 * through on the others.
	 */
	if (read_relid == relid && idem_catalog_distributed())
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idempotency.keys is distributed but idempotency.scope_bindings is not a reference table"),
				 errhint("Run SELECT idempotency.distribute() on the coordinator.")));
	rel = table_open(read_relid, NoLock);
	if (RelationGetNumberOfAttributes(rel) != 2 ||
		TupleDescAttr(RelationGetDescr(rel), 0)->atttypid != REGROLEOID ||
		TupleDescAttr(RelationGetDescr(rel), 1)->atttypid != TEXTOID)
		idem_catalog_refuse_replaced("table \"idempotency.scope_bindings\"");
	snapshot = RegisterSnapshot(GetLatestSnapshot());
	slot = table_slot_create(rel, NULL);
	scan = table_beginscan(rel, snapshot, 0, NULL);
	while (table_scan_getnextslot(scan, ForwardScanDirection, slot))
	{
		bool		role_null;
		bool		prefix_null;
		Datum		role = slot_getattr(slot, 1, &role_null);
		Datum		prefix = slot_getattr(slot, 2, &prefix_null);
		char	   *p;

		CHECK_FOR_INTERRUPTS();
		if (role_null || prefix_null)
			ereport(ERROR,
					(errcode(ERRCODE_DATA_CORRUPTED),
					 errmsg("table \"idempotency.scope_bindings\" has a row with a NULL role or prefix"),
					 errhint("Someone changed the table's constraints; delete that row.")));
		p = TextDatumGetCString(prefix);
		tenant_add(&list, &n, &allocated, load_cxt,
				   DatumGetObjectId(role), p);
		pfree(p);
	}
	table_endscan(scan);
	ExecDropSingleTupleTableSlot(slot);
	UnregisterSnapshot(snapshot);
	table_close(rel, AccessShareLock);

	/* Complete: publish.  Nothing below can fail. */
	MemoryContextSetParent(load_cxt, TopMemoryContext);
	if (cache_cxt != NULL)
		MemoryContextDelete(cache_cxt);
	cache_cxt = load_cxt;
	bindings = list;
	nbindings = n;

	/*
	 * The list serves this call either way; it is kept for later calls only
	 * if no change to the table arrived while we read it.
	 */
	cache_valid = !invalidated_during_load && read_relid == relid;
}

/*
 * Raise 42501 unless the calling role may use "scope": a role with a
 * binding may only use scopes that start with its prefix.
 */
void
idem_tenant_check(text *scope)
{
	Oid			role = GetUserId();

	if (!cache_valid)
		tenant_load();
	for (int i = 0; i < nbindings; i++)
	{
		if (bindings[i].role != role)
			continue;
		if (VARSIZE_ANY_EXHDR(scope) < bindings[i].prefix_len ||
			memcmp(VARDATA_ANY(scope), bindings[i].prefix,
				   bindings[i].prefix_len) != 0)
			ereport(ERROR,
					(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
					 errmsg("permission denied for idempotency scope \"%s\"",
							text_to_cstring(scope)),
					 errdetail("Role \"%s\" may only use scopes that start with \"%s\".",
							   GetUserNameFromId(role, false),
							   bindings[i].prefix)));
		return;
	}
}

/*
 * Statement trigger on idempotency.scope_bindings: make every backend
 * reload its cache after this transaction commits.
 */
Datum
idem_scope_bindings_changed(PG_FUNCTION_ARGS)
{
	TriggerData *trigdata = (TriggerData *) fcinfo->context;

	if (!CALLED_AS_TRIGGER(fcinfo))
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("scope_bindings_changed() must be called as a trigger")));
	CacheInvalidateRelcache(trigdata->tg_relation);
	PG_RETURN_POINTER(NULL);
}
