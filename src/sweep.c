/*-------------------------------------------------------------------------
 *
 * sweep.c
 *	  Sweeping: one sweep batch, shared by the background worker and
 *	  idem_sweep(), the SQL entry point at the end of this file.
 *
 * Owns the sweep rules: a key whose retention has passed is deleted, unless
 * it is pending under a live lease, or finished and remembered: then it is
 * compacted (its response and recovery point go, its outcome and
 * fingerprint stay) and deleted once its remember passes too; a pending
 * key whose lease has ended is
 * reset (its token dies; the next claim takes over with attempt + 1).  A
 * key that another transaction is changing right now, or whose lock is
 * taken, is skipped, so a sweep never waits on a claim and never removes a
 * key an open transaction is claiming.  A key found before its time (its
 * sweep_at is only a lower bound: finish and extend leave it alone so that
 * they stay HOT updates) is rescheduled to when it will be due.  A
 * session-bound key whose session ended is treated as if its lease had
 * ended: reset (or deleted, past its retention) without waiting for the
 * lease; such keys are found through keys_owner_session_idx whenever a
 * session with a binding ended since the last look.  A reset key is
 * abandoned: the sweep notifies idempotency_abandoned with its scope, so
 * that completers waiting on that channel take it over (PostgreSQL sends
 * a notification once per transaction however often it is queued, and
 * only at commit).  Must not commit: callers decide the transaction
 * boundaries.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "commands/async.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

#include "args.h"
#include "idempotency.h"

PG_FUNCTION_INFO_V1(idem_sweep);

/* Keys locked and written together (advisory locks held at once). */
#define SWEEP_CHUNK			128
/* Rows of keys_owner_session_idx read at a time. */
#define SESSION_SCAN_CHUNK	4096
/* What completers listen on; the payload is the scope. */
#define ABANDONED_CHANNEL	"idempotency_abandoned"

/*
 * Is the key pending under a lease that still runs at "now", held by a
 * session that still lives if the claim was session-bound?
 */
static bool
sweep_lease_runs(const IdemRow *row, TimestampTz now)
{
	return row->status == IDEM_PENDING && row->has_token &&
		row->lease_until > now &&
		(!row->has_owner_session || idem_session_alive(row->owner_session));
}

/*
 * When a key needs the sweeper next, once "kind" is done to it: at the end
 * of a running lease, else when its retention passes (a reset key has no
 * lease left), or, past that, when a remembered key is to be forgotten.
 */
static TimestampTz
sweep_due(const IdemRow *row, IdemSweepWork kind, TimestampTz now)
{
	TimestampTz until;

	if (kind != IDEM_SWEEP_RESET && sweep_lease_runs(row, now))
		return row->lease_until;
	if (row->expires_at <= now && idem_row_remembered_until(row, &until))
		return until;
	return row->expires_at;
}

/*
 * Sweep up to "n" candidate keys (n <= SWEEP_CHUNK) as one chunk: take each
 * key's lock without waiting, re-read its row version under the lock, sort
 * the keys into delete / reset / reschedule, apply each kind at once,
 * then release the locks.  Keys whose lock is taken, that
 * another transaction is changing, that our own open transaction is
 * claiming, or whose row changed since the candidate query are skipped.
 * Never does more than "batch" of each kind in total.  With "only_ended"
 * (keys of ended sessions), a key that needs no delete or reset is left
 * alone.  Returns how many rows it changed.
 */
