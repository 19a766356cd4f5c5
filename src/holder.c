/*-------------------------------------------------------------------------
 *
 * holder.c
 *	  The calls that present a claim's token: idem_finish,
 *	  idem_finish_many, idem_extend, idem_release and idem_checkpoint.
 *
 * Owns the judgement of a token against the key's committed row (absent
 * or past its retention: P0002; finished: 55000; another token's: 55006;
 * changing right now with this token current: 55P03), the wait for a
 * change that keeps the token current, the writes each call makes through
 * write.c under the key's lock (keylock.c), and their counters.  A finish
 * repeated with the token that finished the key answers from the stored
 * row.  Arguments are checked by args.c.  Must not claim: a key without a
 * live claim is never created or taken over here (claim.c does that).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "storage/lmgr.h"
#include "utils/builtins.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

#include "args.h"
#include "idempotency.h"

PG_FUNCTION_INFO_V1(idem_finish);
PG_FUNCTION_INFO_V1(idem_finish_many);
PG_FUNCTION_INFO_V1(idem_extend);
PG_FUNCTION_INFO_V1(idem_release);
PG_FUNCTION_INFO_V1(idem_checkpoint);

typedef enum TokenCallKind
{
	CALL_FINISH,
	CALL_EXTEND,
	CALL_RELEASE,
	CALL_CHECKPOINT
} TokenCallKind;

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
	call->key = idem_arg_name(fcinfo, key_arg, "key", false);
	call->scope = idem_arg_name(fcinfo, scope_arg, "scope", true);
	idem_arg_not_null(fcinfo, 1, "token");
	call->token = PG_GETARG_INT64(1);
}

IDEM_NORETURN static void token_call_raise_busy(const TokenCall *call);
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
 * The detail and hint of a 55P03 for "row": what the other transaction is
 * doing to the key, and what the caller can do about it.
 */
static int
errdetail_busy(const IdemRow *row)
{
	if (row->locked)
		return errdetail("Another transaction holds a row lock on this key.");
	if (!row->busy_new)
		return errdetail("Another transaction is deleting this key right now (a release, or a sweep of an expired key).");
	if (row->busy_token == 0)
		return errdetail("Another transaction is resetting this key right now (its lease ended).");
	return errdetail("Another transaction is taking this key over right now.");
}

static int
errhint_busy(const IdemRow *row)
{
	if (row->locked)
		return errhint("Retry once that transaction has ended.");
	return errhint("If that transaction commits, this token is no longer current.");
}

/*
 * Raise 55P03: another transaction is changing the key of "call" (or holds
 * a row lock on it) while its token is current.  One whole message per
 * call, so that each reads (and translates) as written.
 */
static void
token_call_raise_busy(const TokenCall *call)
{
	const IdemRow *row = &call->row;
	char	   *key = idem_key_display(call->scope, call->key);

	switch (call->kind)
	{
		case CALL_FINISH:
			ereport(ERROR,
					(errcode(ERRCODE_LOCK_NOT_AVAILABLE),
					 errmsg("could not finish idempotency key %s", key),
					 errdetail_busy(row), errhint_busy(row)));
			break;
		case CALL_EXTEND:
			ereport(ERROR,
					(errcode(ERRCODE_LOCK_NOT_AVAILABLE),
					 errmsg("could not extend idempotency key %s", key),
					 errdetail_busy(row), errhint_busy(row)));
			break;
		case CALL_RELEASE:
			ereport(ERROR,
					(errcode(ERRCODE_LOCK_NOT_AVAILABLE),
					 errmsg("could not release idempotency key %s", key),
					 errdetail_busy(row), errhint_busy(row)));
			break;
		case CALL_CHECKPOINT:
			ereport(ERROR,
					(errcode(ERRCODE_LOCK_NOT_AVAILABLE),
					 errmsg("could not checkpoint idempotency key %s", key),
					 errdetail_busy(row), errhint_busy(row)));
			break;
	}
	pg_unreachable();
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

	idem_check_writable(call_functions[call->kind]);
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
	 * doing to the key right now: a dead token, a finished key and a key past
	 * its retention get their own errors.  Only a call whose token is current
	 * has to wait for that transaction's outcome (55P03).
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
	else if (row->busy && !row->found)
	{
		/*
		 * No committed version: the key is absent (released, swept or never
		 * claimed) while another transaction inserts it, or inserts and
		 * deletes it.  Absent is what the committed state says, whatever that
		 * transaction does: P0002, as for a key past its retention.
		 */
		TokenView	view = {false};

		(void) token_call_judge(call, &view);
	}
	if (row->busy || row->locked)
		token_call_raise_busy(call);
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
 * the key was finished with this same token already.  Without a remember
 * argument ("remember_given" false) the key keeps the claim's.  Returns the
 * key's expiry; *wrote says whether it stored the result (the caller counts
 * it).
 */
