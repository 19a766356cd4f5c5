/*-------------------------------------------------------------------------
 *
 * claim.c
 *	  idem_claim, idem_claim_many and idem_claim_abandoned: the claim
 *	  decision and its wait.
 *
 * Owns the outcome rules (claimed, replay, in_progress, mismatch, and
 * expired for a remembered key), the
 * takeover of a key whose lease ended (also by a completer's
 * idem_claim_abandoned, and the request a claim keeps for it), the tokens
 * this transaction's
 * claims handed out (so that a transaction never takes over its own
 * claim), the wait for an attempt in flight, the claim's result row and
 * the claim counters.  Reads go through row.c, writes through write.c,
 * under the key's lock (keylock.c); arguments are checked by args.c.
 * Must not touch a key it has not claimed: the calls that present a token
 * live in holder.c.
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
#include "catalog/pg_type.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "storage/latch.h"
#include "utils/builtins.h"
#include "utils/datum.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"
#include "utils/wait_event.h"

#include "args.h"
#include "idempotency.h"

PG_FUNCTION_INFO_V1(idem_claim);
PG_FUNCTION_INFO_V1(idem_claim_many);
PG_FUNCTION_INFO_V1(idem_claim_abandoned);
/* Without preloading, a waiter polls this often (the documented bound). */
#define WAIT_POLL_MS			10
/* With preloading, a safety net in case a wake-up is lost (2PC). */
#define WAIT_SAFETY_MS			1000
/* The most keys one idem_claim_abandoned call takes over. */
#define ABANDONED_MAX_KEYS		10000

/*
 * Columns of idem_claim's result row (1.4; older installations declare
 * the first 7, and get those).
 */
#define CLAIM_RESULT_COLS		9

