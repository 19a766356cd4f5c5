/*-------------------------------------------------------------------------
 *
 * wait.c
 *	  Waiting for an in-flight attempt to settle.
 *
 * Owns the shared-memory waiter slots (one per PGPROC) and the wake-up:
 * a backend that waits in idem_claim(wait => ...) publishes the hash of
 * the key it waits for; every transaction remembers the keys it wrote and,
 * at commit or abort (and at the abort of a subtransaction), sets the latch
 * of each backend waiting for one of them in this database.  The waiter
 * then probes again.  Without shared_preload_libraries there are no slots:
 * waiters poll instead (api.c), and this file only keeps its bookkeeping.
 * Also owns the insert counters: one shared counter per slice of the key
 * hash space, moved by every insert of a key (store.c), after the row is in
 * place and before the key's lock is released, so that a claim can tell
 * that no key of its slice was inserted between its lock-free probe and
 * taking the lock (idem_wait_insert_count).
 * Must not decide outcomes or touch the table.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/twophase.h"
#include "access/xact.h"
#include "miscadmin.h"
#include "port/atomics.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/proc.h"
#include "storage/shmem.h"

#include "idempotency.h"

/* Keys remembered per transaction before we fall back to "wake all". */
#define WAIT_TOUCHED_MAX	64

/* Insert counters: a power of two; keys share one when hash % N is equal. */
#define WAIT_INSERT_COUNTERS	4096

typedef struct WaitSlot
{
	pg_atomic_uint64 hash;		/* key waited for, 0 = not waiting */
	Oid			dbid;			/* written before hash is published */
} WaitSlot;

typedef struct WaitShared
{
	pg_atomic_uint64 inserts[WAIT_INSERT_COUNTERS]; /* inserts per hash slice */
	pg_atomic_uint32 nwaiting;	/* slots with a non-zero hash */
	int			nslots;
	WaitSlot	slots[FLEXIBLE_ARRAY_MEMBER];
} WaitShared;

static WaitShared *wait_shared = NULL;

/* Keys this transaction wrote (claims, finishes, releases, sweeps...). */
static uint64 touched[WAIT_TOUCHED_MAX];
static int	ntouched = 0;
static bool touched_overflow = false;

/* Whether this backend's slot is published. */
static bool registered = false;

static void wait_withdraw(void);

/* Number of PGPROC entries, which is what a pgprocno indexes. */
static int
wait_nslots(void)
{
	return MaxBackends + NUM_AUXILIARY_PROCS + max_prepared_xacts;
}

static Size
wait_shmem_size(void)
{
	return add_size(offsetof(WaitShared, slots),
					mul_size(sizeof(WaitSlot), wait_nslots()));
}

/* Reserve our shared memory (called from the shmem request hook). */
void
idem_wait_shmem_request(void)
{
	RequestAddinShmemSpace(wait_shmem_size());
}

/* Create or attach our shared memory (called with AddinShmemInitLock). */
void
idem_wait_shmem_startup(void)
{
	bool		found;

	wait_shared = ShmemInitStruct("idempotency waiters", wait_shmem_size(),
								  &found);
	if (!found)
	{
		pg_atomic_init_u32(&wait_shared->nwaiting, 0);
		for (int i = 0; i < WAIT_INSERT_COUNTERS; i++)
			pg_atomic_init_u64(&wait_shared->inserts[i], 0);
		wait_shared->nslots = wait_nslots();
		for (int i = 0; i < wait_shared->nslots; i++)
		{
			pg_atomic_init_u64(&wait_shared->slots[i].hash, 0);
			wait_shared->slots[i].dbid = InvalidOid;
		}
	}
}

/*
 * Set the latch of every backend of this database waiting for a key this
 * transaction wrote.  Called after the commit or abort is visible to
 * others, so a woken waiter's next probe sees the settled state.
 */
static void
wait_wake(void)
{
	if (wait_shared == NULL || (ntouched == 0 && !touched_overflow))
		return;
	pg_memory_barrier();
	if (pg_atomic_read_u32(&wait_shared->nwaiting) == 0)
		return;
	for (int i = 0; i < wait_shared->nslots; i++)
	{
		uint64		h = pg_atomic_read_u64(&wait_shared->slots[i].hash);
		bool		match = touched_overflow;

		if (h == 0)
			continue;
		pg_read_barrier();
		if (wait_shared->slots[i].dbid != MyDatabaseId)
			continue;
		for (int j = 0; j < ntouched && !match; j++)
			match = (touched[j] == h);
		if (match)
			SetLatch(&GetPGProcByNumber(i)->procLatch);
	}
}

/* Wake waiters when a transaction ends; then forget its keys. */
static void
wait_xact_callback(XactEvent event, void *arg)
{
	switch (event)
	{
		case XACT_EVENT_COMMIT:
		case XACT_EVENT_PARALLEL_COMMIT:
		case XACT_EVENT_ABORT:
		case XACT_EVENT_PARALLEL_ABORT:
		case XACT_EVENT_PREPARE:
			wait_wake();
			ntouched = 0;
			touched_overflow = false;
			break;
		default:
			break;
	}
}

