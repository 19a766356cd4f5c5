/*-------------------------------------------------------------------------
 *
 * args.c
 *	  Reading and checking the SQL functions' arguments, and setting up
 *	  their result rows.
 *
 * Owns every check of a bad input that does not depend on a stored row:
 * NULLs, empty and too long keys and scopes, intervals that are not
 * positive or too large, negative waits, unknown statuses, response bodies
 * over idempotency.max_response_size, batch arrays of the wrong shape or
 * length, and calls that would write in a read-only transaction or on a
 * standby.  Each raises its own SQLSTATE with one message for every
 * function that takes the argument, before anything is read or written.
 * Must not read or write the table: the callers (claim.c, holder.c,
 * lookup.c, sweep.c) do that once their arguments pass.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/detoast.h"
#include "catalog/pg_type.h"
#include "common/int.h"
#include "funcapi.h"
#include "mb/pg_wchar.h"
#include "miscadmin.h"
#include "tcop/utility.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"
#include "utils/timestamp.h"

#include "args.h"

/*
 * The longest lease or retention, 10000 years as interval comparison counts
 * them (12 months of 30 days): keeps every deadline a valid timestamp.
 */
#define INTERVAL_MAX_US			(INT64CONST(10000) * MONTHS_PER_YEAR * \
								 DAYS_PER_MONTH * USECS_PER_DAY)
/* The longest wait: a hundred years is as good as forever. */
#define WAIT_MAX_US				(INT64CONST(100) * 365 * USECS_PER_DAY)

/* ---------------------------------------------------------------------
 * Argument checks
 * ---------------------------------------------------------------------
 */

/* Raise 22004 when argument "argno" is NULL. */
void
idem_arg_not_null(FunctionCallInfo fcinfo, int argno, const char *name)
{
	if (PG_ARGISNULL(argno))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("%s must not be null", name)));
}

/*
 * A key, scope or phase: at most 255 characters, and (unless allow_empty)
 * not empty.
 */
void
idem_check_name(text *t, const char *name, bool allow_empty)
{
	int			bytes = VARSIZE_ANY_EXHDR(t);

	if (bytes == 0 && !allow_empty)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must not be empty", name)));
	/* A character takes at least one byte: count only when it matters. */
	if (bytes > IDEM_MAX_KEY_CHARS)
	{
		int			chars = pg_mbstrlen_with_len(VARDATA_ANY(t), bytes);

		if (chars > IDEM_MAX_KEY_CHARS)
			ereport(ERROR,
					(errcode(ERRCODE_STRING_DATA_RIGHT_TRUNCATION),
					 errmsg("%s is too long", name),
					 errdetail("It has %d characters; the limit is %d.",
							   chars, IDEM_MAX_KEY_CHARS)));
	}
}

/* A key or scope argument: not NULL, and as idem_check_name says. */
text *
idem_arg_name(FunctionCallInfo fcinfo, int argno, const char *name,
			  bool allow_empty)
{
	text	   *t;

	idem_arg_not_null(fcinfo, argno, name);
	t = PG_GETARG_TEXT_PP(argno);
	idem_check_name(t, name, allow_empty);
	return t;
}

/* An optional interval argument; NULL when the SQL value is NULL. */
Interval *
idem_arg_interval(FunctionCallInfo fcinfo, int argno)
{
	return PG_ARGISNULL(argno) ? NULL : PG_GETARG_INTERVAL_P(argno);
}

/* An interval of "ms" milliseconds (the value of a setting). */
Interval *
idem_interval_from_ms(int64 ms)
{
	Interval   *iv = palloc0(sizeof(Interval));

	iv->time = ms * INT64CONST(1000);
	return iv;
}

/* now + iv on the calendar, as timestamptz + interval does. */
TimestampTz
idem_add_interval(TimestampTz now, Interval *iv)
{
	return DatumGetTimestampTz(DirectFunctionCall2(timestamptz_pl_interval,
												   TimestampTzGetDatum(now),
												   IntervalPGetDatum(iv)));
}

/*
 * The length of an interval in microseconds, months counted as 30 days (as
 * interval comparison does).  Returns false when it does not fit in 64 bits.
 */
