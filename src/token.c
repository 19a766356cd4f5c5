/*-------------------------------------------------------------------------
 *
 * token.c
 *	  The fencing token sequence: where every token and session binding
 *	  number comes from, and when it may leave the server.
 *
 * Owns the rule that no token reaches a client before the WAL record of
 * the sequence position that covers it is durable (flushed, and confirmed
 * by the synchronous standbys a commit would wait for), and the two ways
 * of keeping it:
 *
 * - With the library preloaded, tokens come from a block reserved ahead of
 *   need in shared memory, one per database and token sequence: every value
 *   below the block's limit is covered by a sequence position that is
 *   already durable, so drawing a token takes a spinlock and nothing else.
 *   When less than half a block remains, the first drawer that sees it
 *   moves the sequence a block further (setval, WAL-logged and never rolled
 *   back), makes that record durable and only then raises the limit, while
 *   the others keep drawing; a drawer that finds the block used up waits for
 *   that refill.  Every backend of a database draws from the same block, so
 *   tokens increase across all of them.  A block is never given to another
 *   database or sequence while its database exists, and once the table of
 *   blocks has been full, a database without one uses the other way for as
 *   long as the server runs.
 * - Otherwise (no preloading, or no block to be had), each token is a
 *   nextval, and the record that covers it, which another backend may have
 *   written and not flushed, is made durable before the token leaves: at
 *   once, or once when a batch returns its tokens.
 *
 * Across a restart the blocks are gone: the first drawer of a database
 * starts after the sequence's position, which is at or past the end of
 * every block handed out from, so tokens skip what remained of the last
 * block (at most two blocks of values) and never repeat.
 * Must not touch idempotency.keys.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "access/relation.h"
#include "access/xlog.h"
#include "catalog/pg_database.h"
#include "commands/sequence.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "replication/syncrep.h"
#include "replication/walsender.h"
#include "replication/walsender_private.h"
#include "storage/bufmgr.h"
#include "storage/condition_variable.h"
#include "storage/ipc.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "storage/spin.h"
#include "utils/fmgrprotos.h"
#include "utils/guc.h"
#include "utils/rel.h"
#include "utils/syscache.h"
#include "utils/wait_event.h"

#include "store.h"

/*
 * Values a refill reserves.  A refill starts when half a block remains, so
 * the refiller's flush (and standby round trip) overlaps the others'
 * drawing of that half; a restart skips at most two blocks of values.
 */
#define TOKEN_BLOCK				4096

/* Blocks in shared memory: one per database and token sequence. */
#define TOKEN_MAX_BLOCKS		1024

/*
 * One database's block.  Every value in [next, limit) is covered by a
 * sequence position that is durable; "refilling" says a backend is moving
 * the limit up (one at a time), and "cv" wakes the drawers that wait for
 * it.  An unused entry has dbid InvalidOid; a new one has next = limit = 0:
 * its first drawer refills it.
 */
typedef struct TokenBlock
{
	Oid			dbid;
	Oid			seqid;
	slock_t		mutex;			/* protects next, limit, refilling */
	int64		next;
	int64		limit;
	bool		refilling;
	ConditionVariable cv;
} TokenBlock;

typedef struct TokenShared
{
	slock_t		mutex;			/* protects dbid, seqid of every entry and
								 * full */
	bool		full;			/* a database went without: no more entries */
	TokenBlock	blocks[TOKEN_MAX_BLOCKS];
} TokenShared;

static TokenShared *token_shared = NULL;

/*
 * This backend's block, for the token sequence my_block_seq (NULL with
 * my_block_known: that sequence has none, its tokens come from nextval).
 */
static TokenBlock *my_block = NULL;
static Oid	my_block_seq = InvalidOid;
static bool my_block_known = false;

/* The block this backend is refilling, for the exit callback. */
static TokenBlock *refilling_block = NULL;
static bool exit_hook = false;

/*
 * While a batch hands out its tokens from nextval (idem_token_defer_flush
 * .. idem_token_flush), the WAL position its tokens need flushed.
 */
