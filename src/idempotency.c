/*-------------------------------------------------------------------------
 *
 * idempotency.c
 *	  Module entry point of the idempotency extension.
 *
 * Owns _PG_init, the shared-memory hooks and idem_version(), and nothing
 * else: each part initialises itself through its *_init function.
 * Settings and the transaction callbacks exist with or without preloading;
 * shared memory and the background worker only when the library is listed
 * in shared_preload_libraries.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "fmgr.h"
#include "miscadmin.h"
#include "storage/ipc.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "utils/builtins.h"

#include "idempotency.h"

IDEM_MODULE_MAGIC;

PG_FUNCTION_INFO_V1(idem_version);

static shmem_request_hook_type prev_shmem_request_hook = NULL;
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;

void		_PG_init(void);

/* Ask for the shared memory of every part. */
static void
idem_shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	idem_wait_shmem_request();
	idem_key_shmem_request();
	idem_stats_shmem_request();
	idem_worker_shmem_request();
	idem_session_shmem_request();
	idem_citus_shmem_request();
}

/* Create or attach the shared memory of every part. */
static void
idem_shmem_startup(void)
{
	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();
	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	idem_wait_shmem_startup();
	idem_key_shmem_startup();
	idem_stats_shmem_startup();
	idem_worker_shmem_startup();
	idem_session_shmem_startup();
	idem_citus_shmem_startup();
	LWLockRelease(AddinShmemInitLock);
}

void
_PG_init(void)
{
	idem_guc_init();
	idem_wait_init();

	if (!process_shared_preload_libraries_in_progress)
		return;

	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = idem_shmem_request;
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = idem_shmem_startup;

	idem_worker_init();
}

/*
 * idem_version(): the version of the library this backend loaded.  It comes
 * from the library, not from the catalog, so that after installing a new
 * build it shows which code runs, whatever version ALTER EXTENSION left the
 * SQL objects at (pg_extension.extversion tells that).
 */
Datum
idem_version(PG_FUNCTION_ARGS)
{
	PG_RETURN_TEXT_P(cstring_to_text(IDEM_VERSION));
}