static bool
interval_span(Interval *iv, int64 *us)
{
	int64		days_us;
	int64		months_us;

	return !(pg_mul_s64_overflow((int64) iv->day, USECS_PER_DAY, &days_us) ||
			 pg_mul_s64_overflow((int64) iv->month,
								 DAYS_PER_MONTH * USECS_PER_DAY, &months_us) ||
			 pg_add_s64_overflow(iv->time, days_us, us) ||
			 pg_add_s64_overflow(*us, months_us, us));
}

/*
 * Raise 22023 unless the interval "iv" (named "name") is positive, or with
 * "allow_zero" zero or positive; no longer than 10000 years either way.
 */
static void
check_interval(Interval *iv, const char *name, bool allow_zero)
{
	TimestampTz now;
	int64		us = 0;

	if (!interval_span(iv, &us))
		us = (iv->time < 0 || iv->day < 0 || iv->month < 0) ?
			PG_INT64_MIN : PG_INT64_MAX;
	if (us < 0 || (us == 0 && !allow_zero))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 allow_zero ? errmsg("%s must not be negative", name) :
				 errmsg("%s must be positive", name)));
	if (us > INTERVAL_MAX_US)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s is too large", name),
				 errdetail("The limit is 10000 years.")));
	now = GetCurrentTimestamp();
	if (us > 0 && idem_add_interval(now, iv) <= now)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 allow_zero ? errmsg("%s must not be negative", name) :
				 errmsg("%s must be positive", name)));
}

/* Raise 22023 unless the interval "iv" (named "name") is positive. */
void
idem_check_positive(Interval *iv, const char *name)
{
	if (iv != NULL)
		check_interval(iv, name, false);
}

/*
 * The remember argument at "argno" (1.7; an older installation declares
 * none, which reads as NULL).  Returns false when it is NULL: the caller
 * takes its default.  Otherwise *remember is the time to remember the key,
 * or NULL for a zero interval (not remembered).
 */
bool
idem_arg_remember(FunctionCallInfo fcinfo, int argno, Interval **remember)
{
	Interval   *iv;
	int64		us = 0;

	*remember = NULL;
	if (PG_NARGS() <= argno || PG_ARGISNULL(argno))
		return false;
	iv = PG_GETARG_INTERVAL_P(argno);
	check_interval(iv, "remember", true);
	if (interval_span(iv, &us) && us > 0)
		*remember = iv;
	return true;
}

/* idempotency.remember as an interval, or NULL when it is 0 (off). */
Interval *
idem_remember_setting(void)
{
	return idem_remember_s > 0 ?
		idem_interval_from_ms((int64) idem_remember_s * 1000) : NULL;
}

/*
 * The wait argument: not NULL, not negative; returned in microseconds.  A
 * wait too long to represent is capped, since waiting "forever" is a fair
 * request.
 */
int64
idem_arg_wait(FunctionCallInfo fcinfo, int argno)
{
	Interval   *iv;
	int64		us;

	idem_arg_not_null(fcinfo, argno, "wait");
	iv = PG_GETARG_INTERVAL_P(argno);
	if (!interval_span(iv, &us))
		us = (iv->time < 0 || iv->day < 0 || iv->month < 0) ?
			PG_INT64_MIN : WAIT_MAX_US;
	if (us < 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("wait must not be negative")));
	return Min(us, WAIT_MAX_US);
}

/* The status argument of idem_finish. */
IdemStatus
idem_arg_status(FunctionCallInfo fcinfo, int argno)
{
	text	   *s;
	IdemStatus	status;

	idem_arg_not_null(fcinfo, argno, "status");
	s = PG_GETARG_TEXT_PP(argno);
	/* A finish stores a final status; "pending" is not one. */
	if (idem_status_parse(VARDATA_ANY(s), VARSIZE_ANY_EXHDR(s), &status) &&
		status != IDEM_PENDING)
		return status;
	ereport(ERROR,
			(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
			 errmsg("invalid status \"%s\"", text_to_cstring(s)),
			 errhint("A finished key has status \"succeeded\" or \"failed\".")));
	pg_unreachable();
}

/* A stored jsonb ("name"): within idempotency.max_response_size. */
void
idem_check_body_size(Datum body, const char *name)
{
	Size		bytes = toast_raw_datum_size(body) - VARHDRSZ;

	if (bytes > (Size) idem_max_response_size)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("%s is too large", name),
				 errdetail("It has %zu bytes; idempotency.max_response_size is %d bytes.",
						   bytes, idem_max_response_size)));
}