static bool token_flush_deferred = false;
static XLogRecPtr token_flush_lsn = InvalidXLogRecPtr;

static void
token_shmem_attach(void *mem, bool found)
{
	token_shared = (TokenShared *) mem;
	if (found)
		return;
	SpinLockInit(&token_shared->mutex);
	token_shared->full = false;
	for (int i = 0; i < TOKEN_MAX_BLOCKS; i++)
	{
		TokenBlock *b = &token_shared->blocks[i];

		b->dbid = InvalidOid;
		b->seqid = InvalidOid;
		SpinLockInit(&b->mutex);
		b->next = 0;
		b->limit = 0;
		b->refilling = false;
		ConditionVariableInit(&b->cv);
	}
}

const IdemShmemPart idem_token_shmem = {
	"idempotency token blocks", sizeof(TokenShared), NULL, token_shmem_attach
};

/* How many values a refill reserves (tests make it tiny). */
static int64
token_block_size(void)
{
#ifdef IDEM_TEST_PAUSES
	if (idem_test_token_block > 0)
		return idem_test_token_block;
#endif
	return TOKEN_BLOCK;
}

/*
 * Give back the entries of databases that no longer exist: nobody can draw
 * from them any more.  Only while the table is not full, so a database
 * that went without a block never gets one later.
 */
static void
token_forget_dropped(void)
{
	Oid			dbids[TOKEN_MAX_BLOCKS];
	bool		full;

	SpinLockAcquire(&token_shared->mutex);
	full = token_shared->full;
	for (int i = 0; i < TOKEN_MAX_BLOCKS; i++)
		dbids[i] = token_shared->blocks[i].dbid;
	SpinLockRelease(&token_shared->mutex);
	if (full)
		return;
	for (int i = 0; i < TOKEN_MAX_BLOCKS; i++)
	{
		TokenBlock *b = &token_shared->blocks[i];

		if (!OidIsValid(dbids[i]) ||
			SearchSysCacheExists1(DATABASEOID, ObjectIdGetDatum(dbids[i])))
			continue;
		SpinLockAcquire(&token_shared->mutex);
		if (b->dbid == dbids[i] && !token_shared->full)
		{
			b->dbid = InvalidOid;
			b->seqid = InvalidOid;
		}
		SpinLockRelease(&token_shared->mutex);
	}
}

/*
 * Find this database's block for "seqid", or take a free entry for it
 * unless the table was full once; NULL if neither.
 */
static TokenBlock *
token_find_block(Oid seqid)
{
	TokenBlock *found = NULL;

	SpinLockAcquire(&token_shared->mutex);
	for (int i = 0; i < TOKEN_MAX_BLOCKS && found == NULL; i++)
	{
		TokenBlock *b = &token_shared->blocks[i];

		if (b->dbid == MyDatabaseId && b->seqid == seqid)
			found = b;
	}
	for (int i = 0; i < TOKEN_MAX_BLOCKS && found == NULL &&
		 !token_shared->full; i++)
	{
		TokenBlock *b = &token_shared->blocks[i];

		if (b->dbid == InvalidOid)
		{
			/* nobody draws from a free entry: no need for its mutex */
			b->next = 0;
			b->limit = 0;
			b->refilling = false;
			b->dbid = MyDatabaseId;
			b->seqid = seqid;
			found = b;
		}
	}
	SpinLockRelease(&token_shared->mutex);
	return found;
}

/*
 * The block of this database's token sequence "seqid", found (or taken)
 * once per backend and sequence; NULL when tokens come from nextval.
 */
