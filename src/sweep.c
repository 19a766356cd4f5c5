/*-------------------------------------------------------------------------
 *
 * sweep.c
 *	  One sweep batch, shared by idem_sweep() and the background worker.
 *
 * Owns the sweep rules: a key whose retention has passed is deleted, unless
 * it is pending under a live lease; a pending key whose lease has ended is
 * reset (its token dies; the next claim takes over with attempt + 1).  A
 * key that another transaction is changing right now, or whose lock is
 * taken, is skipped, so a sweep never waits on a claim and never removes a
 * key an open transaction is claiming.  A key found before its time (its
 * sweep_at is only a lower bound: finish and extend leave it alone so that
 * they stay HOT updates) is rescheduled to when it will be due.  Must not
 * commit: callers decide the transaction boundaries.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "utils/timestamp.h"

#include "idempotency.h"

/*
 * Sweep one candidate key under its lock.  Returns false when the key was
 * skipped (its lock is taken, another transaction is changing it, or our
 * own open transaction is claiming it).
 */
static bool
sweep_one(text *scope, text *key, TimestampTz now, int64 *expired,
		  int64 *reset)
{
	uint64		hash = idem_key_hash(scope, key);
	IdemRow		row;
	bool		live_lease;
	bool		done = false;

	if (!idem_store_lock(hash, false))
		return false;			/* someone is in its critical section */

	idem_store_probe(scope, key, IDEM_PROBE_LATEST, false, &row);
	if (row.found && !row.busy && !(row.mine && row.status == IDEM_PENDING))
	{
		idem_store_check_snapshot(&row);
		live_lease = row.status == IDEM_PENDING && row.has_token &&
			row.lease_until > now;

		if (row.expires_at <= now && !live_lease)
		{
			idem_store_delete(&row);
			(*expired)++;
		}
		else if (row.status == IDEM_PENDING && row.has_token && !live_lease)
		{
			idem_store_reset(&row);
			(*reset)++;
		}
		else
			idem_store_reschedule(&row, live_lease ? row.lease_until :
								  row.expires_at);
		idem_wait_touched(hash);
		done = true;
	}
	idem_store_unlock(hash);
	return done;
}

/* Candidate fetches per call: bounds one call's work and transaction. */
#define SWEEP_MAX_FETCHES	16

/*
 * Sweep at most "batch" keys of each kind (expired, reset) in the current
 * transaction, counting them into *expired and *reset.  Rows found before
 * their time (a key finished or extended after its claim) are rescheduled
 * on the way and do not count.  Returns true when more rows may be due.
 */
bool
idem_sweep_batch_run(int batch, int64 *expired, int64 *reset)
{
	TimestampTz now = GetCurrentTimestamp();
	int			limit = (int) Min((int64) batch * 2, (int64) PG_INT32_MAX);
	bool		more = false;

	*expired = 0;
	*reset = 0;

	idem_store_begin();
	for (int fetch = 0; fetch < SWEEP_MAX_FETCHES; fetch++)
	{
		text	  **scopes;
		text	  **keys;
		int			n;
		int			progress = 0;

		n = idem_store_sweep_candidates(now, limit, &scopes, &keys);
		for (int i = 0; i < n && *expired < batch && *reset < batch; i++)
		{
			if (sweep_one(scopes[i], keys[i], now, expired, reset))
				progress++;
		}
		more = (n == limit && progress > 0);
		if (!more || *expired >= batch || *reset >= batch)
			break;
	}
	idem_store_end();

	idem_stats_count(IDEM_STAT_EXPIRED, *expired);
	idem_stats_count(IDEM_STAT_RESET, *reset);
	return more || *expired >= batch || *reset >= batch;
}
