/*-------------------------------------------------------------------------
 *
 * module.c
 *	  Module entry point of the idempotency extension.
 *
 * Owns _PG_init, the shared-memory registry (every part's shared memory,
 * requested and created by one pair of hooks) and idem_version(), and
 * nothing else: each part initialises itself through its *_init function
 * and describes its shared memory with an IdemShmemPart.
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

/*
 * The parts that keep state in shared memory.  Each is sized, created and
 * attached here, in this order, so no part repeats the hooks.
 */
static const IdemShmemPart *const shmem_parts[] = {
	&idem_wait_shmem,
	&idem_key_shmem,
	&idem_stats_shmem,
	&idem_worker_shmem,
	&idem_session_shmem,
	&idem_token_shmem,
	&idem_citus_shmem,
};

static Size
shmem_part_size(const IdemShmemPart *part)
{
	return part->size_fn != NULL ? part->size_fn() : part->size;
}

/* Ask for the shared memory of every part. */
static void
idem_shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	for (int i = 0; i < lengthof(shmem_parts); i++)
		RequestAddinShmemSpace(shmem_part_size(shmem_parts[i]));
}

/* Create or attach the shared memory of every part. */
static void
idem_shmem_startup(void)
{
	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();
	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	for (int i = 0; i < lengthof(shmem_parts); i++)
	{
		const IdemShmemPart *part = shmem_parts[i];
		bool		found;
		void	   *mem = ShmemInitStruct(part->name, shmem_part_size(part),
										  &found);

		part->attach(mem, found);
	}
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