static TokenBlock *
token_block(Oid seqid)
{
	if (my_block_known && my_block_seq == seqid)
		return my_block;
	my_block = NULL;
	my_block_known = false;
	if (token_shared != NULL && OidIsValid(MyDatabaseId))
	{
		my_block = token_find_block(seqid);
		if (my_block == NULL)
		{
			token_forget_dropped();
			my_block = token_find_block(seqid);
		}
		if (my_block == NULL)
		{
			bool		was_full;

			SpinLockAcquire(&token_shared->mutex);
			was_full = token_shared->full;
			token_shared->full = true;
			SpinLockRelease(&token_shared->mutex);

			/*
			 * An entry given back before "full" was set may have been taken
			 * by another backend of this database since this one looked.
			 */
			my_block = token_find_block(seqid);
			if (!was_full)
				ereport(LOG,
						(errmsg("idempotency: all %d token blocks are taken",
								TOKEN_MAX_BLOCKS),
						 errdetail("Databases without one, and extensions created from now on, draw each token from the sequence and flush it until the server restarts.")));
		}
	}
	my_block_seq = seqid;
	my_block_known = true;
	return my_block;
}

/*
 * The position of sequence "seqrel": the last value it handed out (one
 * below its start when none was), as nextval left it on its page.
 */
static int64
token_sequence_position(Relation seqrel)
{
	Buffer		buf = ReadBuffer(seqrel, 0);
	Page		page;
	HeapTupleHeader tuple;
	Form_pg_sequence_data seq;
	int64		position;

	LockBuffer(buf, BUFFER_LOCK_SHARE);
	page = BufferGetPage(buf);
	tuple = (HeapTupleHeader) PageGetItem(page, PageGetItemId(page, FirstOffsetNumber));
	seq = (Form_pg_sequence_data) ((char *) tuple + tuple->t_hoff);
	position = seq->is_called ? seq->last_value : seq->last_value - 1;
	UnlockReleaseBuffer(buf);
	return position;
}

/*
 * The WAL position up to which the token sequence's values are durable:
 * the LSN of its page.  A sequence logs its position ahead (every 32
 * values, and at the first nextval after a checkpoint; at every setval) and
 * sets the page's LSN to that record; the values handed out until the next
 * such record, by any backend, are covered by it.
 */
static XLogRecPtr
token_sequence_lsn(Oid seqid)
{
	Relation	seqrel = relation_open(seqid, AccessShareLock);
	Buffer		buf = ReadBuffer(seqrel, 0);
	XLogRecPtr	lsn;

	/* nextval sets the LSN under the exclusive content lock */
	LockBuffer(buf, BUFFER_LOCK_SHARE);
	lsn = PageGetLSN(BufferGetPage(buf));
	UnlockReleaseBuffer(buf);
	relation_close(seqrel, NoLock);
	return lsn;
}

/*
 * Has every synchronous standby that a commit would wait for confirmed
 * the WAL up to "lsn" (or is there none to wait for)?  The same test as
 * SyncRepWaitForLSN's.  Since the minor releases of May 2025 the shared
 * state has a flag saying whether the checkpointer has set it up yet;
 * until then, the setting decides.  Which layout the running server has is
 * told by its version, not by the headers this library was built with.
 */
static bool
token_on_standbys(XLogRecPtr lsn)
{
	static int	server_version = 0;
	bool		done;
	int			mode;
	uint8		status;
	bool		has_init_flag;

	if (!SyncRepRequested())
		return true;
	if (server_version == 0)
		server_version = atoi(GetConfigOption("server_version_num", false, false));
	has_init_flag = server_version >= 170005 ||
		(server_version >= 160009 && server_version < 170000) ||
		(server_version >= 150013 && server_version < 160000);
	/* what SyncRepWaitForLSN waits for outside a commit */
	mode = synchronous_commit == SYNCHRONOUS_COMMIT_REMOTE_WRITE ?
		SYNC_REP_WAIT_WRITE : SYNC_REP_WAIT_FLUSH;
	LWLockAcquire(SyncRepLock, LW_SHARED);
	status = IDEM_SYNC_STANDBYS_FIELD(WalSndCtl);
	if (!has_init_flag)
		done = status == 0 || lsn <= WalSndCtl->lsn[mode];
	else if (status & IDEM_SYNC_STANDBY_INIT)
		done = (status & IDEM_SYNC_STANDBY_DEFINED) == 0 ||
			lsn <= WalSndCtl->lsn[mode];
	else
		done = lsn <= WalSndCtl->lsn[mode] ||
			SyncRepStandbyNames == NULL || SyncRepStandbyNames[0] == '\0';
	LWLockRelease(SyncRepLock);
	return done;
}