/* A jsonb argument that is stored: NULL (0) or within the size limit. */
Datum
idem_arg_body(FunctionCallInfo fcinfo, int argno, const char *name)
{
	if (PG_ARGISNULL(argno))
		return (Datum) 0;
	idem_check_body_size(PG_GETARG_DATUM(argno), name);
	return PG_GETARG_DATUM(argno);
}

/*
 * Refuse a call that may write, before it reads anything: on a hot
 * standby, and in a read-only transaction (SET TRANSACTION READ ONLY,
 * default_transaction_read_only), whichever write path it would take.
 * Raises 25006, as PostgreSQL's own commands do.
 */
void
idem_check_writable(const char *function)
{
	PreventCommandDuringRecovery(function);
	PreventCommandIfReadOnly(function);
}


/*
 * Set up the one-row result of a set-returning function.  The executor
 * already built the row type from the OUT parameters; reusing it saves
 * building it again from pg_proc on every call.
 */
void
idem_result_init(FunctionCallInfo fcinfo)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;

	InitMaterializedSRF(fcinfo,
						rsinfo != NULL && IsA(rsinfo, ReturnSetInfo) &&
						rsinfo->expectedDesc != NULL ?
						MAT_SRF_USE_EXPECTED_DESC : 0);
}

/* ---------------------------------------------------------------------
 * Batch arguments
 * ---------------------------------------------------------------------
 */

/*
 * Take apart the array argument "argno" (named "name") of element type
 * "elemtype".  NULL raises 22004 when "required", else gives given =
 * false.  An array of more than one dimension raises 22023; an empty one
 * has no elements.
 */
void
idem_arg_array(FunctionCallInfo fcinfo, int argno, const char *name,
			   bool required, Oid elemtype, BatchArray *out)
{
	ArrayType  *arr;
	int16		typlen;
	bool		typbyval;
	char		typalign;

	memset(out, 0, sizeof(BatchArray));
	if (PG_ARGISNULL(argno))
	{
		if (required)
			idem_arg_not_null(fcinfo, argno, name);
		return;
	}
	arr = PG_GETARG_ARRAYTYPE_P(argno);
	if (ARR_NDIM(arr) > 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be a one-dimensional array", name)));
	get_typlenbyvalalign(elemtype, &typlen, &typbyval, &typalign);
	deconstruct_array(arr, elemtype, typlen, typbyval, typalign,
					  &out->elems, &out->nulls, &out->n);
	out->given = true;
}

/* Raise 22023 unless the optional array "a" ("name") has "n" elements. */
void
idem_check_batch_length(const BatchArray *a, const char *name, int n)
{
	if (a->given && a->n != n)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s has %d elements, keys has %d", name, a->n, n),
				 errhint("Give one element per key, in the order of keys.")));
}

/* The keys of a batch: no NULL element, each a valid key. */
void
idem_check_batch_keys(const BatchArray *keys)
{
	for (int i = 0; i < keys->n; i++)
	{
		char	   *name = psprintf("keys[%d]", i + 1);

		if (keys->nulls[i])
			ereport(ERROR,
					(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
					 errmsg("%s must not be null", name)));
		keys->elems[i] = PointerGetDatum(PG_DETOAST_DATUM_PACKED(keys->elems[i]));
		idem_check_name((text *) DatumGetPointer(keys->elems[i]), name, false);
		pfree(name);
	}
}

/*
 * idem_claim_many(keys, requests, scope, lease, retention, session_bound)
 *	  RETURNS TABLE (ord, key, outcome, token, attempt, status,
 *	  response_code, response_body, retry_after, phase, phase_data)
 *
 * One row per key, in array order, each answered as idem_claim (without
 * wait) would answer it if the keys were claimed one after another in this
 * transaction: a key repeated in the batch answers in_progress (it is this
 * transaction's own claim).  Every argument is checked before any key is
 * claimed.  Each key's lock is released before the next key is claimed, so
 * no batch holds more than one and none waits for another: two batches
 * that claim the same keys in opposite orders cannot deadlock.
 */
