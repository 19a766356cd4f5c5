/*-------------------------------------------------------------------------
 *
 * api.c
 *	  The SQL-callable functions: idem_claim, idem_finish, idem_extend,
 *	  idem_release, idem_lookup, idem_sweep.
 *
 * Owns argument checking (every bad input is an ERROR with its own
 * SQLSTATE, raised before anything is read or written), the outcome rules,
 * the wait loop, the result rows and the counters.  Reads go through
 * row.c, writes through write.c, under the key's lock (keylock.c).
 *
 * The claim protocol, in short: a lock-free probe of the newest row
 * answers replay, mismatch and in_progress without writing or locking
 * anything.  Only a claim that must write (a new key, a key past its
 * retention, a takeover) takes the key's advisory lock without waiting,
 * probes again under it (skipped for a key that was absent when nothing
 * was written since: see claim_once), writes, and releases the lock at
 * once.  A row that another transaction is changing is never waited on:
 * it answers in_progress.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <math.h>

#include "access/detoast.h"
#include "access/xlog.h"
#include "common/int.h"
#include "fmgr.h"
#include "funcapi.h"
#include "mb/pg_wchar.h"
#include "miscadmin.h"
#include "storage/latch.h"
#include "storage/lmgr.h"
#include "tcop/utility.h"
#include "utils/builtins.h"
#include "utils/datum.h"
#include "utils/memutils.h"
#include "utils/jsonb.h"
#include "utils/timestamp.h"
#include "utils/wait_event.h"

#include "idempotency.h"

PG_FUNCTION_INFO_V1(idem_claim);
PG_FUNCTION_INFO_V1(idem_finish);
PG_FUNCTION_INFO_V1(idem_extend);
PG_FUNCTION_INFO_V1(idem_release);
PG_FUNCTION_INFO_V1(idem_lookup);
PG_FUNCTION_INFO_V1(idem_sweep);

/* Without preloading, a waiter polls this often (the documented bound). */
#define WAIT_POLL_MS			10
/* With preloading, a safety net in case a wake-up is lost (2PC). */
#define WAIT_SAFETY_MS			1000
/*
 * The longest lease or retention, 10000 years as interval comparison counts
 * them (12 months of 30 days): keeps every deadline a valid timestamp.
 */
#define INTERVAL_MAX_US			(INT64CONST(10000) * MONTHS_PER_YEAR * \
								 DAYS_PER_MONTH * USECS_PER_DAY)
/* The longest wait: a hundred years is as good as forever. */
#define WAIT_MAX_US				(INT64CONST(100) * 365 * USECS_PER_DAY)

/* Columns of idem_claim's and idem_lookup's result rows. */
#define CLAIM_RESULT_COLS		7
#define LOOKUP_RESULT_COLS		7

typedef enum ClaimOutcome
{
	OUTCOME_CLAIMED,
	OUTCOME_REPLAY,
	OUTCOME_IN_PROGRESS,
	OUTCOME_MISMATCH
} ClaimOutcome;

/* The SQL name of an outcome. */
static const char *
outcome_name(ClaimOutcome outcome)
{
	switch (outcome)
	{
		case OUTCOME_CLAIMED:
			return "claimed";
		case OUTCOME_REPLAY:
			return "replay";
		case OUTCOME_IN_PROGRESS:
			return "in_progress";
		case OUTCOME_MISMATCH:
			return "mismatch";
	}
	pg_unreachable();
}

/* What a claim needs to know about its arguments. */
typedef struct ClaimArgs
{
	text	   *scope;
	text	   *key;
	uint64		hash;
	bool		has_fingerprint;
	uint8		fingerprint[IDEM_FINGERPRINT_LEN];
	Interval   *lease;			/* NULL: idempotency.lease */
	Interval   *retention;		/* NULL: idempotency.retention */
} ClaimArgs;

/* What a claim answers. */
typedef struct ClaimResult
{
	ClaimOutcome outcome;
	int64		token;
	int32		attempt;
	IdemStatus	status;
	bool		has_response_code;
	int32		response_code;
	Datum		response_body;
	int32		retry_after;
	/* for the wait loop */
	bool		held_by_me;		/* our own open transaction holds the key */
	bool		busy;			/* another transaction is changing the key */
	TimestampTz lease_until;	/* of the attempt we wait for, or 0 */
} ClaimResult;

