/*-------------------------------------------------------------------------
 *
 * pause.c
 *	  Pause points for isolation tests; compiled only into test builds.
 *
 * Owns the setting idempotency.test_pause and idem_pause().  Some races
 * happen between two instructions of one C function (a probe that reads
 * an index page, then the heap), where no SQL step of another session can
 * get in.  A test build marks such places with IDEM_PAUSE("name"); a
 * session that set idempotency.test_pause = 'name' stops there until no
 * other session holds pg_advisory_lock(IDEM_PAUSE_LOCK).  The wait is a
 * heavyweight lock wait, so isolationtester sees the session as blocked
 * and the spec decides when it goes on.  Release builds define
 * IDEM_PAUSE as nothing, so none of this exists there.  Must not change
 * what the paused code does: a pause only waits.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "miscadmin.h"
#include "storage/lock.h"
#include "utils/guc.h"

#include "idempotency.h"

static char *pause_at = NULL;

/* Define idempotency.test_pause (before the prefix is reserved). */
void
idem_pause_init(void)
{
	DefineCustomStringVariable("idempotency.test_pause",
							   "Pause point this session stops at (test builds only).",
							   NULL,
							   &pause_at,
							   "",
							   PGC_SUSET,
							   GUC_NOT_IN_SAMPLE | GUC_NO_SHOW_ALL,
							   NULL, NULL, NULL);
}

/*
 * Wait at pause point "point" if this session asked to, until the advisory
 * lock IDEM_PAUSE_LOCK is free: take it shared, as
 * pg_advisory_xact_lock_shared(IDEM_PAUSE_LOCK) would, and let it go.
 */
void
idem_pause(const char *point)
{
	LOCKTAG		tag;

	if (pause_at == NULL || strcmp(pause_at, point) != 0)
		return;
	SET_LOCKTAG_ADVISORY(tag, MyDatabaseId, 0, IDEM_PAUSE_LOCK, 1);
	(void) LockAcquire(&tag, ShareLock, false, false);
	LockRelease(&tag, ShareLock, false);
}
