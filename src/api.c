/*-------------------------------------------------------------------------
 *
 * api.c
 *	  The SQL-callable functions: idem_claim, idem_finish, idem_extend,
 *	  idem_release, idem_checkpoint, idem_lookup, idem_sweep, and the
 *	  batches idem_claim_many and idem_finish_many.
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
#include "access/xact.h"
#include "access/xlog.h"
#include "common/int.h"
#include "fmgr.h"
#include "funcapi.h"
#include "mb/pg_wchar.h"
#include "miscadmin.h"
#include "storage/latch.h"
#include "storage/lmgr.h"
#include "tcop/utility.h"
#include "catalog/pg_type.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/datum.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"
#include "utils/jsonb.h"
#include "utils/lsyscache.h"
#include "utils/timestamp.h"
#include "utils/wait_event.h"

#include "idempotency.h"

PG_FUNCTION_INFO_V1(idem_claim);
PG_FUNCTION_INFO_V1(idem_finish);
PG_FUNCTION_INFO_V1(idem_extend);
PG_FUNCTION_INFO_V1(idem_release);
PG_FUNCTION_INFO_V1(idem_checkpoint);
PG_FUNCTION_INFO_V1(idem_claim_many);
PG_FUNCTION_INFO_V1(idem_finish_many);
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

/*
 * Columns of idem_claim's and idem_lookup's result rows (1.4; older
 * installations declare the first 7 of each, and get those).
 */
#define CLAIM_RESULT_COLS		9
#define LOOKUP_RESULT_COLS		8

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
	bool		session_bound;	/* tie the claim to this session */
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
	Datum		phase;			/* a takeover's checkpoint to resume from */
	Datum		phase_data;
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
 * A key, scope or phase: at most 255 characters, and (unless allow_empty)
 * not empty.
 */
static void
check_name(text *t, const char *name, bool allow_empty)
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