/* What the probed row means for a claim. */
typedef enum ClaimAction
{
	ACTION_ANSWER,				/* the result is filled in, nothing to write */
	ACTION_FRESH,				/* absent or past retention: attempt 1 */
	ACTION_TAKEOVER				/* pending, lease over: attempt + 1 */
} ClaimAction;

/* ---------------------------------------------------------------------
 * Argument checks
 * ---------------------------------------------------------------------
 */

/* Raise 22004 when argument "argno" is NULL. */
static void
arg_not_null(FunctionCallInfo fcinfo, int argno, const char *name)
{
	if (PG_ARGISNULL(argno))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("%s must not be null", name)));
}

/*
 * A key or scope argument: not NULL, at most 255 characters, and (for a
 * key) not empty.
 */
static text *
arg_name(FunctionCallInfo fcinfo, int argno, const char *name,
		 bool allow_empty)
{
	text	   *t;
	int			bytes;

	arg_not_null(fcinfo, argno, name);
	t = PG_GETARG_TEXT_PP(argno);
	bytes = VARSIZE_ANY_EXHDR(t);
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
	return t;
}

/* An optional interval argument; NULL when the SQL value is NULL. */
static Interval *
arg_interval(FunctionCallInfo fcinfo, int argno)
{
	return PG_ARGISNULL(argno) ? NULL : PG_GETARG_INTERVAL_P(argno);
}

/* An interval of "ms" milliseconds (the value of a setting). */
static Interval *
interval_from_ms(int64 ms)
{
	Interval   *iv = palloc0(sizeof(Interval));

	iv->time = ms * INT64CONST(1000);
	return iv;
}

/* now + iv on the calendar, as timestamptz + interval does. */
static TimestampTz
add_interval(TimestampTz now, Interval *iv)
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

/* Raise 22023 unless the interval "iv" (named "name") is positive. */
static void
check_positive(Interval *iv, const char *name)
{
	TimestampTz now;
	int64		us = 0;

	if (iv == NULL)
		return;
	if (!interval_span(iv, &us))
		us = (iv->time < 0 || iv->day < 0 || iv->month < 0) ?
			PG_INT64_MIN : PG_INT64_MAX;
	if (us <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be positive", name)));
	if (us > INTERVAL_MAX_US)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s is too large", name),
				 errdetail("The limit is 10000 years.")));
	now = GetCurrentTimestamp();
	if (add_interval(now, iv) <= now)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be positive", name)));
}

/*
 * The wait argument: not NULL, not negative; returned in microseconds.  A
 * wait too long to represent is capped, since waiting "forever" is a fair
 * request.
 */
static int64
arg_wait(FunctionCallInfo fcinfo, int argno)
{
	Interval   *iv;
	int64		us;

	arg_not_null(fcinfo, argno, "wait");
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
static IdemStatus
arg_status(FunctionCallInfo fcinfo, int argno)
{
	text	   *s;
	IdemStatus	status;

	arg_not_null(fcinfo, argno, "status");
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

/* The response_body argument: NULL or a jsonb within the size limit. */
static Datum
arg_response_body(FunctionCallInfo fcinfo, int argno)
{
	Size		bytes;

	if (PG_ARGISNULL(argno))
		return (Datum) 0;
	bytes = toast_raw_datum_size(PG_GETARG_DATUM(argno)) - VARHDRSZ;
	if (bytes > (Size) idem_max_response_size)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("response_body is too large"),
				 errdetail("It has %zu bytes; idempotency.max_response_size is %d bytes.",
						   bytes, idem_max_response_size)));
	return PG_GETARG_DATUM(argno);
}

/* Name a key in messages: "key" or "key" in scope "scope". */
static char *
key_display(text *scope, text *key)
{
	if (VARSIZE_ANY_EXHDR(scope) == 0)
		return psprintf("\"%s\"", text_to_cstring(key));
	return psprintf("\"%s\" in scope \"%s\"", text_to_cstring(key),
					text_to_cstring(scope));
}

/* Whole seconds until "until", at least 1 (the Retry-After value). */
static int32
seconds_until(TimestampTz until, TimestampTz now)
{
	double		s = ceil((double) (until - now) / USECS_PER_SEC);

	if (s < 1)
		return 1;
	if (s > PG_INT32_MAX)
		return PG_INT32_MAX;
	return (int32) s;
}