static TimestampTz
finish_key(TokenCall *call, IdemStatus status, bool has_code, int32 code,
		   Datum body, Interval *retention, bool remember_given,
		   Interval *remember, bool *wrote)
{
	TimestampTz expires_at;

	*wrote = false;
	if (!token_call_begin(call))
	{
		idem_key_unlock(call->hash);
		return call->row.expires_at;
	}
	expires_at = idem_add_interval(call->now,
								   retention ? retention : &call->row.retention);
	if (!remember_given && call->row.has_remember)
		remember = &call->row.remember;
	idem_write_finish(&call->row, status, has_code, code, body, call->now,
					  expires_at, remember);
	token_call_end(call);
	*wrote = true;
	return expires_at;
}

/*
 * idem_finish(key, token, response_code, response_body, scope, status,
 *			   retention, remember) RETURNS timestamptz
 */
Datum
idem_finish(PG_FUNCTION_ARGS)
{
	TokenCall	call;
	Datum		body;
	IdemStatus	status;
	Interval   *retention;
	Interval   *remember;
	bool		remember_given;
	TimestampTz expires_at;
	bool		wrote;

	token_call_args(fcinfo, CALL_FINISH, 0, 4, &call);
	body = idem_arg_body(fcinfo, 3, "response_body");
	status = idem_arg_status(fcinfo, 5);
	retention = idem_arg_interval(fcinfo, 6);
	idem_check_positive(retention, "retention");
	remember_given = idem_arg_remember(fcinfo, 7, &remember);

	expires_at = finish_key(&call, status, !PG_ARGISNULL(2),
							PG_ARGISNULL(2) ? 0 : PG_GETARG_INT32(2),
							body, retention, remember_given, remember,
							&wrote);
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

/*
 * Raise again the error "edata" that element "ord" (key "key") of
 * idem_finish_many raised, its message prefixed with the element's position
 * and key: every field of the error stays as idem_finish would raise it,
 * and a client reads the element from the message, where every edition of
 * the extension can put it.
 */
static void
finish_many_rethrow(ErrorData *edata, int ord, text *scope, text *key)
{
	edata->message = psprintf("idem_finish_many element %d, key %s: %s", ord,
							  idem_key_display(scope, key), edata->message);
	ReThrowError(edata);
}

/*
 * idem_finish_many(keys, tokens, response_codes, response_bodies, scope,
 *					status, retention, remember)
 *	  RETURNS TABLE (ord, key, expires_at)
 *
 * All or nothing: each key is finished as idem_finish would, in array
 * order, and the first element that idem_finish would refuse raises its
 * error, with the element's position and key before its message.  The
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
	Interval   *remember;
	bool		remember_given;
	FinishManyElement elem;

	/* the element being finished, read after an error (NULL between two) */
	volatile int cur_ord = 0;
	text	   *volatile cur_key = NULL;
	volatile int64 finished = 0;
	MemoryContext outer;
	MemoryContext elem_cxt;

	idem_arg_array(fcinfo, 0, "keys", true, TEXTOID, &keys);
	idem_arg_array(fcinfo, 1, "tokens", true, INT8OID, &tokens);
	idem_arg_array(fcinfo, 2, "response_codes", false, INT4OID, &codes);
	idem_arg_array(fcinfo, 3, "response_bodies", false, JSONBOID, &bodies);
	idem_check_batch_length(&tokens, "tokens", keys.n);
	idem_check_batch_length(&codes, "response_codes", keys.n);
	idem_check_batch_length(&bodies, "response_bodies", keys.n);
	idem_check_batch_keys(&keys);
	for (int i = 0; i < keys.n; i++)
	{
		if (tokens.nulls[i])
			ereport(ERROR,
					(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
					 errmsg("tokens[%d] must not be null", i + 1)));
		if (bodies.given && !bodies.nulls[i])
		{
			char	   *name = psprintf("response_bodies[%d]", i + 1);

			idem_check_body_size(bodies.elems[i], name);
			pfree(name);
		}
	}
	scope = idem_arg_name(fcinfo, 4, "scope", true);
	status = idem_arg_status(fcinfo, 5);
	retention = idem_arg_interval(fcinfo, 6);
	idem_check_positive(retention, "retention");
	remember_given = idem_arg_remember(fcinfo, 7, &remember);
	idem_check_writable("idem_finish_many()");

	idem_result_init(fcinfo);
	outer = CurrentMemoryContext;
	elem_cxt = AllocSetContextCreate(outer, "idem_finish_many element",
									 ALLOCSET_DEFAULT_SIZES);
	PG_TRY();
	{
		for (int i = 0; i < keys.n; i++)
		{
			Datum		values[3];
			bool		nulls[3] = {0};
			bool		has_code = codes.given && !codes.nulls[i];
			bool		wrote;

			memset(&elem, 0, sizeof(FinishManyElement));
			cur_key = NULL;
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
			cur_ord = elem.ord;
			cur_key = elem.call.key;
			values[0] = Int32GetDatum(i + 1);
			values[1] = keys.elems[i];
			values[2] = TimestampTzGetDatum(
											finish_key(&elem.call, status, has_code,
													   has_code ? DatumGetInt32(codes.elems[i]) : 0,
													   (bodies.given && !bodies.nulls[i]) ?
													   bodies.elems[i] : (Datum) 0,
													   retention, remember_given,
													   remember, &wrote));
			finished += wrote;
			MemoryContextSwitchTo(outer);
			tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values,
								 nulls);
		}
	}
	PG_CATCH();
	{
		ErrorData  *edata;

		MemoryContextSwitchTo(outer);
		edata = CopyErrorData();

		/*
		 * A cancel or a statement timeout is about the statement, not the
		 * element it happened to interrupt.
		 */
		if (cur_key == NULL || edata->sqlerrcode == ERRCODE_QUERY_CANCELED)
			PG_RE_THROW();
		FlushErrorState();
		finish_many_rethrow(edata, cur_ord, scope, cur_key);
	}
	PG_END_TRY();
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
	lease = idem_arg_interval(fcinfo, 2);
	idem_check_positive(lease, "lease");

	(void) token_call_begin(&call);
	lease_until = idem_add_interval(call.now, lease ? lease :
									idem_interval_from_ms(idem_lease_ms));
	expires_at = Max(idem_add_interval(call.now, &call.row.retention), lease_until);
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
	phase = idem_arg_name(fcinfo, 2, "phase", false);
	data = idem_arg_body(fcinfo, 3, "data");

	(void) token_call_begin(&call);
	idem_write_checkpoint(&call.row, PointerGetDatum(phase), data);
	token_call_end(&call);
	idem_stats_count(IDEM_STAT_CHECKPOINTS, 1);

	PG_RETURN_VOID();
}
