/*-------------------------------------------------------------------------
 *
 * forget.c
 *	  idem_forget: an operator removes a finished key on purpose.
 *
 * Owns the one call that deletes a key without its token: a finished key,
 * live or remembered, goes, so that the next claim of it runs the request
 * again (a refund, a corrected order).  A pending key is refused (its
 * attempt may still be running: it is released with its token, or taken
 * over when its lease ends), and a key another transaction is changing
 * right now is refused rather than waited on.  Not executable by PUBLIC.
 * Arguments are checked by args.c; the delete goes through write.c under
 * the key's lock (keylock.c).  Must not decide claims or sweeps.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "fmgr.h"
#include "utils/timestamp.h"

#include "args.h"
#include "idempotency.h"

PG_FUNCTION_INFO_V1(idem_forget);

/*
 * idem_forget(key, scope) RETURNS boolean: true when a finished or
 * remembered key was deleted, false when there was none (absent, or past
 * its retention and not remembered).
 */
Datum
idem_forget(PG_FUNCTION_ARGS)
{
	text	   *key = idem_arg_name(fcinfo, 0, "key", false);
	text	   *scope = idem_arg_name(fcinfo, 1, "scope", true);
	uint64		hash;
	IdemRow		row;
	TimestampTz now;

	idem_check_writable("idem_forget()");
	idem_tenant_check(scope);
	idem_catalog_select_scope(scope);
	hash = idem_key_hash(scope, key);
	(void) idem_key_lock(hash, true);
	idem_row_probe(scope, key, IDEM_PROBE_LATEST, false, &row);
	now = GetCurrentTimestamp();

	if (row.busy || (row.found && row.locked))
		ereport(ERROR,
				(errcode(ERRCODE_LOCK_NOT_AVAILABLE),
				 errmsg("could not forget idempotency key %s",
						idem_key_display(scope, key)),
				 errdetail("Another transaction is changing or locking it right now."),
				 errhint("Try again once that transaction ends.")));
	if (!row.found ||
		(row.expires_at <= now && !idem_row_remembered(&row, now)))
	{
		idem_key_unlock(hash);
		PG_RETURN_BOOL(false);
	}
	if (row.status == IDEM_PENDING)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idempotency key %s is pending",
						idem_key_display(scope, key)),
				 errdetail("Its attempt may still be running; only a finished key can be forgotten."),
				 errhint("Release it with its token, or claim it once its lease has ended.")));
	idem_row_check_snapshot(&row);
	idem_write_release(&row);
	idem_key_wrote(hash);
	idem_key_unlock(hash);
	PG_RETURN_BOOL(true);
}