/*
 * Set up the one-row result of a set-returning function.  The executor
 * already built the row type from the OUT parameters; reusing it saves
 * building it again from pg_proc on every call.
 */
static void
result_init(FunctionCallInfo fcinfo)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;

	InitMaterializedSRF(fcinfo,
						rsinfo != NULL && IsA(rsinfo, ReturnSetInfo) &&
						rsinfo->expectedDesc != NULL ?
						MAT_SRF_USE_EXPECTED_DESC : 0);
}

/* ---------------------------------------------------------------------
 * idem_claim
 * ---------------------------------------------------------------------
 */

/* Do two requests match?  NULL (no request) matches only NULL. */
static bool
fingerprint_matches(const ClaimArgs *args, const IdemRow *row)
{
	if (args->has_fingerprint != row->has_fingerprint)
		return false;
	return !args->has_fingerprint ||
		memcmp(args->fingerprint, row->fingerprint,
			   IDEM_FINGERPRINT_LEN) == 0;
}

/*
 * Answer in_progress with retry_after 1: another transaction or backend is
 * changing the key right now, and its outcome is unknown.
 */
static ClaimAction
claim_answer_busy(ClaimResult *res)
{
	memset(res, 0, sizeof(ClaimResult));
	res->outcome = OUTCOME_IN_PROGRESS;
	res->retry_after = 1;
	res->busy = true;
	return ACTION_ANSWER;
}

/*
 * A claim that must write a row another transaction holds a row lock on
 * would wait for it: answer in_progress instead.
 */
static ClaimAction
claim_write_action(const IdemRow *row, ClaimAction action, ClaimResult *res)
{
	return row->locked ? claim_answer_busy(res) : action;
}

/*
 * Decide what the probed row means.  Fills *res for every answer that
 * needs no write.
 */
static ClaimAction
claim_decide(const ClaimArgs *args, const IdemRow *row, TimestampTz now,
			 ClaimResult *res)
{
	/* Another transaction's uncommitted change: never answer from it. */
	if (row->busy)
		return claim_answer_busy(res);
	memset(res, 0, sizeof(ClaimResult));
	if (!row->found || row->expires_at <= now)
		return claim_write_action(row, ACTION_FRESH, res);
	if (!fingerprint_matches(args, row))
	{
		res->outcome = OUTCOME_MISMATCH;
		return ACTION_ANSWER;
	}
	if (row->status != IDEM_PENDING)
	{
		res->outcome = OUTCOME_REPLAY;
		res->status = row->status;
		res->has_response_code = row->has_response_code;
		res->response_code = row->response_code;
		res->response_body = row->response_body;
		return ACTION_ANSWER;
	}
	if (row->has_token && row->lease_until > now)
	{
		res->outcome = OUTCOME_IN_PROGRESS;
		res->held_by_me = row->mine;
		res->retry_after = row->mine ? 1 : seconds_until(row->lease_until, now);
		res->lease_until = row->lease_until;
		return ACTION_ANSWER;
	}
	return claim_write_action(row, ACTION_TAKEOVER, res);
}

/*
 * One claim attempt: answer from a lock-free probe when possible; else
 * take the key's lock without waiting, probe again (when needed) and write.
 */
static void
claim_once(const ClaimArgs *args, ClaimResult *res)
{
	TimestampTz now = GetCurrentTimestamp();
	IdemRow		row;
	ClaimAction action;
	uint64		writes_before = 0;
	uint64		writes_now;
	bool		counted;

	counted = idem_key_write_count(args->hash, &writes_before);
	idem_row_probe(args->scope, args->key, IDEM_PROBE_LATEST, true, &row);
	if (claim_decide(args, &row, now, res) == ACTION_ANSWER)
		return;

	/* Another backend is in this key's critical section right now. */
	if (!idem_key_lock(args->hash, false))
	{
		(void) claim_answer_busy(res);
		return;
	}

	/*
	 * Under the lock nobody else can start changing the key: look again,
	 * unless the key was absent and no key of its slice was written since
	 * we looked (keylock.c, idem_key_write_count; a fresh key is the common
	 * case, and this saves its second index descent).
	 */
	if (row.found || row.busy || !counted ||
		!idem_key_write_count(args->hash, &writes_now) ||
		writes_now != writes_before)
		idem_row_probe(args->scope, args->key, IDEM_PROBE_LATEST, true, &row);
	action = claim_decide(args, &row, now, res);
	if (action != ACTION_ANSWER)
	{
		TimestampTz lease_until;
		TimestampTz expires_at;
		Interval   *lease;
		Interval   *retention;
		int64		token;

		idem_row_check_snapshot(&row);

		lease = args->lease ? args->lease : interval_from_ms(idem_lease_ms);
		retention = args->retention ? args->retention :
			interval_from_ms((int64) idem_retention_s * 1000);
		lease_until = add_interval(now, lease);
		expires_at = Max(add_interval(now, retention), lease_until);
		token = idem_write_next_token();

		if (!row.found)
			idem_write_insert_claim(args->scope, args->key, token,
									args->has_fingerprint ? args->fingerprint : NULL,
									now, lease_until, expires_at, retention);
		else
			idem_write_update_claim(&row, token,
									action == ACTION_FRESH ? 1 : row.attempt + 1,
									args->has_fingerprint ? args->fingerprint : NULL,
									action == ACTION_FRESH ? now : row.created_at,
									lease_until, expires_at, retention);
		idem_key_wrote(args->hash);

		res->outcome = OUTCOME_CLAIMED;
		res->token = token;
		res->attempt = action == ACTION_FRESH ? 1 : row.attempt + 1;
	}
	idem_key_unlock(args->hash);
}