/* A key or scope argument: not NULL, and as check_name says. */
static text *
arg_name(FunctionCallInfo fcinfo, int argno, const char *name,
		 bool allow_empty)
{
	text	   *t;

	arg_not_null(fcinfo, argno, name);
	t = PG_GETARG_TEXT_PP(argno);
	check_name(t, name, allow_empty);
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

/* A stored jsonb ("name"): within idempotency.max_response_size. */
static void
check_body_size(Datum body, const char *name)
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
static Datum
arg_body(FunctionCallInfo fcinfo, int argno, const char *name)
{
	if (PG_ARGISNULL(argno))
		return (Datum) 0;
	check_body_size(PG_GETARG_DATUM(argno), name);
	return PG_GETARG_DATUM(argno);
}

/*
 * Refuse a call that may write, before it reads anything: on a hot
 * standby, and in a read-only transaction (SET TRANSACTION READ ONLY,
 * default_transaction_read_only), whichever write path it would take.
 * Raises 25006, as PostgreSQL's own commands do.
 */
static void
check_writable(const char *function)
{
	PreventCommandDuringRecovery(function);
	PreventCommandIfReadOnly(function);
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

/*
 * The tokens that claims of the current transaction handed out, so that a
 * later claim of the same transaction (or batch) knows a claim it holds
 * itself: a row this transaction wrote whose token is one of these.  A row
 * it wrote otherwise (an extend, a checkpoint, a plain UPDATE) holds some
 * other attempt's claim.  Most transactions claim one key, so the first
 * token is kept in a variable and a hash table (in the transaction's
 * memory) is made only for a second one; both are forgotten when the
 * transaction ends.  A token of a subtransaction rolled back since is in
 * no row.
 */
static int64 xact_first_token = 0;		/* 0: none yet (tokens start at 1) */
static HTAB *xact_tokens = NULL;
static bool xact_tokens_callback = false;

static void
xact_tokens_forget(XactEvent event, void *arg)
{
	xact_first_token = 0;
	xact_tokens = NULL;
}

/* Remember that this transaction's claim handed out "token". */
static void
xact_token_issued(int64 token)
{
	if (!xact_tokens_callback)
	{
		RegisterXactCallback(xact_tokens_forget, NULL);
		xact_tokens_callback = true;
	}
	if (xact_first_token == 0)
	{
		xact_first_token = token;
		return;
	}
	if (xact_tokens == NULL)
	{
		HASHCTL		ctl;

		ctl.keysize = sizeof(int64);
		ctl.entrysize = sizeof(int64);
		ctl.hcxt = TopTransactionContext;
		xact_tokens = hash_create("idempotency tokens of this transaction", 64,
								  &ctl, HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);
	}
	(void) hash_search(xact_tokens, &token, HASH_ENTER, NULL);
}

/* Does the current transaction hold the claim stored in "row"? */
static bool
claim_held_here(const IdemRow *row)
{
	if (!row->mine || !row->has_token || xact_first_token == 0)
		return false;
	return row->token == xact_first_token ||
		(xact_tokens != NULL &&
		 hash_search(xact_tokens, &row->token, HASH_FIND, NULL) != NULL);
}

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
	/*
	 * A live lease, and for a session-bound claim a live session too: once
	 * the owner's session ended the key is reclaimable at once.  A claim
	 * that our own open transaction (or an earlier element of this batch)
	 * made is held by us whatever its lease: taking it over would hand out
	 * a second token for an attempt that is still running here.
	 */
	if (row->has_token &&
		(claim_held_here(row) ||
		 (row->lease_until > now &&
		  (!row->has_owner_session ||
		   idem_session_alive(row->owner_session)))))
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
		int64		owner_session;

		idem_row_check_snapshot(&row);
		owner_session = args->session_bound ? idem_session_bind() : 0;

		lease = args->lease ? args->lease : interval_from_ms(idem_lease_ms);
		retention = args->retention ? args->retention :
			interval_from_ms((int64) idem_retention_s * 1000);
		lease_until = add_interval(now, lease);
		expires_at = Max(add_interval(now, retention), lease_until);
		token = idem_write_claim_token(row.found ? &row : NULL);

		if (!row.found)
			idem_write_insert_claim(args->scope, args->key, token,
									args->has_fingerprint ? args->fingerprint : NULL,
									now, lease_until, expires_at, retention,
									owner_session);
		else
			idem_write_update_claim(&row, token,
									action == ACTION_FRESH ? 1 : row.attempt + 1,
									args->has_fingerprint ? args->fingerprint : NULL,
									action == ACTION_FRESH ? now : row.created_at,
									lease_until, expires_at, retention,
									owner_session);
		idem_key_wrote(args->hash);

		xact_token_issued(token);
		res->outcome = OUTCOME_CLAIMED;
		res->token = token;
		res->attempt = action == ACTION_FRESH ? 1 : row.attempt + 1;
		if (action == ACTION_TAKEOVER)
		{
			res->phase = row.phase;
			res->phase_data = row.phase_data;
		}
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
	if (res->phase != (Datum) 0)
		res->phase = datumCopy(res->phase, false, -1);
	if (res->phase_data != (Datum) 0)
		res->phase_data = datumCopy(res->phase_data, false, -1);
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
 * The arguments idem_claim and idem_claim_many share, in the same places:
 * scope (2), lease (3) and retention (4).
 */
static void
claim_common_args(FunctionCallInfo fcinfo, ClaimArgs *args)
{
	args->scope = arg_name(fcinfo, 2, "scope", true);
	args->lease = arg_interval(fcinfo, 3);
	args->retention = arg_interval(fcinfo, 4);
	check_positive(args->lease, "lease");
	check_positive(args->retention, "retention");
}

/*
 * The columns of a claim's answer, from outcome to phase_data (the
 * CLAIM_RESULT_COLS of claim_result), into values/nulls.
 */
static void
claim_result_values(const ClaimResult *res, Datum *values, bool *nulls)
{
	for (int i = 0; i < CLAIM_RESULT_COLS; i++)
	{
		values[i] = (Datum) 0;
		nulls[i] = true;
	}
	values[0] = CStringGetTextDatum(outcome_name(res->outcome));
	nulls[0] = false;
	switch (res->outcome)
	{
		case OUTCOME_CLAIMED:
			values[1] = Int64GetDatum(res->token);
			values[2] = Int32GetDatum(res->attempt);
			nulls[1] = nulls[2] = false;
			if (res->phase != (Datum) 0)
			{
				values[7] = res->phase;
				nulls[7] = false;
			}
			if (res->phase_data != (Datum) 0)
			{
				values[8] = PointerGetDatum(PG_DETOAST_DATUM(res->phase_data));
				nulls[8] = false;
			}
			break;
		case OUTCOME_REPLAY:
			values[3] = CStringGetTextDatum(idem_status_names[res->status]);
			nulls[3] = false;
			if (res->has_response_code)
			{
				values[4] = Int32GetDatum(res->response_code);
				nulls[4] = false;
			}
			if (res->response_body != (Datum) 0)
			{
				values[5] = PointerGetDatum(PG_DETOAST_DATUM(res->response_body));
				nulls[5] = false;
			}
			break;
		case OUTCOME_IN_PROGRESS:
			values[6] = Int32GetDatum(res->retry_after);
			nulls[6] = false;
			break;
		case OUTCOME_MISMATCH:
			break;
	}
}

/*
 * Refuse a session-bound claim on a distributed table: Citus runs the call
 * on the shard's node in a connection of its own, which neither lives nor
 * ends with the client's session.
 */
static void
claim_check_session_bound(void)
{
	if (idem_catalog_distributed())
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("session-bound claims are not supported when Citus distributes idempotency.keys"),
				 errdetail("Citus runs the call in a connection of its own on the node that holds the scope, not in the client's session."),
				 errhint("Claim with a lease (session_bound => false) and extend it while working.")));
}