static int
sweep_chunk(ItemPointerData *tids, text **scopes, text **keys, int n,
			TimestampTz now, int batch, bool only_ended, int64 *expired,
			int64 *reset)
{
	uint64		locked[SWEEP_CHUNK];
	IdemSweepItem work[IDEM_SWEEP_NKINDS][SWEEP_CHUNK];
	uint64		work_hash[IDEM_SWEEP_NKINDS][SWEEP_CHUNK];
	text	   *work_scope[IDEM_SWEEP_NKINDS][SWEEP_CHUNK];
	int			nwork[IDEM_SWEEP_NKINDS] = {0};
	int			done[IDEM_SWEEP_NKINDS];
	int			nlocked = 0;
	IdemFetch	fetch;

	idem_row_fetch_begin(&fetch);
	for (int i = 0; i < n; i++)
	{
		uint64		hash = idem_key_hash(scopes[i], keys[i]);
		IdemRow		row;
		IdemSweepWork kind;

		if (!idem_key_lock(hash, false))
			continue;			/* someone is in its critical section */
		locked[nlocked++] = hash;

		idem_row_fetch(&fetch, &tids[i], scopes[i], keys[i], &row);
		if (!row.found || row.busy || row.locked ||
			(row.mine && row.status == IDEM_PENDING))
			continue;
		idem_row_check_snapshot(&row);

		if (row.expires_at <= now && !sweep_lease_runs(&row, now))
		{
			if (*expired + nwork[IDEM_SWEEP_DELETE] +
				nwork[IDEM_SWEEP_COMPACT] >= batch)
				continue;
			if (!idem_row_remembered(&row, now))
				kind = IDEM_SWEEP_DELETE;
			/* compacted once, when its retention passed (sweep_at moved) */
			else if (row.sweep_at > row.expires_at)
				kind = IDEM_SWEEP_RESCHEDULE;
			else
				kind = IDEM_SWEEP_COMPACT;
		}
		else if (row.status == IDEM_PENDING && row.has_token &&
				 !sweep_lease_runs(&row, now))
		{
			if (*reset + nwork[IDEM_SWEEP_RESET] >= batch)
				continue;
			kind = IDEM_SWEEP_RESET;
		}
		else if (only_ended)
			continue;
		else
			kind = IDEM_SWEEP_RESCHEDULE;
		work[kind][nwork[kind]].tid = row.tid;
		work[kind][nwork[kind]].sweep_at =
			sweep_due(&row, kind, now);
		work_scope[kind][nwork[kind]] = scopes[i];
		work_hash[kind][nwork[kind]++] = hash;
	}

	idem_row_fetch_end(&fetch);
	/* The chunk is sorted; nothing is written yet. */
	IDEM_PAUSE("sweep-chunk-sorted");

	for (int kind = 0; kind < IDEM_SWEEP_NKINDS; kind++)
	{
		done[kind] = idem_write_sweep((IdemSweepWork) kind, work[kind],
									  nwork[kind]);
		/* Counted whether or not the write skipped the row. */
		for (int i = 0; i < nwork[kind]; i++)
			idem_key_wrote(work_hash[kind][i]);
	}
	for (int i = 0; i < nlocked; i++)
		idem_key_unlock(locked[i]);
	for (int i = 0; i < nwork[IDEM_SWEEP_RESET]; i++)
		if (work[IDEM_SWEEP_RESET][i].done)
			Async_Notify(ABANDONED_CHANNEL,
						 text_to_cstring(work_scope[IDEM_SWEEP_RESET][i]));

	/* a compacted key's response is gone: it counts as expired */
	*expired += done[IDEM_SWEEP_DELETE] + done[IDEM_SWEEP_COMPACT];
	*reset += done[IDEM_SWEEP_RESET];
	return done[IDEM_SWEEP_DELETE] + done[IDEM_SWEEP_RESET] +
		done[IDEM_SWEEP_RESCHEDULE] + done[IDEM_SWEEP_COMPACT];
}

/*
 * Reset (or delete, past retention) the pending keys of sessions that
 * ended, up to "batch" of each kind: a scan of keys_owner_session_idx,
 * which holds only keys still bound to a session, so it reads nothing
 * else.  It goes through the index SESSION_SCAN_CHUNK rows at a time, in
 * session order, and asks each session's liveness once per chunk (the
 * index returns a session's keys together).  When an ended session's keys
 * run over the end of a chunk, the next chunk starts at that session again
 * (the keys reset meanwhile are no longer in the index); a chunk that
 * changed none of them moves on past it.  Returns true when it stopped
 * before the end: the batch filled, or keys of an ended session were left
 * (skipped, because others were changing them), so that the caller looks
 * again next time.
 */
static bool
sweep_ended_sessions(MemoryContext cxt, TimestampTz now, int batch,
					 int64 *expired, int64 *reset)
{
	int64		after = 0;
	bool		unfinished = false;

	for (;;)
	{
		ItemPointerData *tids;
		text	  **scopes;
		text	  **keys;
		int64	   *sessions;
		int			n;
		int			ndead = 0;
		int			progress = 0;
		int64		last = 0;
		bool		last_alive = true;
		MemoryContext old;

		CHECK_FOR_INTERRUPTS();
		MemoryContextReset(cxt);
		old = MemoryContextSwitchTo(cxt);
		n = idem_row_session_candidates(after, SESSION_SCAN_CHUNK, &tids,
										&scopes, &keys, &sessions);
		MemoryContextSwitchTo(old);
		for (int i = 0; i < n; i++)
		{
			if (sessions[i] != last)
			{
				last = sessions[i];
				last_alive = idem_session_alive(last);
			}
			if (last_alive)
				continue;
			tids[ndead] = tids[i];
			scopes[ndead] = scopes[i];
			keys[ndead++] = keys[i];
		}
		for (int i = 0; i < ndead && *expired < batch && *reset < batch;
			 i += SWEEP_CHUNK)
		{
			CHECK_FOR_INTERRUPTS();
			progress += sweep_chunk(&tids[i], &scopes[i], &keys[i],
									Min(SWEEP_CHUNK, ndead - i), now, batch,
									true, expired, reset);
		}
		if (ndead > 0 && (*expired >= batch || *reset >= batch))
			return true;
		unfinished = unfinished || progress < ndead;
		if (n < SESSION_SCAN_CHUNK)
			break;
		/* the last session's keys may go on in the next chunk */
		after = (!last_alive && progress > 0) ? sessions[n - 1] - 1 :
			sessions[n - 1];
	}
	return unfinished;
}

