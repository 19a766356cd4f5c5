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
 * that every backend receives.  With no bindings at all the check costs a cached boolean.
 * Must not touch idempotency.keys.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/table.h"
#include "catalog/namespace.h"
#include "catalog/pg_type.h"
#include "commands/trigger.h"
#include "access/tableam.h"
#include "executor/tuptable.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"

#include "idempotency.h"

typedef struct Binding
{
	Oid			role;
	char	   *prefix;
	int			prefix_len;
} Binding;

static bool cache_valid = false;
static bool callback_registered = false;
static Oid	bindings_relid = InvalidOid;
static Binding *bindings = NULL;
static int	nbindings = 0;
static MemoryContext cache_cxt = NULL;

PG_FUNCTION_INFO_V1(idem_scope_bindings_changed);

/* Drop the cache when the bindings table changes (or on a full reset). */
static void
tenant_relcache_callback(Datum arg, Oid relid)
{
	if (relid == InvalidOid || relid == bindings_relid)
		cache_valid = false;
}

/*
 * Load every binding.  Reads the table directly with the latest snapshot,
 * as PostgreSQL's own caches read catalogs: the transaction's snapshot
 * (REPEATABLE READ) could predate the change whose invalidation made us
 * reload, and we would keep the stale list.  The cache is marked valid
 * before reading, so an invalidation that arrives meanwhile wins.
 */
static void
tenant_load(void)
{
	Oid			nsp;
	Relation	rel;
	TableScanDesc scan;
	TupleTableSlot *slot;
	Snapshot	snapshot;
	int			allocated = 0;

	if (!callback_registered)
	{
		CacheRegisterRelcacheCallback(tenant_relcache_callback, (Datum) 0);
		callback_registered = true;
	}
	if (cache_cxt == NULL)
		cache_cxt = AllocSetContextCreate(TopMemoryContext,
										  "idempotency scope bindings",
										  ALLOCSET_SMALL_SIZES);
	MemoryContextReset(cache_cxt);
	bindings = NULL;
	nbindings = 0;
	cache_valid = true;

	nsp = get_namespace_oid("idempotency", true);
	bindings_relid = OidIsValid(nsp) ?
		get_relname_relid("scope_bindings", nsp) : InvalidOid;
	if (!OidIsValid(bindings_relid))
		return;

	idem_store_check_member(bindings_relid);
	rel = table_open(bindings_relid, AccessShareLock);
	if (RelationGetNumberOfAttributes(rel) != 2 ||
		TupleDescAttr(RelationGetDescr(rel), 0)->atttypid != REGROLEOID ||
		TupleDescAttr(RelationGetDescr(rel), 1)->atttypid != TEXTOID)
		elog(ERROR, "table \"idempotency.scope_bindings\" does not have the expected columns");
	snapshot = RegisterSnapshot(GetLatestSnapshot());
	slot = table_slot_create(rel, NULL);
	scan = table_beginscan(rel, snapshot, 0, NULL);
	while (table_scan_getnextslot(scan, ForwardScanDirection, slot))
	{
		bool		isnull;
		Datum		role = slot_getattr(slot, 1, &isnull);
		Datum		prefix = slot_getattr(slot, 2, &isnull);
		char	   *p;

		if (nbindings == allocated)
		{
			allocated = Max(8, allocated * 2);
			bindings = bindings == NULL ?
				MemoryContextAlloc(cache_cxt, sizeof(Binding) * allocated) :
				repalloc(bindings, sizeof(Binding) * allocated);
		}
		p = TextDatumGetCString(prefix);
		bindings[nbindings].role = DatumGetObjectId(role);
		bindings[nbindings].prefix = MemoryContextStrdup(cache_cxt, p);
		bindings[nbindings].prefix_len = strlen(p);
		nbindings++;
		pfree(p);
	}
	table_endscan(scan);
	ExecDropSingleTupleTableSlot(slot);
	UnregisterSnapshot(snapshot);
	table_close(rel, AccessShareLock);
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