/*
 * Make the sequence record at "lsn" as durable as a commit would be before
 * a token it covers leaves the server: flushed here, and confirmed by the
 * synchronous standbys a commit waits for, so that a standby promoted
 * after a failover never hands the token out again.  Both return at once
 * when that is so already.  A cancel during the standby wait ends the wait
 * with PostgreSQL's warning; the token then does not leave (57014).
 */
static void
token_make_durable(XLogRecPtr lsn)
{
	XLogFlush(lsn);
	if (token_on_standbys(lsn))
		return;
	HOLD_INTERRUPTS();
	SyncRepWaitForLSN(lsn, false);
	RESUME_INTERRUPTS();
	CHECK_FOR_INTERRUPTS();
	if (!token_on_standbys(lsn))
		ereport(ERROR,
				(errcode(ERRCODE_QUERY_CANCELED),
				 errmsg("canceling the wait for the synchronous standby to confirm a fencing token"),
				 errdetail("The standby had not confirmed the token's sequence record yet; no token was handed out.")));
}

/* A refill that a backend's exit cut short must not leave others waiting. */
static void
token_exit(int code, Datum arg)
{
	TokenBlock *b = refilling_block;

	if (b == NULL)
		return;
	refilling_block = NULL;
	SpinLockAcquire(&b->mutex);
	b->refilling = false;
	SpinLockRelease(&b->mutex);
	ConditionVariableBroadcast(&b->cv);
}

/*
 * Reserve the next block of "b" (its "refilling" is set, by this backend):
 * move the sequence a block past both its position and the block's limit,
 * make that record durable, then raise the limit.  An administrator's
 * setval that moved the sequence past the limit is honoured: drawing goes
 * on above it.  One that moved it back is not: tokens only ever increase
 * (and the setval here moves the sequence forward again).  On any error
 * (a cancel while a standby has not confirmed) the limit stays where it
 * was, so nothing that is not durable is handed out, and the next drawer
 * that needs a refill does it.
 */
static void
token_refill(TokenBlock *b)
{
	Oid			saved_userid;
	int			saved_sec_context;
	volatile bool switched = false;
	volatile bool done = false;

	if (!exit_hook)
	{
		before_shmem_exit(token_exit, (Datum) 0);
		exit_hook = true;
	}
	refilling_block = b;
	GetUserIdAndSecContext(&saved_userid, &saved_sec_context);
	PG_TRY();
	{
		Relation	seqrel = relation_open(b->seqid, AccessShareLock);
		int64		position = token_sequence_position(seqrel);
		int64		limit;
		int64		target;

		SpinLockAcquire(&b->mutex);
		limit = b->limit;
		SpinLockRelease(&b->mutex);
		target = Max(position, limit - 1) + token_block_size();

		/*
		 * As the sequence's owner: the caller needs no privilege on it, and
		 * nothing can run with the caller's rights in between.
		 */
		SetUserIdAndSecContext(seqrel->rd_rel->relowner,
							   saved_sec_context | SECURITY_LOCAL_USERID_CHANGE |
							   SECURITY_RESTRICTED_OPERATION);
		switched = true;
		(void) DirectFunctionCall2(setval_oid, ObjectIdGetDatum(b->seqid),
								   Int64GetDatum(target));
		SetUserIdAndSecContext(saved_userid, saved_sec_context);
		switched = false;
		relation_close(seqrel, NoLock);

		IDEM_PAUSE("token-refill");
		token_make_durable(token_sequence_lsn(b->seqid));

		SpinLockAcquire(&b->mutex);
		/* past an administrator's setval forward, not past our own */
		if (position > limit - 1)
			b->next = Max(b->next, position + 1);
		b->limit = target + 1;
		b->refilling = false;
		SpinLockRelease(&b->mutex);
		done = true;
	}
	PG_FINALLY();
	{
		if (switched)
			SetUserIdAndSecContext(saved_userid, saved_sec_context);
		if (!done)
		{
			SpinLockAcquire(&b->mutex);
			b->refilling = false;
			SpinLockRelease(&b->mutex);
		}
		refilling_block = NULL;
		ConditionVariableBroadcast(&b->cv);
	}
	PG_END_TRY();
}