/*
 * Sweep one relation of keys (the table, or a local shard on Citus): at
 * most "batch" keys of each kind, counted into *expired and *reset; the
 * keys of ended sessions too when "sessions" is set, after which
 * *sessions_done tells whether all of them were seen to.  Returns true
 * when more rows may be due.
 */
static bool
sweep_relation(int batch, int max_fetches, bool sessions, bool *sessions_done,
			   int64 *expired, int64 *reset)
{
	TimestampTz now = GetCurrentTimestamp();
	int			limit = (int) Min((int64) batch * 2, (int64) PG_INT32_MAX);
	bool		more = false;
	MemoryContext fetch_cxt;

	*expired = 0;
	*reset = 0;
	*sessions_done = !sessions;

	fetch_cxt = AllocSetContextCreate(CurrentMemoryContext,
									  "idempotency sweep fetch",
									  ALLOCSET_DEFAULT_SIZES);
	for (int fetch = 0; max_fetches == 0 || fetch < max_fetches; fetch++)
	{
		ItemPointerData *tids;
		text	  **scopes;
		text	  **keys;
		int			n;
		int			progress = 0;
		MemoryContext old;

		CHECK_FOR_INTERRUPTS();
		MemoryContextReset(fetch_cxt);
		old = MemoryContextSwitchTo(fetch_cxt);
		n = idem_row_sweep_candidates(now, limit, &tids, &scopes, &keys);
		MemoryContextSwitchTo(old);
		for (int i = 0; i < n && *expired < batch && *reset < batch;
			 i += SWEEP_CHUNK)
		{
			CHECK_FOR_INTERRUPTS();
			progress += sweep_chunk(&tids[i], &scopes[i], &keys[i],
									Min(SWEEP_CHUNK, n - i), now, batch,
									false, expired, reset);
			IDEM_PAUSE("sweep-chunk-done");
		}
		more = (n == limit && progress > 0);
		if (!more || *expired >= batch || *reset >= batch)
			break;
	}
	if (sessions && *expired < batch && *reset < batch)
	{
		MemoryContextReset(fetch_cxt);
		if (sweep_ended_sessions(fetch_cxt, now, batch, expired, reset))
			more = true;		/* not done with them: look again next time */
		else
			*sessions_done = true;
	}
	MemoryContextDelete(fetch_cxt);
	return more || *expired >= batch || *reset >= batch;
}

/*
 * Sweep at most "batch" keys of each kind (expired, reset) in the current
 * transaction, in each relation that holds keys on this node (one, or on
 * Citus each local shard: a node sweeps the shards it holds, and a
 * coordinator that holds none sweeps nothing), counting them into
 * *expired and *reset.  Rows found before
 * their time (a key finished or extended after its claim) are rescheduled
 * on the way and do not count, so a call keeps fetching candidates until a
 * kind is full, nothing more is due, or every remaining candidate was
 * skipped; "max_fetches" (0: no limit) bounds that for the worker, which
 * slices its visits by time.  The keys of ended sessions are looked for
 * when "sessions_seen" is NULL (idem_sweep) or when sessions with a binding
 * ended since the count it holds (the worker's, which starts from a value
 * no count has), which is then moved on.
 * Returns true when more rows may be due.
 */
bool
idem_sweep_batch_run(int batch, int max_fetches, uint64 *sessions_seen,
					 int64 *expired, int64 *reset)
{
	uint64		ends = idem_session_ends();
	bool		sessions = sessions_seen == NULL || ends != *sessions_seen;
	bool		all_sessions_done = true;
	bool		more = false;
	int			nrel = idem_catalog_local_count();

	*expired = 0;
	*reset = 0;
	for (int r = 0; r < nrel; r++)
	{
		int64		rel_expired;
		int64		rel_reset;
		bool		sessions_done;

		if (!idem_catalog_select_local(r))
		{
			more = true;		/* the shard map changed: look again */
			all_sessions_done = false;
			continue;
		}
		if (sweep_relation(batch, max_fetches, sessions, &sessions_done,
						   &rel_expired, &rel_reset))
			more = true;
		all_sessions_done &= sessions_done;
		*expired += rel_expired;
		*reset += rel_reset;
	}
	if (sessions && all_sessions_done && sessions_seen != NULL)
		*sessions_seen = ends;

	idem_stats_count(IDEM_STAT_EXPIRED, *expired);
	idem_stats_count(IDEM_STAT_RESET, *reset);
	return more;
}

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
	idem_check_writable("idem_sweep()");

	idem_result_init(fcinfo);
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
