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
 * key an open transaction is claiming.  Must not commit (callers decide
 * the transaction boundaries) and must not loop over batches.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "utils/timestamp.h"

#include "idempotency.h"

/*
 * Sweep at most "batch" keys of each kind (expired, reset) in the current
 * transaction.  Counts what it did into *expired and *reset.
 */
void
idem_sweep_batch_run(int batch, int64 *expired, int64 *reset)
{
	TimestampTz now = GetCurrentTimestamp();
	text	  **scopes;
	text	  **keys;
	int			n;
	int64		limit = Min((int64) batch * 2, (int64) PG_INT32_MAX);

	*expired = 0;
	*reset = 0;

	idem_store_begin();
	n = idem_store_sweep_candidates(now, (int) limit, &scopes, &keys);
	for (int i = 0; i < n && (*expired < batch || *reset < batch); i++)
	{
		uint64		hash = idem_key_hash(scopes[i], keys[i]);
		IdemRow		row;
		bool		live_lease;

		if (!idem_store_lock(hash, false))
			continue;			/* someone is in its critical section */

		idem_store_probe(scopes[i], keys[i], IDEM_PROBE_LATEST, false, &row);
		if (row.found && !row.busy &&
			!(row.mine && row.status == IDEM_PENDING))
		{
			live_lease = row.status == IDEM_PENDING && row.has_token &&
				row.lease_until > now;

			if (row.expires_at <= now && !live_lease)
			{
				if (*expired < batch)
				{
					idem_store_check_snapshot(&row);
					idem_store_delete(&row);
					idem_wait_touched(hash);
					(*expired)++;
				}
			}
			else if (row.status == IDEM_PENDING && row.has_token &&
					 !live_lease)
			{
				if (*reset < batch)
				{
					idem_store_check_snapshot(&row);
					idem_store_reset(&row);
					idem_wait_touched(hash);
					(*reset)++;
				}
			}
		}
		idem_store_unlock(hash);
	}
	idem_store_end();

	idem_stats_count(IDEM_STAT_EXPIRED, *expired);
	idem_stats_count(IDEM_STAT_RESET, *reset);
}