/*
 * Draw the next token of block "b".  A drawer that leaves less than half a
 * block refills it ahead of need, after taking its own token; one that
 * finds it used up (or not yet filled: the first draw of the database
 * since the server started) refills it, or waits while another backend
 * does.
 */
static int64
token_draw(TokenBlock *b)
{
	int64		block = token_block_size();

	for (;;)
	{
		bool		have = false;
		bool		refill = false;
		int64		token = 0;

		SpinLockAcquire(&b->mutex);
		if (b->next < b->limit)
		{
			token = b->next++;
			have = true;
		}
		if (!b->refilling && (b->limit - b->next) * 2 < block)
			b->refilling = refill = true;
		SpinLockRelease(&b->mutex);

		if (refill)
			token_refill(b);
		if (have)
		{
			ConditionVariableCancelSleep();
			return token;
		}
		if (!refill)
			ConditionVariableSleep(&b->cv, PG_WAIT_EXTENSION);
	}
}

/*
 * The next fencing token: larger than every token issued before, even
 * across a crash or a failover to a synchronous standby.  From the
 * database's block when there is one.  Otherwise from nextval: the
 * sequence record that covers the value may have been written by another
 * backend and not be flushed yet (flushing is left to commit), so a token
 * of a transaction that never commits, or of one cut short by a crash,
 * could be issued again after the crash, and the caller may already have
 * passed it to a downstream system: the record is made durable
 * (token_make_durable) before the token leaves the server, now, or, in a
 * batch, once when the batch returns its tokens.
 */
int64
idem_token_next(void)
{
	Oid			seqid = idem_catalog()->token_seq;
	TokenBlock *b = token_block(seqid);
	int64		token;
	XLogRecPtr	lsn;

	if (b != NULL)
		return token_draw(b);
	token = nextval_internal(seqid, false);
	lsn = token_sequence_lsn(seqid);
	if (token_flush_deferred)
		token_flush_lsn = Max(token_flush_lsn, lsn);
	else
		token_make_durable(lsn);
	return token;
}

/*
 * The token of a claim that writes over "old" (NULL: a new key): the next
 * one, and on a distributed table also above the key's current token (a
 * shard may have moved here from a node whose sequence was ahead).  A
 * Citus node draws from its own block like any server: the block only
 * changes when the sequence's values are made durable, not which ones
 * idem_citus_claim_token starts from.
 */
int64
idem_token_claim(const IdemRow *old)
{
	int64		token = idem_token_next();

	if (idem_catalog()->shardid != 0)
		token = idem_citus_claim_token(token, old != NULL && old->has_token ?
									   old->token : 0);
	return token;
}

/*
 * A batch of claims begins: the tokens it draws reach the client only when
 * it returns, so the WAL of those from nextval is flushed once then
 * (idem_token_flush) instead of every 32 tokens (a block's are durable
 * already).  "outer" keeps the state of a batch this one runs inside (a
 * trigger on the table that calls idem_claim_many), which idem_token_flush
 * restores; it must follow, also on error (with flush false: no token
 * leaves).
 */
void
idem_token_defer_flush(IdemTokenBatch *outer)
{
	outer->deferred = token_flush_deferred;
	outer->lsn = token_flush_lsn;
	token_flush_deferred = true;
	token_flush_lsn = InvalidXLogRecPtr;
}

/*
 * The batch's tokens are about to leave: make durable what they need (if
 * "flush"), and go back to the state of the batch around it, if any.
 */
void
idem_token_flush(const IdemTokenBatch *outer, bool flush)
{
	XLogRecPtr	lsn = token_flush_lsn;

	token_flush_deferred = outer->deferred;
	token_flush_lsn = outer->lsn;
	if (flush && lsn != InvalidXLogRecPtr)
		token_make_durable(lsn);
}