/*
 * idem_claim(key, request, scope, lease, retention, wait, session_bound)
 *	  RETURNS SETOF idempotency.claim_result (outcome, token, attempt,
 *	  status, response_code, response_body, retry_after, phase,
 *	  phase_data): always one row.  Installations of 1.0 to 1.3 declare
 *	  the first six arguments and the first seven columns (1.0 as RETURNS
 *	  TABLE); the row is built for the row type the executor expects.
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

	args.key = arg_name(fcinfo, 0, "key", false);
	claim_common_args(fcinfo, &args);
	wait_us = arg_wait(fcinfo, 5);
	args.session_bound = false;
	if (PG_NARGS() > 6)
	{
		arg_not_null(fcinfo, 6, "session_bound");
		args.session_bound = PG_GETARG_BOOL(6);
	}
	check_writable("idem_claim()");
	idem_tenant_check(args.scope);
	idem_catalog_select_scope(args.scope);
	if (args.session_bound)
		claim_check_session_bound();

	args.has_fingerprint = !PG_ARGISNULL(1);
	if (args.has_fingerprint)
		idem_fingerprint(PG_GETARG_DATUM(1), args.fingerprint);
	args.hash = idem_key_hash(args.scope, args.key);

	result_init(fcinfo);
	claim_with_wait(&args, wait_us, &res);
	claim_count(&res);

	claim_result_values(&res, values, nulls);
	tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	PG_RETURN_VOID();
}

/* ---------------------------------------------------------------------
 * Batch arguments
 * ---------------------------------------------------------------------
 */

/* A batch's array argument, taken apart. */
typedef struct BatchArray
{
	bool		given;			/* false: the argument is NULL */
	int			n;
	Datum	   *elems;
	bool	   *nulls;
} BatchArray;

/*
 * Take apart the array argument "argno" (named "name") of element type
 * "elemtype".  NULL raises 22004 when "required", else gives given =
 * false.  An array of more than one dimension raises 22023; an empty one
 * has no elements.
 */
static void
arg_array(FunctionCallInfo fcinfo, int argno, const char *name,
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
			arg_not_null(fcinfo, argno, name);
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
static void
check_batch_length(const BatchArray *a, const char *name, int n)
{
	if (a->given && a->n != n)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s has %d elements, keys has %d", name, a->n, n),
				 errhint("Give one element per key, in the order of keys.")));
}