typedef enum ClaimOutcome
{
	OUTCOME_CLAIMED,
	OUTCOME_REPLAY,
	OUTCOME_IN_PROGRESS,
	OUTCOME_MISMATCH,
	OUTCOME_EXPIRED
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
		case OUTCOME_EXPIRED:
			return "expired";
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
	Interval   *remember;		/* NULL: not remembered */
	Datum		request;		/* the request to keep with the key, or 0 */
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

/* ---------------------------------------------------------------------
 * The decision
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
static int64 xact_first_token = 0;	/* 0: none yet (tokens start at 1) */
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
	if (!row->found ||
		(row->expires_at <= now && !idem_row_remembered(row, now)))
		return claim_write_action(row, ACTION_FRESH, res);
	if (!fingerprint_matches(args, row))
	{
		res->outcome = OUTCOME_MISMATCH;
		return ACTION_ANSWER;
	}
	/* Remembered: it ran, and its answer is gone; it never runs again. */
	if (row->expires_at <= now)
	{
		res->outcome = OUTCOME_EXPIRED;
		res->status = row->status;
		res->has_response_code = row->has_response_code;
		res->response_code = row->response_code;
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
	 * the owner's session ended the key is reclaimable at once.  A claim that
	 * our own open transaction (or an earlier element of this batch) made is
	 * held by us whatever its lease: taking it over would hand out a second
	 * token for an attempt that is still running here.
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
 * The deadlines of a new attempt claimed at "now": its lease's end, and
 * when the key expires, "retention" later but never before the lease ends.
 */
static void
claim_deadlines(TimestampTz now, Interval *lease, Interval *retention,
				TimestampTz *lease_until, TimestampTz *expires_at)
{
	*lease_until = idem_add_interval(now, lease);
	*expires_at = Max(idem_add_interval(now, retention), *lease_until);
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
	 * unless the key was absent and no key of its slice was written since we
	 * looked (keylock.c, idem_key_write_count; a fresh key is the common
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

		lease = args->lease ? args->lease : idem_interval_from_ms(idem_lease_ms);
		retention = args->retention ? args->retention :
			idem_interval_from_ms((int64) idem_retention_s * 1000);
		claim_deadlines(now, lease, retention, &lease_until, &expires_at);
		token = idem_token_claim(row.found ? &row : NULL);

		if (!row.found)
			idem_write_insert_claim(args->scope, args->key, token,
									args->has_fingerprint ? args->fingerprint : NULL,
									now, lease_until, expires_at, retention,
									owner_session, args->remember,
									args->request);
		else
			idem_write_update_claim(&row, token,
									action == ACTION_FRESH ? 1 : row.attempt + 1,
									args->has_fingerprint ? args->fingerprint : NULL,
									action == ACTION_FRESH ? now : row.created_at,
									lease_until, expires_at, retention,
									owner_session, args->remember,
									args->request);
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

			/* Each round's probe allocates afresh: a long wait must not grow */
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
			if (!reg.published) /* not preloaded: nobody will wake us */
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
		case OUTCOME_EXPIRED:
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
	args->scope = idem_arg_name(fcinfo, 2, "scope", true);
	args->lease = idem_arg_interval(fcinfo, 3);
	args->retention = idem_arg_interval(fcinfo, 4);
	idem_check_positive(args->lease, "lease");
	idem_check_positive(args->retention, "retention");
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
		case OUTCOME_EXPIRED:	/* the same, without a body (it is gone) */
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
 * idem_claim(key, request, scope, lease, retention, wait, session_bound,
 *			  remember, keep_request)
 *	  RETURNS SETOF idempotency.claim_result (outcome, token, attempt,
 *	  status, response_code, response_body, retry_after, phase,
 *	  phase_data): always one row.  Installations of 1.0 to 1.3 declare
 *	  the first six arguments and the first seven columns (1.0 as RETURNS
 *	  TABLE), 1.4 to 1.6 the first seven arguments, 1.7 the first eight;
 *	  the row is built for the row type the executor expects.
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

	args.key = idem_arg_name(fcinfo, 0, "key", false);
	claim_common_args(fcinfo, &args);
	wait_us = idem_arg_wait(fcinfo, 5);
	args.session_bound = false;
	if (PG_NARGS() > 6)
	{
		idem_arg_not_null(fcinfo, 6, "session_bound");
		args.session_bound = PG_GETARG_BOOL(6);
	}
	if (!idem_arg_remember(fcinfo, 7, &args.remember))
		args.remember = idem_remember_setting();
	/* kept for a completer: as large as a response may be */
	args.request = (Datum) 0;
	if (PG_NARGS() > 8 && !PG_ARGISNULL(8) && PG_GETARG_BOOL(8))
		args.request = idem_arg_body(fcinfo, 1, "request");
	idem_check_writable("idem_claim()");
	idem_tenant_check(args.scope);
	idem_catalog_select_scope(args.scope);
	if (args.session_bound)
		claim_check_session_bound();

	args.has_fingerprint = !PG_ARGISNULL(1);
	if (args.has_fingerprint)
		idem_fingerprint(PG_GETARG_DATUM(1), args.fingerprint);
	args.hash = idem_key_hash(args.scope, args.key);

	idem_result_init(fcinfo);
	claim_with_wait(&args, wait_us, &res);
	claim_count(&res);

	claim_result_values(&res, values, nulls);
	tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	PG_RETURN_VOID();
}

Datum
idem_claim_many(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	BatchArray	keys;
	BatchArray	requests;
	ClaimArgs	args;
	MemoryContext outer = CurrentMemoryContext;
	MemoryContext elem_cxt;
	IdemTokenBatch outer_batch;

	idem_arg_array(fcinfo, 0, "keys", true, TEXTOID, &keys);
	idem_arg_array(fcinfo, 1, "requests", false, JSONBOID, &requests);
	idem_check_batch_length(&requests, "requests", keys.n);
	idem_check_batch_keys(&keys);
	claim_common_args(fcinfo, &args);
	idem_arg_not_null(fcinfo, 5, "session_bound");
	args.session_bound = PG_GETARG_BOOL(5);
	args.remember = idem_remember_setting();
	args.request = (Datum) 0;
	idem_check_writable("idem_claim_many()");
	idem_tenant_check(args.scope);
	idem_catalog_select_scope(args.scope);
	if (args.session_bound)
		claim_check_session_bound();

	idem_result_init(fcinfo);
	elem_cxt = AllocSetContextCreate(outer, "idempotency batch element",
									 ALLOCSET_SMALL_SIZES);
	/* one WAL flush for the batch's tokens, when it returns them */
	idem_token_defer_flush(&outer_batch);
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
		idem_token_flush(&outer_batch, false);
		PG_RE_THROW();
	}
	PG_END_TRY();
	idem_token_flush(&outer_batch, true);
	MemoryContextDelete(elem_cxt);
	PG_RETURN_VOID();
}

/*
 * Take over the abandoned key "cand" of "scope" (judged again under its
 * lock, with the newest row), for a new attempt with a lease until
 * "lease_until".  False when it is no longer abandoned, or another
 * transaction or backend is at it: skipped, never waited for.  Fills
 * "values" and "nulls" with its result row.
 */
static bool
claim_abandoned_one(text *scope, const IdemAbandoned *cand, TimestampTz now,
					Interval *lease, Datum *values, bool *nulls)
{
	uint64		hash = idem_key_hash(scope, cand->key);
	IdemRow		row;
	TimestampTz lease_until;
	TimestampTz expires_at;
	int64		token;

	if (!idem_key_lock(hash, false))
		return false;
	idem_row_probe(scope, cand->key, IDEM_PROBE_LATEST, true, &row);
	if (row.busy || row.locked || !idem_row_abandoned(&row, now) ||
		claim_held_here(&row))
	{
		idem_key_unlock(hash);
		return false;
	}
	idem_row_check_snapshot(&row);

	/* as a claim's takeover, keeping what the key was claimed with */
	claim_deadlines(now, lease, &row.retention, &lease_until, &expires_at);
	token = idem_token_claim(&row);
	idem_write_update_claim(&row, token, row.attempt + 1,
							row.has_fingerprint ? row.fingerprint : NULL,
							row.created_at, lease_until, expires_at,
							&row.retention, 0,
							row.has_remember ? &row.remember : NULL,
							(Datum) 0);
	idem_key_wrote(hash);
	idem_key_unlock(hash);
	xact_token_issued(token);

	values[0] = PointerGetDatum(cand->key);
	values[1] = Int64GetDatum(token);
	values[2] = Int32GetDatum(row.attempt + 1);
	values[3] = row.request != (Datum) 0 ?
		PointerGetDatum(PG_DETOAST_DATUM(row.request)) : (Datum) 0;
	values[4] = row.phase;
	values[5] = row.phase_data != (Datum) 0 ?
		PointerGetDatum(PG_DETOAST_DATUM(row.phase_data)) : (Datum) 0;
	nulls[0] = nulls[1] = nulls[2] = false;
	nulls[3] = row.request == (Datum) 0;
	nulls[4] = row.phase == (Datum) 0;
	nulls[5] = row.phase_data == (Datum) 0;
	return true;
}

/*
 * idem_claim_abandoned(scope, max_keys, lease)
 *	  RETURNS TABLE (key, token, attempt, request, phase, phase_data)
 *
 * A completer's claim: take over up to max_keys keys of the scope whose
 * attempt was abandoned (a sweep reset it, its lease ended, or its
 * session-bound owner's session ended), oldest first, each exactly
 * as a claim's takeover would (attempt + 1, a new token, the old one
 * dead), without the request: the one the key was claimed with, if it was
 * kept, is returned with the last recovery point.  Keys that someone else
 * is at are skipped, never waited for.
 */
Datum
idem_claim_abandoned(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	text	   *scope;
	int32		max_keys;
	Interval   *lease;
	TimestampTz now;
	IdemAbandoned *cands;
	int			ncands;
	volatile int taken = 0;
	MemoryContext outer = CurrentMemoryContext;
	MemoryContext elem_cxt;
	IdemTokenBatch outer_batch;

	scope = idem_arg_name(fcinfo, 0, "scope", true);
	idem_arg_not_null(fcinfo, 1, "max_keys");
	max_keys = PG_GETARG_INT32(1);
	if (max_keys < 1 || max_keys > ABANDONED_MAX_KEYS)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("max_keys must be between 1 and %d", ABANDONED_MAX_KEYS)));
	lease = idem_arg_interval(fcinfo, 2);
	idem_check_positive(lease, "lease");
	if (lease == NULL)
		lease = idem_interval_from_ms(idem_lease_ms);
	idem_check_writable("idem_claim_abandoned()");
	idem_tenant_check(scope);
	idem_catalog_select_scope(scope);

	idem_result_init(fcinfo);
	now = GetCurrentTimestamp();
	/* more than asked for: some may be taken by others meanwhile */
	ncands = idem_row_abandoned_candidates(scope, now, max_keys * 2 + 8,
										   &cands);
	elem_cxt = AllocSetContextCreate(outer, "idempotency abandoned key",
									 ALLOCSET_SMALL_SIZES);
	/* one WAL flush for the tokens, when the call returns them */
	idem_token_defer_flush(&outer_batch);
	PG_TRY();
	{
		for (int i = 0; i < ncands && taken < max_keys; i++)
		{
			Datum		values[6];
			bool		nulls[6];
			bool		took;

			CHECK_FOR_INTERRUPTS();
			MemoryContextReset(elem_cxt);
			MemoryContextSwitchTo(elem_cxt);
			took = claim_abandoned_one(scope, &cands[i], now, lease, values,
									   nulls);
			MemoryContextSwitchTo(outer);
			if (!took)
				continue;
			taken++;
			idem_stats_count(IDEM_STAT_CLAIMS, 1);
			idem_stats_count(IDEM_STAT_TAKEOVERS, 1);
			idem_stats_count(IDEM_STAT_ABANDONED_TAKEOVERS, 1);
			tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values,
								 nulls);
		}
	}
	PG_CATCH();
	{
		idem_token_flush(&outer_batch, false);
		PG_RE_THROW();
	}
	PG_END_TRY();
	idem_token_flush(&outer_batch, true);
	MemoryContextDelete(elem_cxt);
	PG_RETURN_VOID();
}
