/*-------------------------------------------------------------------------
 *
 * lookup.c
 *	  idem_lookup: what is stored under a key, without claiming it.
 *
 * Owns the lookup's result row.  Reads through the caller's snapshot, so
 * it works on a hot standby and in read-only transactions, and it never
 * locks or writes.  A key past its retention is absent, as it is to a
 * claim, even before a sweep deletes it, unless it is remembered: then its
 * outcome shows without its response, even before a sweep compacts it.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "fmgr.h"
#include "funcapi.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

#include "args.h"
#include "idempotency.h"

PG_FUNCTION_INFO_V1(idem_lookup);
/*
 * Columns of idem_lookup's result row (1.7; older installations declare
 * the first 7 or 8, and get those).
 */
#define LOOKUP_RESULT_COLS		9
/*
 * idem_lookup(key, scope) RETURNS TABLE (status, attempt, response_code,
 *		response_body, created_at, finished_at, expires_at, phase,
 *		remembered_until)
 * Reads through the caller's snapshot; works on a hot standby.  Before 1.4
 * the row has no phase column, before 1.7 no remembered_until (the
 * executor's row type says).
 */
Datum
idem_lookup(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	text	   *key = idem_arg_name(fcinfo, 0, "key", false);
	text	   *scope = idem_arg_name(fcinfo, 1, "scope", true);
	IdemRow		row;
	Datum		values[LOOKUP_RESULT_COLS];
	bool		nulls[LOOKUP_RESULT_COLS] = {0};
	TimestampTz now;
	TimestampTz remembered_until = 0;
	bool		remembered;
	bool		past;

	idem_tenant_check(scope);
	idem_catalog_select_scope(scope);
	idem_result_init(fcinfo);
	idem_row_probe(scope, key, IDEM_PROBE_SNAPSHOT, true, &row);
	now = GetCurrentTimestamp();
	past = row.found && row.expires_at <= now;
	if (!row.found || (past && !idem_row_remembered(&row, now)))
		PG_RETURN_VOID();
	remembered = idem_row_remembered_until(&row, &remembered_until);

	values[0] = CStringGetTextDatum(idem_status_names[row.status]);
	values[1] = Int32GetDatum(row.attempt);
	values[2] = Int32GetDatum(row.response_code);
	nulls[2] = !row.has_response_code;
	/* a remembered key's response is gone, compacted or not yet */
	values[3] = (row.response_body != (Datum) 0 && !past) ?
		PointerGetDatum(PG_DETOAST_DATUM(row.response_body)) : (Datum) 0;
	nulls[3] = (values[3] == (Datum) 0);
	values[4] = TimestampTzGetDatum(row.created_at);
	values[5] = TimestampTzGetDatum(row.finished_at);
	nulls[5] = !row.has_finished_at;
	values[6] = TimestampTzGetDatum(row.expires_at);
	values[7] = past ? (Datum) 0 : row.phase;
	nulls[7] = (values[7] == (Datum) 0);
	values[8] = TimestampTzGetDatum(remembered_until);
	nulls[8] = !remembered;
	tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	PG_RETURN_VOID();
}
