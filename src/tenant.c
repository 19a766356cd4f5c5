/*-------------------------------------------------------------------------
 *
 * tenant.c
 *	  Scope bindings: which scopes a role may use.
 *
 * Owns the check that binds a calling role to its scope prefix
 * (idempotency.scope_bindings) and the backend-local cache of that table.
 * The role checked is the current user at the moment of the call: the
 * client functions are not SECURITY DEFINER, so that is the role that
 * called them.  The cache is reloaded after any change to the table: its
 * statement trigger sends a relcache invalidation that every backend
 * receives.  With no bindings at all the check costs a cached boolean.
 * Must not touch idempotency.keys.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/table.h"
#include "catalog/namespace.h"
#include "commands/trigger.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/rel.h"

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

/* The owner of the bindings table. */
static Oid
tenant_owner(void)
{
	Relation	rel = table_open(bindings_relid, AccessShareLock);
	Oid			owner = rel->rd_rel->relowner;

	table_close(rel, NoLock);
	return owner;
}

/* Load every binding, as the table's owner (callers have no privilege). */
static void
tenant_load(void)
{
	Oid			nsp;
	Oid			save_userid;
	int			save_sec;
	int			rc;

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

	nsp = get_namespace_oid("idempotency", true);
	bindings_relid = OidIsValid(nsp) ?
		get_relname_relid("scope_bindings", nsp) : InvalidOid;
	if (!OidIsValid(bindings_relid))
	{
		cache_valid = true;
		return;
	}

	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	GetUserIdAndSecContext(&save_userid, &save_sec);
	SetUserIdAndSecContext(tenant_owner(),
						   save_sec | SECURITY_LOCAL_USERID_CHANGE |
						   SECURITY_RESTRICTED_OPERATION);
	rc = SPI_execute("SELECT role::pg_catalog.oid, scope_prefix "
					 "FROM idempotency.scope_bindings", true, 0);
	SetUserIdAndSecContext(save_userid, save_sec);
	if (rc != SPI_OK_SELECT)
		elog(ERROR, "could not read idempotency.scope_bindings: %s",
			 SPI_result_code_string(rc));

	if (SPI_processed > 0)
	{
		bindings = MemoryContextAlloc(cache_cxt,
									  sizeof(Binding) * SPI_processed);
		for (uint64 i = 0; i < SPI_processed; i++)
		{
			HeapTuple	tup = SPI_tuptable->vals[i];
			TupleDesc	desc = SPI_tuptable->tupdesc;
			bool		isnull;
			char	   *prefix;

			bindings[i].role = DatumGetObjectId(SPI_getbinval(tup, desc, 1,
															  &isnull));
			prefix = TextDatumGetCString(SPI_getbinval(tup, desc, 2,
													   &isnull));
			bindings[i].prefix = MemoryContextStrdup(cache_cxt, prefix);
			bindings[i].prefix_len = strlen(prefix);
		}
		nbindings = (int) SPI_processed;
	}
	SPI_finish();
	cache_valid = true;
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
