/*-------------------------------------------------------------------------
 *
 * idempotency.c
 *	  Module entry point of the idempotency extension.
 *
 * Owns _PG_init and the shared-memory hooks, and nothing else: each part
 * initialises itself through its *_init function.  Settings and the
 * transaction callbacks exist with or without preloading; shared memory
 * and the background worker only when the library is listed in
 * shared_preload_libraries.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "fmgr.h"
#include "miscadmin.h"
#include "storage/ipc.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"

#include "idempotency.h"

PG_MODULE_MAGIC;

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