/*
 * Claim, waiting up to "wait_us" for an in-flight attempt to settle.  The
 * waiter publishes its key before probing again, so the settling
 * transaction's wake-up (at its commit or abort) cannot be missed; it also
 * wakes when the lease it waits for ends, to take over.  Our own open
 * transaction is never waited for.
 */
static void
claim_with_wait(const ClaimArgs *args, int64 wait_us, ClaimResult *res)
{
	TimestampTz deadline;
	MemoryContext outer;
	MemoryContext round_cxt;
	IdemWaitRegistration reg;

	claim_once(args, res);
	if (res->outcome != OUTCOME_IN_PROGRESS || wait_us <= 0 ||
		res->held_by_me)
		return;

	deadline = GetCurrentTimestamp() + wait_us;
	outer = CurrentMemoryContext;
	round_cxt = AllocSetContextCreate(outer, "idempotency claim wait",
									  ALLOCSET_SMALL_SIZES);
	idem_wait_register(args->hash, &reg);
	PG_TRY();
	{
		for (;;)
		{
			TimestampTz now;
			int64		sleep_us;
			long		sleep_ms;

			/* Each round's probe allocates afresh: a long wait must not grow. */
			ResetLatch(MyLatch);
			MemoryContextReset(round_cxt);
			MemoryContextSwitchTo(round_cxt);
			claim_once(args, res);
			MemoryContextSwitchTo(outer);
			if (res->outcome != OUTCOME_IN_PROGRESS || res->held_by_me)
				break;
			now = GetCurrentTimestamp();
			if (now >= deadline)
				break;

			sleep_us = deadline - now;
			if (res->lease_until > now)
				sleep_us = Min(sleep_us, res->lease_until - now);
			if (!reg.published)	/* not preloaded: nobody will wake us */
				sleep_us = Min(sleep_us, WAIT_POLL_MS * 1000);
			else if (res->busy)
				sleep_us = Min(sleep_us, WAIT_SAFETY_MS * 1000);
			sleep_ms = (long) ((sleep_us + 999) / 1000);

			(void) WaitLatch(MyLatch,
							 WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
							 sleep_ms, PG_WAIT_EXTENSION);
			CHECK_FOR_INTERRUPTS();
		}
	}
	PG_FINALLY();
	{
		idem_wait_unregister(&reg);
	}
	PG_END_TRY();

	if (res->response_body != (Datum) 0)
		res->response_body = datumCopy(res->response_body, false, -1);
	MemoryContextDelete(round_cxt);

	/* Retry-After is measured at the moment we answer. */
	if (res->outcome == OUTCOME_IN_PROGRESS && !res->busy && !res->held_by_me)
		res->retry_after = seconds_until(res->lease_until,
										 GetCurrentTimestamp());
}

/* Count one claim answer. */
static void
claim_count(const ClaimResult *res)
{
	switch (res->outcome)
	{
		case OUTCOME_CLAIMED:
			idem_stats_count(IDEM_STAT_CLAIMS, 1);
			if (res->attempt > 1)
				idem_stats_count(IDEM_STAT_TAKEOVERS, 1);
			break;
		case OUTCOME_REPLAY:
			idem_stats_count(IDEM_STAT_REPLAYS, 1);
			break;
		case OUTCOME_IN_PROGRESS:
			idem_stats_count(IDEM_STAT_IN_PROGRESS, 1);
			break;
		case OUTCOME_MISMATCH:
			idem_stats_count(IDEM_STAT_MISMATCHES, 1);
			break;
	}
}

