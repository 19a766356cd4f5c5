/*-------------------------------------------------------------------------
 *
 * session.c
 *	  Session-bound claims: a pending key tied to the session that claimed it.
 *
 * Owns this session's binding (a number drawn from the token sequence at
 * its first session-bound claim, stored in each such key's owner_session,
 * and a session-level advisory lock on that number that the session holds
 * until it ends), the test of whether another session's binding is still
 * alive (its lock is held), and what a session with a binding does when it
 * ends: let the lock go, wake the waiting claims of its database, and tell
 * the sweeper that bindings ended.  One lock per session whatever the
 * number of keys, so a batch never fills the lock table; a backend killed
 * outright takes its locks with it (the server restarts), so a dead owner
 * is seen at once in every case.  A claim that is not session-bound never
 * comes here.  Must not decide outcomes or touch the table.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "miscadmin.h"
#include "port/atomics.h"
#include "storage/ipc.h"
#include "storage/lock.h"
#include "storage/shmem.h"

#include "compat.h"
#include "idempotency.h"

/*
 * The fourth field of the binding locks' tags: apart from the application's
 * advisory locks (1 and 2) and from the per-key locks (keylock.c).
 */
#define SESSION_TAG_FIELD4		0x1de8

/* This session's binding; 0 before its first session-bound claim. */
static int64 my_session = 0;
static bool exit_hook = false;

/* How many sessions with a binding ended since the server started. */
typedef struct SessionShared
{
	pg_atomic_uint64 ended;
} SessionShared;

static SessionShared *session_shared = NULL;

/*
 * The count starts at 1, not 0, so that the sweeper's first run after a
 * start (the sessions of before a crash are all gone) looks for orphaned
 * keys.
 */
static void
session_shmem_attach(void *mem, bool found)
{
	session_shared = (SessionShared *) mem;
	if (!found)
		pg_atomic_init_u64(&session_shared->ended, 1);
}

const IdemShmemPart idem_session_shmem = {
	"idempotency sessions", sizeof(SessionShared), NULL, session_shmem_attach
};

static void
session_tag(LOCKTAG *tag, int64 session)
{
	SET_LOCKTAG_ADVISORY(*tag, MyDatabaseId, (uint32) ((uint64) session >> 32),
						 (uint32) session, SESSION_TAG_FIELD4);
}

/*
 * When a session with a binding ends (a client that disconnects or dies, a
 * terminated backend), let its lock go first, then wake the claims waiting
 * in its database, which probe again and find its keys reclaimable.  The
 * lock would go anyway a little later, after the waiters had looked.
 */
static void
session_exit(int code, Datum arg)
{
	LOCKTAG		tag;

	if (my_session == 0)
		return;
	/* a clean state, as core's own exit callbacks that touch locks make */
	AbortOutOfAnyTransaction();
	session_tag(&tag, my_session);
	if (idem_lock_held_by_me(&tag, ExclusiveLock))
		LockRelease(&tag, ExclusiveLock, true);
	my_session = 0;
	if (session_shared != NULL)
		pg_atomic_fetch_add_u64(&session_shared->ended, 1);
	idem_wait_wake_all();
}

/*
 * This session's binding, taken at the first call: a number no session of
 * this database ever had (the token sequence's next value) and the session
 * lock on it.  pg_advisory_unlock_all() and DISCARD ALL release that lock
 * like any advisory lock: the keys bound so far are then reclaimable, and
 * the next call takes a new binding.
 */
int64
idem_session_bind(void)
{
	LOCKTAG		tag;

	if (my_session != 0)
	{
		session_tag(&tag, my_session);
		if (idem_lock_held_by_me(&tag, ExclusiveLock))
			return my_session;
	}
	my_session = idem_token_next();
	session_tag(&tag, my_session);
	if (LockAcquire(&tag, ExclusiveLock, true, true) == LOCKACQUIRE_NOT_AVAIL)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("this session's binding is held by another session"),
				 errdetail("The token sequence idempotency.token_seq handed out " INT64_FORMAT " again: it was set back.",
						   my_session),
				 errhint("Set idempotency.token_seq above every token stored in idempotency.keys with setval().")));
	if (!exit_hook)
	{
		before_shmem_exit(session_exit, (Datum) 0);
		exit_hook = true;
	}
	return my_session;
}

/*
 * Is the session with binding "session" still alive?  Its lock is held
 * exclusively while it lives; a share lock taken without waiting tells.
 * Share locks do not conflict with each other, so any number of backends
 * may ask at once without one seeing another's question as the owner.
 */
bool
idem_session_alive(int64 session)
{
	LOCKTAG		tag;

	session_tag(&tag, session);
	if (session == my_session)
		return idem_lock_held_by_me(&tag, ExclusiveLock);
	if (LockAcquire(&tag, ShareLock, false, true) == LOCKACQUIRE_NOT_AVAIL)
		return true;
	LockRelease(&tag, ShareLock, false);
	return false;
}

/*
 * How many sessions with a binding ended since the server started (at
 * least 1); 0 without preloading, where nothing counts and callers look
 * for orphaned keys every time.
 */
uint64
idem_session_ends(void)
{
	if (session_shared == NULL)
		return 0;
	return pg_atomic_read_u64(&session_shared->ended);
}
