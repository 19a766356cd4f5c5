/*-------------------------------------------------------------------------
 *
 * keylock.c
 *	  What serialises the writers of one key.
 *
 * Owns the per-key lock, a transaction-level advisory lock on the key's
 * 64-bit hash that every write of a key holds, and the write counters: one
 * shared counter per slice of the hash space, moved by every write of a key
 * (insert, update or delete) after the row version and its index entries
 * are in place and before the key's lock is released, so that a claim can
 * tell that no key of its slice was written between its lock-free probe and
 * taking the lock (idem_key_write_count).  The counters live in shared
 * memory, so they exist only when the library is preloaded.
 * Must not decide outcomes or touch the table.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "miscadmin.h"
#include "port/atomics.h"
#include "storage/lock.h"
#include "storage/shmem.h"

#include "idempotency.h"

/*
 * The fourth field of our advisory lock tags.  pg_advisory_lock() uses 1
 * and 2; a private value keeps our per-key locks apart from the
 * application's own advisory lock numbers.
 */
#define KEYLOCK_TAG_FIELD4		0x1de7

/*
 * Write counters: keys share one when hash % N is equal.  A shared counter
 * only costs a claim its second probe when another key of the slice was
 * written in between, so 4096 (32 kB) makes that rare at any write rate a
 * server sustains.
 */
#define KEYLOCK_WRITE_COUNTERS	4096

typedef struct KeylockShared
{
	pg_atomic_uint64 writes[KEYLOCK_WRITE_COUNTERS];
} KeylockShared;

static KeylockShared *keylock_shared = NULL;

static void
keylock_shmem_attach(void *mem, bool found)
{
	keylock_shared = (KeylockShared *) mem;
	if (!found)
		for (int i = 0; i < KEYLOCK_WRITE_COUNTERS; i++)
			pg_atomic_init_u64(&keylock_shared->writes[i], 0);
}

const IdemShmemPart idem_key_shmem = {
	"idempotency write counters", sizeof(KeylockShared), NULL, keylock_shmem_attach
};

/* Fill the advisory lock tag of a key hash. */
static void
keylock_tag(LOCKTAG *tag, uint64 hash)
{
	SET_LOCKTAG_ADVISORY(*tag, MyDatabaseId, (uint32) (hash >> 32),
						 (uint32) hash, KEYLOCK_TAG_FIELD4);
}

/*
 * Take the key's lock, transaction-level so that an ERROR inside the
 * critical section releases it with the (sub)transaction.  Returns false
 * when "wait" is false and another backend holds it.  Critical sections
 * never wait on anything, so a waiting acquire is short.
 */
bool
idem_key_lock(uint64 hash, bool wait)
{
	LOCKTAG		tag;

	keylock_tag(&tag, hash);
	return LockAcquire(&tag, ExclusiveLock, false, !wait) !=
		LOCKACQUIRE_NOT_AVAIL;
}

/*
 * Release the key's lock at the end of the critical section, so nothing is
 * held per key until commit (a batch of 10,000 claims must not fill the
 * lock table).
 */
void
idem_key_unlock(uint64 hash)
{
	LOCKTAG		tag;

	keylock_tag(&tag, hash);
	LockRelease(&tag, ExclusiveLock, false);
}

/*
 * The current transaction wrote the key "hash" (inserted, updated or
 * deleted its row), under the key's lock, which it still holds: move the
 * key's write counter, and have the key's waiters woken when the
 * transaction ends.
 */
void
idem_key_wrote(uint64 hash)
{
	if (keylock_shared != NULL)
	{
		/* a full barrier: the row version is in place before the count moves */
		pg_atomic_fetch_add_u64(&keylock_shared->writes[hash % KEYLOCK_WRITE_COUNTERS], 1);
	}
	idem_wait_remember(hash);
}

/*
 * Read the write counter of the key "hash" into *count; false without
 * preloading (no counters).  A claim whose lock-free probe found the key
 * absent (no row, and none being changed) uses it to skip its second probe
 * under the key's lock.  That probe is an index scan with a dirty snapshot,
 * which can miss a row only when the row is written while it runs: a new
 * row, or the new version of an updated row whose old version it then
 * finds dead (an update that is not HOT enters the new version into the
 * index, possibly where the scan has already looked).  The extension
 * writes a key only under its lock and counts the write before releasing
 * it.  So a claim that reads the same count before its probe and again
 * once it holds the key's lock knows that nothing the probe could have
 * missed was written in between: a write counted after the first read
 * moved the counter before releasing the lock the claim then acquired, and
 * one counted before it was complete before the probe began.  (A row
 * written by plain SQL, outside the extension, is not counted: the claim's
 * own insert may then fail on the primary key.)
 */
bool
idem_key_write_count(uint64 hash, uint64 *count)
{
	if (keylock_shared == NULL)
		return false;
	*count = pg_atomic_read_u64(&keylock_shared->writes[hash % KEYLOCK_WRITE_COUNTERS]);

	/*
	 * The probe that follows reads the index after this load (it also takes
	 * buffer locks, full barriers, first); a read barrier states that and
	 * costs nothing on x86.  The read under the key's lock comes after
	 * acquiring that lock, which orders it after the increment of whoever
	 * released it.
	 */
	pg_read_barrier();
	return true;
}
