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
 * waiters poll instead (claim.c), and this file only keeps its bookkeeping.
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

#include "compat.h"
#include "idempotency.h"

/* Keys remembered per transaction before we fall back to "wake all". */
#define WAIT_TOUCHED_MAX	64

typedef struct WaitSlot
{
	pg_atomic_uint64 hash;		/* key waited for, 0 = not waiting */
	Oid			dbid;			/* written before hash is published */
} WaitSlot;

typedef struct WaitShared
{
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

/* Number of PGPROC entries, which is what a backend's proc number indexes. */
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

static void
wait_shmem_attach(void *mem, bool found)
{
	wait_shared = (WaitShared *) mem;
	if (!found)
	{
		pg_atomic_init_u32(&wait_shared->nwaiting, 0);
		wait_shared->nslots = wait_nslots();
		for (int i = 0; i < wait_shared->nslots; i++)
		{
			pg_atomic_init_u64(&wait_shared->slots[i].hash, 0);
			wait_shared->slots[i].dbid = InvalidOid;
		}
	}
}

const IdemShmemPart idem_wait_shmem = {
	"idempotency waiters", 0, wait_shmem_size, wait_shmem_attach
};

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
	if (MyProc == NULL || IDEM_MY_PROC_NUMBER >= wait_shared->nslots)
		return;
	slot = &wait_shared->slots[IDEM_MY_PROC_NUMBER];
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
	pg_atomic_write_u64(&wait_shared->slots[IDEM_MY_PROC_NUMBER].hash, 0);
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
		pg_atomic_write_u64(&wait_shared->slots[IDEM_MY_PROC_NUMBER].hash,
							reg->outer_hash);
	else
		wait_withdraw();
}

/*
 * The current transaction wrote the key "hash": remember it, so that the
 * key's waiters are woken when the transaction ends.
 */
void
idem_wait_remember(uint64 hash)
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
 * Wake every claim waiting in this database, whatever its key: a session
 * whose session-bound keys are reclaimable now ended (session.c), and it
 * does not keep the list of its keys.  Each waiter probes again; those not
 * concerned go back to sleep.
 */
void
idem_wait_wake_all(void)
{
	bool		saved = touched_overflow;

	touched_overflow = true;
	wait_wake();
	touched_overflow = saved;
}
