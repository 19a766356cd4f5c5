/*-------------------------------------------------------------------------
 *
 * guc.c
 *	  The idempotency.* settings.
 *
 * Owns the definition, defaults, units and contexts of every setting.
 * Settings are defined whether or not the library is preloaded, so that
 * SET and SHOW work in any session that has called a function once.
 * Must not read the settings on behalf of callers: each part reads the
 * variable it needs.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <limits.h>

#include "utils/guc.h"
#include "utils/memutils.h"

#include "idempotency.h"

int			idem_lease_ms = 30 * 1000;
int			idem_retention_s = 24 * 60 * 60;
int			idem_remember_s = 0;
int			idem_sweep_batch = 1000;
int			idem_max_response_size = 1024 * 1024;
int			idem_sweep_interval_ms = 60 * 1000;
int			idem_stats_exact_limit = 1024;	/* blocks: 8 MB */
#ifdef IDEM_TEST_PAUSES
int			idem_test_token_block = 0;
#endif

/*
 * Define the settings.  Units follow the values users think in: a lease in
 * milliseconds (tests and heartbeats use sub-second leases), retention in
 * seconds, the response limit in bytes.
 */
void
idem_guc_init(void)
{
	DefineCustomIntVariable("idempotency.lease",
							"Default lease of a claim.",
							"A pending attempt whose lease has ended may be "
							"taken over by the next matching claim.",
							&idem_lease_ms,
							30 * 1000, 1, INT_MAX,
							PGC_USERSET, GUC_UNIT_MS,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.retention",
							"Default time a key is kept after its claim or finish.",
							NULL,
							&idem_retention_s,
							24 * 60 * 60, 1, INT_MAX,
							PGC_USERSET, GUC_UNIT_S,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.remember",
							"Default time a finished key is remembered after its retention.",
							"A claim of a remembered key answers expired instead of "
							"running again; 0 turns remembering off.",
							&idem_remember_s,
							0, 0, INT_MAX,
							PGC_USERSET, GUC_UNIT_S,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.sweep_batch",
							"Keys of each kind handled by one sweep batch.",
							"Small batches keep each sweep transaction short.",
							&idem_sweep_batch,
							1000, 1, 1000000,
							PGC_SIGHUP, 0,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.max_response_size",
							"Largest response_body idem_finish stores.",
							"Measured in bytes of the jsonb value before compression.",
							&idem_max_response_size,
							1024 * 1024, 0, MaxAllocSize / 2,
							PGC_SUSET, GUC_UNIT_BYTE,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.sweep_interval",
							"Time between two sweeps of the background worker.",
							"0 turns the background sweeper off.",
							&idem_sweep_interval_ms,
							60 * 1000, 0, INT_MAX,
							PGC_SIGHUP, GUC_UNIT_MS,
							NULL, NULL, NULL);

	/*
	 * Superuser-only: a monitoring role polls the stats view, and must not be
	 * able to turn every poll into a scan of a large table.
	 */
	DefineCustomIntVariable("idempotency.stats_exact_limit",
							"Largest keys table whose key counts the stats view counts exactly.",
							"Above this size the counts are estimated from the "
							"planner's statistics; -1 always counts exactly.",
							&idem_stats_exact_limit,
							1024, -1, INT_MAX,
							PGC_SUSET, GUC_UNIT_BLOCKS,
							NULL, NULL, NULL);

#ifdef IDEM_TEST_PAUSES
	idem_pause_init();

	/*
	 * Test builds only: how many tokens a refill of a token block reserves
	 * (0: the built-in size), so that tests can use blocks up and refill them
	 * within a few claims.  Every backend that refills uses its own value:
	 * tests set it for the server.
	 */
	DefineCustomIntVariable("idempotency.test_token_block",
							"Tokens a token block refill reserves (test builds only).",
							NULL,
							&idem_test_token_block,
							0, 0, INT_MAX,
							PGC_SUSET, GUC_NOT_IN_SAMPLE | GUC_NO_SHOW_ALL,
							NULL, NULL, NULL);
#endif
	MarkGUCPrefixReserved("idempotency");
}