/*
 * A rolled-back savepoint may have held claims: wake their waiters now.
 * The keys stay remembered for the top-level end (harmless extra wake-up).
 */
static void
wait_subxact_callback(SubXactEvent event, SubTransactionId mySubid,
					  SubTransactionId parentSubid, void *arg)
{
	if (event == SUBXACT_EVENT_ABORT_SUB)
		wait_wake();
}

/* Clear our slot if the backend exits while published (FATAL, die). */
static void
wait_before_shmem_exit(int code, Datum arg)
{
	wait_withdraw();
}

/* Register the transaction callbacks (with or without preloading). */
void
idem_wait_init(void)
{
	RegisterXactCallback(wait_xact_callback, NULL);
	RegisterSubXactCallback(wait_subxact_callback, NULL);
}

/*
 * Publish that this backend waits for the key "hash".  The caller probes
 * again after this (and after each ResetLatch), so a settle that happens
 * between its probe and its sleep is never missed.  A waiting claim made
 * inside another one's write (a trigger on the table that calls idem_claim
 * with wait) publishes its own key for the time of its wait: *reg, on the
 * caller's stack, keeps the outer key for idem_wait_unregister to put back.
 */
void
idem_wait_register(uint64 hash, IdemWaitRegistration *reg)
{
	static bool exit_hook = false;
	WaitSlot   *slot;

	reg->published = false;
	reg->nested = false;
	reg->outer_hash = 0;
	if (wait_shared == NULL)
		return;
	if (!exit_hook)
	{
		before_shmem_exit(wait_before_shmem_exit, (Datum) 0);
		exit_hook = true;
	}
	if (MyProc == NULL || MyProc->pgprocno >= wait_shared->nslots)
		return;
	slot = &wait_shared->slots[MyProc->pgprocno];
	reg->nested = registered;
	if (reg->nested)
		reg->outer_hash = pg_atomic_read_u64(&slot->hash);
	else
	{
		slot->dbid = MyDatabaseId;
		pg_write_barrier();
	}
	pg_atomic_write_u64(&slot->hash, hash);
	if (!reg->nested)
	{
		pg_atomic_fetch_add_u32(&wait_shared->nwaiting, 1);
		registered = true;
	}
	reg->published = true;
	pg_memory_barrier();
}

/* Withdraw this backend's slot; safe to call when not published. */
static void
wait_withdraw(void)
{
	if (!registered)
		return;
	pg_atomic_write_u64(&wait_shared->slots[MyProc->pgprocno].hash, 0);
	pg_atomic_fetch_sub_u32(&wait_shared->nwaiting, 1);
	registered = false;
}

/*
 * End the wait published by idem_wait_register(..., reg): withdraw the
 * slot, or hand it back to the outer waiting claim's key.
 */
void
idem_wait_unregister(const IdemWaitRegistration *reg)
{
	if (!reg->published || !registered)
		return;
	if (reg->nested)
		pg_atomic_write_u64(&wait_shared->slots[MyProc->pgprocno].hash,
							reg->outer_hash);
	else
		wait_withdraw();
}

/* Remember that this transaction wrote the key "hash". */
void
idem_wait_touched(uint64 hash)
{
	if (wait_shared == NULL || touched_overflow)
		return;
	for (int i = 0; i < ntouched; i++)
		if (touched[i] == hash)
			return;
	if (ntouched < WAIT_TOUCHED_MAX)
		touched[ntouched++] = hash;
	else
		touched_overflow = true;
}

/*
 * Count an insert of the key "hash".  The store calls this for every row it
 * inserts, after the row and its index entries are in place and while the
 * key's lock is held.
 */
void
idem_wait_count_insert(uint64 hash)
{
	if (wait_shared == NULL)
		return;
	/* a full barrier: the row is in place before the count moves */
	pg_atomic_fetch_add_u64(&wait_shared->inserts[hash % WAIT_INSERT_COUNTERS], 1);
}

/*
 * Read the insert counter of the key "hash" into *count; false without
 * preloading (no counters).  Only an insert turns an absent key into a
 * present one, and the extension inserts a key only under its lock.  So a
 * claim whose lock-free probe found the key absent (no row, and none being
 * changed), and that reads the same count before that probe and again once
 * it holds the key's lock, knows that nothing the probe missed was inserted
 * in between: an insert counted after the first read moved the counter
 * before releasing the lock the claim then acquired, and one counted
 * before it was in place before the probe began.  (A row inserted by
 * plain SQL, outside the extension, is not counted: the claim's own insert
 * then fails on the primary key, as it could before.)
 */
bool
idem_wait_insert_count(uint64 hash, uint64 *count)
{
	if (wait_shared == NULL)
		return false;
	*count = pg_atomic_read_u64(&wait_shared->inserts[hash % WAIT_INSERT_COUNTERS]);
	/*
	 * The probe that follows reads the index after this load (it also takes
	 * buffer locks, full barriers, first); a read barrier states that and
	 * costs nothing on x86, where a full barrier was 0.4% of a replay.  The
	 * read under the key's lock comes after acquiring that lock, which
	 * orders it after the increment of whoever released it.
	 */
	pg_read_barrier();
	return true;
}