/* The keys of a batch: no NULL element, each a valid key. */
static void
check_batch_keys(const BatchArray *keys)
{
	for (int i = 0; i < keys->n; i++)
	{
		char	   *name = psprintf("keys[%d]", i + 1);

		if (keys->nulls[i])
			ereport(ERROR,
					(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
					 errmsg("%s must not be null", name)));
		keys->elems[i] = PointerGetDatum(PG_DETOAST_DATUM_PACKED(keys->elems[i]));
		check_name((text *) DatumGetPointer(keys->elems[i]), name, false);
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
Datum
idem_claim_many(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	BatchArray	keys;
	BatchArray	requests;
	ClaimArgs	args;
	MemoryContext outer = CurrentMemoryContext;
	MemoryContext elem_cxt;

	arg_array(fcinfo, 0, "keys", true, TEXTOID, &keys);
	arg_array(fcinfo, 1, "requests", false, JSONBOID, &requests);
	check_batch_length(&requests, "requests", keys.n);
	check_batch_keys(&keys);
	claim_common_args(fcinfo, &args);
	arg_not_null(fcinfo, 5, "session_bound");
	args.session_bound = PG_GETARG_BOOL(5);
	check_writable("idem_claim_many()");
	idem_tenant_check(args.scope);
	idem_catalog_select_scope(args.scope);
	if (args.session_bound)
		claim_check_session_bound();

	result_init(fcinfo);
	elem_cxt = AllocSetContextCreate(outer, "idempotency batch element",
									 ALLOCSET_SMALL_SIZES);
	/* one WAL flush for the batch's tokens, when it returns them */
	idem_write_defer_token_flush();
	PG_TRY();
	{
		for (int i = 0; i < keys.n; i++)
		{
			ClaimResult res;
			Datum		values[CLAIM_RESULT_COLS + 2];
			bool		nulls[CLAIM_RESULT_COLS + 2];

			CHECK_FOR_INTERRUPTS();
			MemoryContextReset(elem_cxt);
			MemoryContextSwitchTo(elem_cxt);
			args.key = (text *) DatumGetPointer(keys.elems[i]);
			args.has_fingerprint = requests.given && !requests.nulls[i];
			if (args.has_fingerprint)
				idem_fingerprint(requests.elems[i], args.fingerprint);
			args.hash = idem_key_hash(args.scope, args.key);
			claim_once(&args, &res);
			claim_count(&res);
			/* An element is claimed; the batch has not returned yet. */
			IDEM_PAUSE("claim-many-element");

			values[0] = Int32GetDatum(i + 1);
			values[1] = keys.elems[i];
			nulls[0] = nulls[1] = false;
			claim_result_values(&res, values + 2, nulls + 2);
			MemoryContextSwitchTo(outer);
			tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values,
								 nulls);
		}
	}
	PG_CATCH();
	{
		idem_write_flush_tokens(false);
		PG_RE_THROW();
	}
	PG_END_TRY();
	idem_write_flush_tokens(true);
	MemoryContextDelete(elem_cxt);
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
	CALL_RELEASE,
	CALL_CHECKPOINT
} TokenCallKind;

static const char *const call_names[] = {
	"finish", "extend", "release", "checkpoint"
};
static const char *const call_functions[] = {
	"idem_finish()", "idem_extend()", "idem_release()", "idem_checkpoint()"
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

IDEM_NORETURN static void token_call_raise_dead(const TokenCall *call,
												bool has_token, int32 attempt);

/* A key's committed row version, as a token call judges it. */
typedef struct TokenView
{
	bool		found;
	TimestampTz expires_at;
	IdemStatus	status;
	bool		has_token;
	int64		token;
	int32		attempt;
} TokenView;

/*
 * Raise 55006: the call's token is not the key's current one ("has_token"
 * and "attempt" of the committed row).
 */
static void
token_call_raise_dead(const TokenCall *call, bool has_token, int32 attempt)
{
	ereport(ERROR,
			(errcode(ERRCODE_OBJECT_IN_USE),
			 errmsg("token " INT64_FORMAT " is not the current token of idempotency key %s",
					call->token, idem_key_display(call->scope, call->key)),
			 has_token ?
			 errdetail("Attempt %d holds the key now.", attempt) :
			 errdetail("The sweeper reset the key after its lease ended."),
			 errhint("Another attempt took the claim over, or this token never held it: do not store this attempt's result.")));
}

/*
 * Judge "call" by the key's committed row version "v": raise the documented
 * error when the key is absent or past its retention (P0002), finished
 * (55000), or held by another token (55006).  Returns true when the call's
 * token is the key's current one, false for a finish repeated with the
 * token that finished the key (the caller answers from the row).
 */
static bool
token_call_judge(const TokenCall *call, const TokenView *v)
{
	if (!v->found || v->expires_at <= call->now)
		ereport(ERROR,
				(errcode(ERRCODE_NO_DATA_FOUND),
				 errmsg("idempotency key %s does not exist",
						idem_key_display(call->scope, call->key)),
				 errdetail("It was never claimed, was released, or its retention has passed.")));
	if (v->status != IDEM_PENDING)
	{
		if (call->kind == CALL_FINISH && v->has_token && v->token == call->token)
			return false;
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idempotency key %s is already finished",
						idem_key_display(call->scope, call->key)),
				 call->kind == CALL_FINISH ?
				 errdetail("Another attempt stored its result.") :
				 errdetail("Its status is \"%s\".", idem_status_names[v->status])));
	}
	if (!v->has_token || v->token != call->token)
		token_call_raise_dead(call, v->has_token, v->attempt);
	return true;
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

	check_writable(call_functions[call->kind]);
	idem_tenant_check(scope);
	idem_catalog_select_scope(scope);
	call->hash = idem_key_hash(scope, key);
	call->now = GetCurrentTimestamp();
	for (;;)
	{
		(void) idem_key_lock(call->hash, true);
		idem_row_probe(scope, key, IDEM_PROBE_LATEST, false, row);
		if (!row->busy || row->locked || row->busy_token == 0 ||
			row->busy_token != call->token ||
			(row->busy_old && row->busy_old_status != IDEM_PENDING))
			break;
		idem_key_unlock(call->hash);
		XactLockTableWait(row->busy_xid, NULL, NULL, XLTW_None);
		call->now = GetCurrentTimestamp();
	}

	/*
	 * What the committed row says is said whatever another transaction is
	 * doing to the key right now: a dead token, a finished key and a key
	 * past its retention get their own errors.  Only a call whose token is
	 * current has to wait for that transaction's outcome (55P03).
	 */
	if (row->locked && row->found)
	{
		TokenView	view = {true, row->expires_at, row->status,
		row->has_token, row->token, row->attempt};

		if (!token_call_judge(call, &view))
			return false;
	}
	else if (row->busy && row->busy_old)
	{
		TokenView	view = {true, row->busy_old_expires_at, row->busy_old_status,
		row->busy_old_has_token, row->busy_old_token, row->busy_old_attempt};

		if (!token_call_judge(call, &view))
		{
			/* a finish repeated: answered from the committed row */
			row->expires_at = row->busy_old_expires_at;
			return false;
		}
	}
	if (row->busy || row->locked)
		ereport(ERROR,
				(errcode(ERRCODE_LOCK_NOT_AVAILABLE),
				 errmsg("could not %s idempotency key %s",
						call_names[call->kind], idem_key_display(scope, key)),
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
	{
		TokenView	view = {row->found, row->expires_at, row->status,
		row->has_token, row->token, row->attempt};

		if (!token_call_judge(call, &view))
			return false;
	}
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
 * Finish the key of "call" (arguments checked): store the result unless
 * the key was finished with this same token already.  Returns the key's
 * expiry; *wrote says whether it stored the result (the caller counts it).
 */
static TimestampTz
finish_key(TokenCall *call, IdemStatus status, bool has_code, int32 code,
		   Datum body, Interval *retention, bool *wrote)
{
	TimestampTz expires_at;

	*wrote = false;
	if (!token_call_begin(call))
	{
		idem_key_unlock(call->hash);
		return call->row.expires_at;
	}
	expires_at = add_interval(call->now,
							  retention ? retention : &call->row.retention);
	idem_write_finish(&call->row, status, has_code, code, body, call->now,
					  expires_at);
	token_call_end(call);
	*wrote = true;
	return expires_at;
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
	bool		wrote;

	token_call_args(fcinfo, CALL_FINISH, 0, 4, &call);
	body = arg_body(fcinfo, 3, "response_body");
	status = arg_status(fcinfo, 5);
	retention = arg_interval(fcinfo, 6);
	check_positive(retention, "retention");

	expires_at = finish_key(&call, status, !PG_ARGISNULL(2),
							PG_ARGISNULL(2) ? 0 : PG_GETARG_INT32(2),
							body, retention, &wrote);
	if (wrote)
		idem_stats_count(IDEM_STAT_FINISHES, 1);
	PG_RETURN_TIMESTAMPTZ(expires_at);
}

/* The element of idem_finish_many being finished: its position, its call. */
typedef struct FinishManyElement
{
	int			ord;			/* from 1 */
	TokenCall	call;
} FinishManyElement;

/* Name the batch element an error is about (an error context callback). */
static void
finish_many_context(void *arg)
{
	const FinishManyElement *elem = (const FinishManyElement *) arg;

	/* Between elements (an interrupt, say) there is no key to name. */
	if (elem->call.key == NULL)
		return;
	errcontext("idem_finish_many element %d, key %s",
			   elem->ord, idem_key_display(elem->call.scope, elem->call.key));
}

/*
 * idem_finish_many(keys, tokens, response_codes, response_bodies, scope,
 *					status, retention)
 *	  RETURNS TABLE (ord, key, expires_at)
 *
 * All or nothing: each key is finished as idem_finish would, in array
 * order, and the first element that idem_finish would refuse raises its
 * error, with the element's position and key in the error's context.  The
 * error aborts the statement, which undoes the elements finished before
 * it.  Every argument is checked before any key is touched.
 */
Datum
idem_finish_many(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	BatchArray	keys;
	BatchArray	tokens;
	BatchArray	codes;
	BatchArray	bodies;
	text	   *scope;
	IdemStatus	status;
	Interval   *retention;
	ErrorContextCallback errcb;
	FinishManyElement elem;
	int64		finished = 0;
	MemoryContext outer;
	MemoryContext elem_cxt;

	arg_array(fcinfo, 0, "keys", true, TEXTOID, &keys);
	arg_array(fcinfo, 1, "tokens", true, INT8OID, &tokens);
	arg_array(fcinfo, 2, "response_codes", false, INT4OID, &codes);
	arg_array(fcinfo, 3, "response_bodies", false, JSONBOID, &bodies);
	check_batch_length(&tokens, "tokens", keys.n);
	check_batch_length(&codes, "response_codes", keys.n);
	check_batch_length(&bodies, "response_bodies", keys.n);
	check_batch_keys(&keys);
	for (int i = 0; i < keys.n; i++)
	{
		if (tokens.nulls[i])
			ereport(ERROR,
					(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
					 errmsg("tokens[%d] must not be null", i + 1)));
		if (bodies.given && !bodies.nulls[i])
		{
			char	   *name = psprintf("response_bodies[%d]", i + 1);

			check_body_size(bodies.elems[i], name);
			pfree(name);
		}
	}
	scope = arg_name(fcinfo, 4, "scope", true);
	status = arg_status(fcinfo, 5);
	retention = arg_interval(fcinfo, 6);
	check_positive(retention, "retention");
	check_writable("idem_finish_many()");

	result_init(fcinfo);
	outer = CurrentMemoryContext;
	elem_cxt = AllocSetContextCreate(outer, "idem_finish_many element",
									 ALLOCSET_DEFAULT_SIZES);
	/* The callback reads elem from here on: it is valid at every point. */
	memset(&elem, 0, sizeof(FinishManyElement));
	errcb.callback = finish_many_context;
	errcb.arg = &elem;
	errcb.previous = error_context_stack;
	error_context_stack = &errcb;
	for (int i = 0; i < keys.n; i++)
	{
		Datum		values[3];
		bool		nulls[3] = {0};
		bool		has_code = codes.given && !codes.nulls[i];
		bool		wrote;

		memset(&elem, 0, sizeof(FinishManyElement));
		/* Between two elements: a cancel is taken here. */
		IDEM_PAUSE("finish-many-element");
		CHECK_FOR_INTERRUPTS();
		/* What one element allocates is gone before the next. */
		MemoryContextReset(elem_cxt);
		MemoryContextSwitchTo(elem_cxt);
		elem.ord = i + 1;
		elem.call.kind = CALL_FINISH;
		elem.call.key = (text *) DatumGetPointer(keys.elems[i]);
		elem.call.scope = scope;
		elem.call.token = DatumGetInt64(tokens.elems[i]);
		values[0] = Int32GetDatum(i + 1);
		values[1] = keys.elems[i];
		values[2] = TimestampTzGetDatum(
			finish_key(&elem.call, status, has_code,
					   has_code ? DatumGetInt32(codes.elems[i]) : 0,
					   (bodies.given && !bodies.nulls[i]) ?
					   bodies.elems[i] : (Datum) 0,
					   retention, &wrote));
		finished += wrote;
		MemoryContextSwitchTo(outer);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values,
							 nulls);
	}
	error_context_stack = errcb.previous;
	MemoryContextDelete(elem_cxt);
	/* counted once all are done: a refused batch finished nothing */
	idem_stats_count(IDEM_STAT_FINISHES, finished);
	PG_RETURN_VOID();
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

/*
 * idem_checkpoint(key, token, phase, data, scope) RETURNS void
 *	  Record that the current attempt completed the step "phase", with what
 *	  a successor needs to resume from it; replaces an earlier checkpoint.
 */
Datum
idem_checkpoint(PG_FUNCTION_ARGS)
{
	TokenCall	call;
	text	   *phase;
	Datum		data;

	token_call_args(fcinfo, CALL_CHECKPOINT, 0, 4, &call);
	phase = arg_name(fcinfo, 2, "phase", false);
	data = arg_body(fcinfo, 3, "data");

	(void) token_call_begin(&call);
	idem_write_checkpoint(&call.row, PointerGetDatum(phase), data);
	token_call_end(&call);
	idem_stats_count(IDEM_STAT_CHECKPOINTS, 1);

	PG_RETURN_VOID();
}

/* ---------------------------------------------------------------------
 * idem_lookup, idem_sweep
 * ---------------------------------------------------------------------
 */

/*
 * idem_lookup(key, scope) RETURNS TABLE (status, attempt, response_code,
 *		response_body, created_at, finished_at, expires_at, phase)
 * Reads through the caller's snapshot; works on a hot standby.  Before 1.4
 * the row has no phase column (the executor's row type says).
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
	idem_catalog_select_scope(scope);
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
	values[7] = row.phase;
	nulls[7] = (row.phase == (Datum) 0);
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
	check_writable("idem_sweep()");

	result_init(fcinfo);
	start = GetCurrentTimestamp();
	(void) idem_sweep_batch_run(batch, 0, NULL, &expired, &reset);
	/* the coordinator of a distributed table sweeps every node's shards */
	if (idem_catalog_distributed())
		idem_citus_sweep_workers(batch, &expired, &reset);
	idem_stats_sweep_done(GetCurrentTimestamp(),
						  (double) (GetCurrentTimestamp() - start) / 1000.0);

	values[0] = Int64GetDatum(expired);
	values[1] = Int64GetDatum(reset);
	tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	PG_RETURN_VOID();
}