/*
 * idem_claim(key, request, scope, lease, retention, wait)
 *	  RETURNS SETOF idempotency.claim_result (outcome, token, attempt,
 *	  status, response_code, response_body, retry_after): always one row.
 *	  A 1.0 installation declares the same columns as RETURNS TABLE; both
 *	  reach us as the executor's expected row type.
 */
Datum
idem_claim(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	ClaimArgs	args;
	ClaimResult res;
	int64		wait_us;
	Datum		values[CLAIM_RESULT_COLS];
	bool		nulls[CLAIM_RESULT_COLS];

	memset(nulls, true, sizeof(nulls));
	args.key = arg_name(fcinfo, 0, "key", false);
	args.scope = arg_name(fcinfo, 2, "scope", true);
	args.lease = arg_interval(fcinfo, 3);
	args.retention = arg_interval(fcinfo, 4);
	check_positive(args.lease, "lease");
	check_positive(args.retention, "retention");
	wait_us = arg_wait(fcinfo, 5);
	PreventCommandDuringRecovery("idem_claim()");
	idem_tenant_check(args.scope);

	args.has_fingerprint = !PG_ARGISNULL(1);
	if (args.has_fingerprint)
		idem_fingerprint(PG_GETARG_DATUM(1), args.fingerprint);
	args.hash = idem_key_hash(args.scope, args.key);

	result_init(fcinfo);
	claim_with_wait(&args, wait_us, &res);
	claim_count(&res);

	values[0] = CStringGetTextDatum(outcome_name(res.outcome));
	nulls[0] = false;
	switch (res.outcome)
	{
		case OUTCOME_CLAIMED:
			values[1] = Int64GetDatum(res.token);
			values[2] = Int32GetDatum(res.attempt);
			nulls[1] = nulls[2] = false;
			break;
		case OUTCOME_REPLAY:
			values[3] = CStringGetTextDatum(idem_status_names[res.status]);
			nulls[3] = false;
			if (res.has_response_code)
			{
				values[4] = Int32GetDatum(res.response_code);
				nulls[4] = false;
			}
			if (res.response_body != (Datum) 0)
			{
				values[5] = PointerGetDatum(PG_DETOAST_DATUM(res.response_body));
				nulls[5] = false;
			}
			break;
		case OUTCOME_IN_PROGRESS:
			values[6] = Int32GetDatum(res.retry_after);
			nulls[6] = false;
			break;
		case OUTCOME_MISMATCH:
			break;
	}
	tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	PG_RETURN_VOID();
}

/* ---------------------------------------------------------------------
 * idem_finish, idem_extend, idem_release: the token-holder's calls
 * ---------------------------------------------------------------------
 */

typedef enum TokenCallKind
{
	CALL_FINISH,
	CALL_EXTEND,
	CALL_RELEASE
} TokenCallKind;

static const char *const call_names[] = {"finish", "extend", "release"};
static const char *const call_functions[] = {
	"idem_finish()", "idem_extend()", "idem_release()"
};

/* One token-holder's call: its key and token, then the key as probed. */
typedef struct TokenCall
{
	TokenCallKind kind;
	text	   *key;
	text	   *scope;
	int64		token;
	uint64		hash;
	TimestampTz now;			/* the wall clock the call is judged by */
	IdemRow		row;
} TokenCall;

/*
 * Check the arguments every token call has: the key (argument "key_arg"),
 * the token (argument 1) and the scope ("scope_arg").
 */
static void
token_call_args(FunctionCallInfo fcinfo, TokenCallKind kind, int key_arg,
				int scope_arg, TokenCall *call)
{
	call->kind = kind;
	call->key = arg_name(fcinfo, key_arg, "key", false);
	call->scope = arg_name(fcinfo, scope_arg, "scope", true);
	arg_not_null(fcinfo, 1, "token");
	call->token = PG_GETARG_INT64(1);
}

/*
 * Lock the key and probe it for the call, once all its arguments are
 * checked.  Raises the documented error for every case in which the call
 * may not proceed.  Returns false (with the lock still held) only for a
 * finish repeated with the token that finished the key: the caller answers
 * from call->row.
 *
 * Another transaction's change that keeps the token current (a sweep
 * moving the row's sweep_at, or an extend or finish made with this same
 * token elsewhere) is waited for: without the key's lock, so that the wait
 * can never close a cycle through it, and then the key is probed afresh.
 * A takeover, reset or release in flight is not: it raises at once, since
 * the token is as good as dead.  call->now is read again after a wait, so
 * that a key whose retention passed meanwhile is absent, and leases and
 * expiries count from the write.
 */
static bool
token_call_begin(TokenCall *call)
{
	IdemRow    *row = &call->row;
	text	   *key = call->key;
	text	   *scope = call->scope;

	PreventCommandDuringRecovery(call_functions[call->kind]);
	idem_tenant_check(scope);
	call->hash = idem_key_hash(scope, key);
	call->now = GetCurrentTimestamp();
	for (;;)
	{
		(void) idem_key_lock(call->hash, true);
		idem_row_probe(scope, key, IDEM_PROBE_LATEST, false, row);
		if (!row->busy || row->locked || row->busy_token == 0 ||
			row->busy_token != call->token)
			break;
		idem_key_unlock(call->hash);
		XactLockTableWait(row->busy_xid, NULL, NULL, XLTW_None);
		call->now = GetCurrentTimestamp();
	}

	if (row->busy || row->locked)
		ereport(ERROR,
				(errcode(ERRCODE_LOCK_NOT_AVAILABLE),
				 errmsg("could not %s idempotency key %s",
						call_names[call->kind], key_display(scope, key)),
				 row->locked ?
				 errdetail("Another transaction holds a row lock on this key.") :
				 !row->busy_new ?
				 errdetail("Another transaction is deleting this key right now (a release, or a sweep of an expired key).") :
				 row->busy_token == 0 ?
				 errdetail("Another transaction is resetting this key right now (its lease ended).") :
				 errdetail("Another transaction is taking this key over right now."),
				 row->locked ?
				 errhint("Retry once that transaction has ended.") :
				 errhint("If that transaction commits, this token is no longer current.")));
	if (!row->found || row->expires_at <= call->now)
		ereport(ERROR,
				(errcode(ERRCODE_NO_DATA_FOUND),
				 errmsg("idempotency key %s does not exist",
						key_display(scope, key)),
				 errdetail("It was never claimed, was released, or its retention has passed.")));
	if (row->status != IDEM_PENDING)
	{
		if (call->kind == CALL_FINISH && row->has_token &&
			row->token == call->token)
			return false;
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idempotency key %s is already finished",
						key_display(scope, key)),
				 call->kind == CALL_FINISH ?
				 errdetail("Another attempt stored its result.") :
				 errdetail("Its status is \"%s\".", idem_status_names[row->status])));
	}
	if (!row->has_token || row->token != call->token)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_IN_USE),
				 errmsg("token " INT64_FORMAT " is not the current token of idempotency key %s",
						call->token, key_display(scope, key)),
				 row->has_token ?
				 errdetail("Attempt %d holds the key now.", row->attempt) :
				 errdetail("The sweeper reset the key after its lease ended."),
				 errhint("Another attempt took the claim over, or this token never held it: do not store this attempt's result.")));
	idem_row_check_snapshot(row);
	return true;
}

/*
 * End a token holder's call that wrote the key: count the write and let the
 * key's lock go.
 */
static void
token_call_end(const TokenCall *call)
{
	idem_key_wrote(call->hash);
	idem_key_unlock(call->hash);
}

/*
 * idem_finish(key, token, response_code, response_body, scope, status,
 *			   retention) RETURNS timestamptz
 */
Datum
idem_finish(PG_FUNCTION_ARGS)
{
	TokenCall	call;
	Datum		body;
	IdemStatus	status;
	Interval   *retention;
	TimestampTz expires_at;

	token_call_args(fcinfo, CALL_FINISH, 0, 4, &call);
	body = arg_response_body(fcinfo, 3);
	status = arg_status(fcinfo, 5);
	retention = arg_interval(fcinfo, 6);
	check_positive(retention, "retention");

	if (!token_call_begin(&call))
	{
		idem_key_unlock(call.hash);
		PG_RETURN_TIMESTAMPTZ(call.row.expires_at);
	}
	expires_at = add_interval(call.now,
							  retention ? retention : &call.row.retention);
	idem_write_finish(&call.row, status, !PG_ARGISNULL(2),
					  PG_ARGISNULL(2) ? 0 : PG_GETARG_INT32(2), body,
					  call.now, expires_at);
	token_call_end(&call);
	idem_stats_count(IDEM_STAT_FINISHES, 1);

	PG_RETURN_TIMESTAMPTZ(expires_at);
}

/* idem_extend(key, token, lease, scope) RETURNS timestamptz */
Datum
idem_extend(PG_FUNCTION_ARGS)
{
	TokenCall	call;
	Interval   *lease;
	TimestampTz lease_until;
	TimestampTz expires_at;

	token_call_args(fcinfo, CALL_EXTEND, 0, 3, &call);
	lease = arg_interval(fcinfo, 2);
	check_positive(lease, "lease");

	(void) token_call_begin(&call);
	lease_until = add_interval(call.now, lease ? lease :
							   interval_from_ms(idem_lease_ms));
	expires_at = Max(add_interval(call.now, &call.row.retention), lease_until);
	idem_write_extend(&call.row, lease_until, expires_at);
	token_call_end(&call);

	PG_RETURN_TIMESTAMPTZ(lease_until);
}

/* idem_release(key, token, scope) RETURNS void */
Datum
idem_release(PG_FUNCTION_ARGS)
{
	TokenCall	call;

	token_call_args(fcinfo, CALL_RELEASE, 0, 2, &call);

	(void) token_call_begin(&call);
	idem_write_release(&call.row);
	token_call_end(&call);
	idem_stats_count(IDEM_STAT_RELEASES, 1);

	PG_RETURN_VOID();
}

/* ---------------------------------------------------------------------
 * idem_lookup, idem_sweep
 * ---------------------------------------------------------------------
 */

/*
 * idem_lookup(key, scope) RETURNS TABLE (status, attempt, response_code,
 *		response_body, created_at, finished_at, expires_at)
 * Reads through the caller's snapshot; works on a hot standby.
 */
Datum
idem_lookup(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	text	   *key = arg_name(fcinfo, 0, "key", false);
	text	   *scope = arg_name(fcinfo, 1, "scope", true);
	IdemRow		row;
	Datum		values[LOOKUP_RESULT_COLS];
	bool		nulls[LOOKUP_RESULT_COLS] = {0};

	idem_tenant_check(scope);
	result_init(fcinfo);
	idem_row_probe(scope, key, IDEM_PROBE_SNAPSHOT, true, &row);
	if (!row.found || row.expires_at <= GetCurrentTimestamp())
		PG_RETURN_VOID();

	values[0] = CStringGetTextDatum(idem_status_names[row.status]);
	values[1] = Int32GetDatum(row.attempt);
	values[2] = Int32GetDatum(row.response_code);
	nulls[2] = !row.has_response_code;
	values[3] = row.response_body != (Datum) 0 ?
		PointerGetDatum(PG_DETOAST_DATUM(row.response_body)) : (Datum) 0;
	nulls[3] = (row.response_body == (Datum) 0);
	values[4] = TimestampTzGetDatum(row.created_at);
	values[5] = TimestampTzGetDatum(row.finished_at);
	nulls[5] = !row.has_finished_at;
	values[6] = TimestampTzGetDatum(row.expires_at);
	tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	PG_RETURN_VOID();
}

/* idem_sweep(batch_size) RETURNS TABLE (expired bigint, reset bigint) */
Datum
idem_sweep(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	int			batch = idem_sweep_batch;
	int64		expired;
	int64		reset;
	TimestampTz start;
	Datum		values[2];
	bool		nulls[2] = {0};

	if (!PG_ARGISNULL(0))
	{
		batch = PG_GETARG_INT32(0);
		if (batch <= 0)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("batch_size must be positive")));
	}
	PreventCommandDuringRecovery("idem_sweep()");

	result_init(fcinfo);
	start = GetCurrentTimestamp();
	(void) idem_sweep_batch_run(batch, 0, &expired, &reset);
	idem_stats_sweep_done(GetCurrentTimestamp(),
						  (double) (GetCurrentTimestamp() - start) / 1000.0);

	values[0] = Int64GetDatum(expired);
	values[1] = Int64GetDatum(reset);
	tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	PG_RETURN_VOID();
}
