/*-------------------------------------------------------------------------
 *
 * worker.c
 *	  The background sweeper: a launcher and one short-lived worker per
 *	  database visit.
 *
 * Owns the two background workers and their shared report slot.
 *
 * The launcher (one static worker, registered only when the library is
 * preloaded) is connected to no database.  Once per idempotency.sweep_interval
 * it lists the databases that allow connections and are not templates, and
 * visits them one at a time: it starts a dynamic "sweeper" worker connected
 * to that database and waits for it to exit.  So the extension costs one
 * worker slot (two during a visit) however many databases there are, picks
 * up new databases at the next round, and never sits in template1 (CREATE
 * DATABASE would fail).
 *
 * A sweeper checks that the extension is installed (a committed CREATE
 * EXTENSION; one being created right now is not visible yet), then runs
 * sweep batches of idempotency.sweep_batch keys, one transaction each,
 * until a batch is not full or its time slice ends (visits stay short, so
 * DROP DATABASE never waits long for it).  It reports to the launcher
 * through shared memory: done, more work, no extension, or the error that
 * stopped it.  A failure is logged once per database and cause: the
 * sweeper logs the whole error (SQLSTATE, detail, hint, context) when the
 * launcher tells it that the cause is new, and the launcher adds one line
 * and backs off that database; one database can never stop it.  Must not
 * decide which keys to sweep (sweep.c does).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "access/xlog.h"
#include "catalog/pg_database.h"
#include "commands/dbcommands.h"
#include "commands/extension.h"
#include "common/hashfn.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "postmaster/bgworker.h"
#include "postmaster/interrupt.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/lwlock.h"
#include "storage/proc.h"
#include "storage/shmem.h"
#include "storage/spin.h"
#include "tcop/tcopprot.h"
#include "utils/guc.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"

#include "idempotency.h"

/* How long one visit may sweep before it yields to the next round. */
#define VISIT_SLICE_MS			1000
/* Candidate fetches per batch transaction: keeps each one short. */
#define SWEEPER_MAX_FETCHES		16
/* Pause between rounds while some database still has work. */
#define MORE_WORK_PAUSE_MS		100
/*
 * Back-off of a database whose sweep keeps failing: the interval (at least
 * BACKOFF_FLOOR_MS, so that a tiny interval still backs off), doubled per
 * failure up to BACKOFF_MAX_DOUBLINGS times, and never above MAX_BACKOFF_MS.
 */
#define BACKOFF_FLOOR_MS		1000
#define BACKOFF_MAX_DOUBLINGS	12
#define MAX_BACKOFF_MS			(60 * 60 * 1000)
/* Room for the first line of a sweeper's error in its report. */
#define REPORT_MESSAGE_LEN		256
/* The cause of a sweeper that exited without reporting (a FATAL, logged). */
#define SWEEPER_VANISHED_CAUSE	1
/* Databases the launcher remembers failures of. */
#define MAX_TRACKED_DBS			1024
/* How often the launcher looks at its settings while sweeping is off. */
#define IDLE_CHECK_MS			(60 * 1000)

typedef enum VisitResult
{
	VISIT_NONE = 0,				/* the sweeper exited without reporting */
	VISIT_DONE,					/* swept everything due */
	VISIT_MORE,					/* its time slice ended with work left */
	VISIT_NO_EXTENSION,			/* the extension is not installed there */
	VISIT_FAILED				/* an error stopped it; see message */
} VisitResult;

/*
 * Report of the current visit, written by the sweeper, read by the launcher.
 * "visit" numbers the launcher's visits; a sweeper reports only while the
 * slot still belongs to its own visit, so that a sweeper that outlived its
 * launcher (one terminated while the sweeper waited for a lock) cannot
 * overwrite the report of a later visit.
 */
typedef struct WorkerShared
{
	slock_t		mutex;
	uint64		visit;
	Oid			dbid;
	VisitResult result;
	uint32		cause;			/* of a failure: see sweeper_cause() */
	char		message[REPORT_MESSAGE_LEN];
	uint64		sessions_seen;	/* the sweeper's SweeperArgs.sessions_seen,
								 * moved on */
} WorkerShared;

/* What the launcher tells a sweeper, in its bgw_extra. */
typedef struct SweeperArgs
{
	uint64		visit;			/* the launcher's visit number */
	uint32		last_cause;		/* cause of this database's last failure, or 0 */
	uint64		sessions_seen;	/* ended session bindings already seen to */
} SweeperArgs;

static WorkerShared *worker_shared = NULL;

/* What the launcher remembers about a database's failures. */
typedef struct DbTrack
{
	Oid			dbid;
	int			failures;
	TimestampTz next_try;
	bool		warned_no_slot; /* "no worker slot" logged since last visit */
	uint32		last_cause;		/* of the last failure, 0 when none */
	uint64		sessions_seen;	/* see SESSIONS_NEVER_SEEN */
} DbTrack;

/*
 * A database's count of ended session bindings that its sweepers have seen
 * to, before any did: its first visit (after a start of the launcher, also
 * after a server restart, which loses every session) looks for the keys of
 * ended sessions whatever the count says.
 */
#define SESSIONS_NEVER_SEEN		PG_UINT64_MAX

/*
 * The count of ended session bindings this database's sweepers have seen
 * to: from the launcher when the sweeper starts, back to it in the report.
 * A visit scans for the keys of ended sessions only when it moved.
 */
static uint64 sessions_seen = SESSIONS_NEVER_SEEN;

static DbTrack tracked[MAX_TRACKED_DBS];
static int	ntracked = 0;

PGDLLEXPORT void idem_launcher_main(Datum arg);
PGDLLEXPORT void idem_sweeper_main(Datum arg);

/* ---------------------------------------------------------------------
 * Registration and shared memory
 * ---------------------------------------------------------------------
 */

/* Register the launcher (only while shared_preload_libraries loads us). */
void
idem_worker_init(void)
{
	BackgroundWorker worker;

	memset(&worker, 0, sizeof(worker));
	worker.bgw_flags = BGWORKER_SHMEM_ACCESS |
		BGWORKER_BACKEND_DATABASE_CONNECTION;
	worker.bgw_start_time = BgWorkerStart_RecoveryFinished;
	worker.bgw_restart_time = 10;
	snprintf(worker.bgw_library_name, BGW_MAXLEN, "idempotency");
	snprintf(worker.bgw_function_name, BGW_MAXLEN, "idem_launcher_main");
	snprintf(worker.bgw_name, BGW_MAXLEN, "idempotency launcher");
	snprintf(worker.bgw_type, BGW_MAXLEN, "idempotency launcher");
	RegisterBackgroundWorker(&worker);
}

/* The report slot a sweeper fills for the launcher. */
static void
worker_shmem_attach(void *mem, bool found)
{
	worker_shared = (WorkerShared *) mem;
	if (!found)
	{
		SpinLockInit(&worker_shared->mutex);
		worker_shared->visit = 0;
		worker_shared->dbid = InvalidOid;
		worker_shared->result = VISIT_NONE;
		worker_shared->message[0] = '\0';
	}
}

const IdemShmemPart idem_worker_shmem = {
	"idempotency worker", sizeof(WorkerShared), NULL, worker_shmem_attach
};

/* What the launcher told this sweeper (from its bgw_extra). */
static SweeperArgs
worker_my_args(void)
{
	SweeperArgs args;

	memcpy(&args, MyBgworkerEntry->bgw_extra, sizeof(args));
	return args;
}

/*
 * The sweeper's report on its visit, unless a later visit owns the slot.
 * "cause" and "message" describe a failure.
 */
static void
worker_report(VisitResult result, uint32 cause, const char *message)
{
	uint64		visit = worker_my_args().visit;

	SpinLockAcquire(&worker_shared->mutex);
	if (worker_shared->visit == visit)
	{
		worker_shared->dbid = MyDatabaseId;
		worker_shared->result = result;
		worker_shared->cause = cause;
		strlcpy(worker_shared->message, message ? message : "",
				sizeof(worker_shared->message));
		worker_shared->sessions_seen = sessions_seen;
	}
	SpinLockRelease(&worker_shared->mutex);
}

/* ---------------------------------------------------------------------
 * The per-database sweeper
 * ---------------------------------------------------------------------
 */

/*
 * Is the extension installed in this database?  Only a committed CREATE
 * EXTENSION is visible to our catalog snapshot, so a database in which it
 * is being created right now is left alone until the next round.
 */
static bool
sweeper_extension_installed(void)
{
	return OidIsValid(get_extension_oid("idempotency", true));
}

/*
 * Run one sweep batch in a transaction of its own, in worker_spi's order.
 * Returns false when the extension is not installed; sets *more when more
 * keys may be due.
 */
static bool
sweeper_batch(int batch, int64 *expired, int64 *reset, bool *more)
{
	bool		installed;

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	PushActiveSnapshot(GetTransactionSnapshot());
	pgstat_report_activity(STATE_RUNNING, "idempotency sweep");

	installed = sweeper_extension_installed();
	if (installed)
	{
		/*
		 * A database made read-only (default_transaction_read_only set for
		 * it, or for every database) is not swept: deleting and resetting
		 * keys is a write its users are refused too.  The direct write path
		 * would not notice, so the check is made here, as every client
		 * function makes it; the failure is logged once and the database is
		 * swept again once it is writable.
		 */
		if (XactReadOnly)
			ereport(ERROR,
					(errcode(ERRCODE_READ_ONLY_SQL_TRANSACTION),
					 errmsg("cannot sweep a database whose transactions are read-only"),
					 errdetail("default_transaction_read_only is on for this database."),
					 errhint("Keys past their retention stay until it is off; the worker then sweeps them.")));
		*more = idem_sweep_batch_run(batch, SWEEPER_MAX_FETCHES,
									 &sessions_seen, expired, reset);
	}

	PopActiveSnapshot();
	CommitTransactionCommand();
	pgstat_report_stat(false);
	pgstat_report_activity(STATE_IDLE, NULL);
	return installed;
}

/* Shared with the launcher, defined with it below. */
static bool database_visitable(Oid dbid);

/*
 * A failure's cause, as a number that is the same for the same SQLSTATE and
 * message, and never 0 (no failure) or SWEEPER_VANISHED_CAUSE: the launcher
 * logs a failure again only when its cause changes.
 */
static uint32
sweeper_cause(const ErrorData *edata)
{
	const char *message = edata->message ? edata->message : "";
	uint32		cause = hash_bytes((const unsigned char *) message,
								   strlen(message)) ^
		(uint32) edata->sqlerrcode;

	return cause <= SWEEPER_VANISHED_CAUSE ? cause + SWEEPER_VANISHED_CAUSE + 1 : cause;
}

/*
 * Error context of a sweep: names the database in the log.  The name is
 * looked up before the sweep, since a failed transaction cannot read the
 * catalogs.
 */
static void
sweeper_error_context(void *arg)
{
	errcontext("idempotency sweeper in database \"%s\"", (const char *) arg);
}

/*
 * Main of a sweeper: sweep the database given as argument, batch after
 * batch, for at most one time slice, then report and exit.  An error ends
 * the visit: it is logged in full (as a WARNING: the worker carries on)
 * when its cause is new for this database, and reported to the launcher,
 * which backs the database off; so a database that keeps failing the same
 * way does not flood the log.
 */
void
idem_sweeper_main(Datum arg)
{
	Oid			dbid = DatumGetObjectId(arg);
	TimestampTz start;
	volatile int64 expired = 0;
	volatile int64 reset = 0;
	MemoryContext cxt = CurrentMemoryContext;
	ErrorContextCallback errcallback;
	char	   *dbname;

	pqsignal(SIGHUP, SignalHandlerForConfigReload);
	pqsignal(SIGTERM, die);
	BackgroundWorkerUnblockSignals();

	/*
	 * The launcher only starts sweepers for databases that allow connections.
	 * One that stopped allowing them (or became a template) since the
	 * launcher looked would make the connection FATAL: connect anyway, see
	 * that, and leave at once without sweeping or reporting (the launcher
	 * then finds the database not visitable, which is no failure).  CREATE or
	 * DROP DATABASE waits out such a brief visitor.
	 */
	BackgroundWorkerInitializeConnectionByOid(dbid, InvalidOid,
											  BGWORKER_BYPASS_ALLOWCONN);
	if (!database_visitable(dbid))
		proc_exit(0);
	sessions_seen = worker_my_args().sessions_seen;
	StartTransactionCommand();
	dbname = get_database_name(dbid);
	dbname = dbname ? MemoryContextStrdup(cxt, dbname) : NULL;
	CommitTransactionCommand();
	if (dbname == NULL)
		proc_exit(0);			/* dropped since the check: nothing to do */

	/*
	 * A sweep lost in a crash is simply done again by the next one (a key
	 * past its retention already behaves as absent), and any claim that acts
	 * on a sweep's result flushes it with its own commit: the batches need
	 * not wait for their WAL flush.
	 */
	SetConfigOption("synchronous_commit", "off", PGC_SUSET, PGC_S_OVERRIDE);

	/*
	 * Each batch reads the newest rows and skips what changed since; a
	 * cluster-wide default of REPEATABLE READ or SERIALIZABLE would instead
	 * fail batches on rows changed after their snapshot.  Autovacuum does the
	 * same.
	 */
	SetConfigOption("default_transaction_isolation", "read committed",
					PGC_SUSET, PGC_S_OVERRIDE);

	start = GetCurrentTimestamp();
	PG_TRY();
	{
		VisitResult result = VISIT_DONE;

		errcallback.callback = sweeper_error_context;
		errcallback.arg = dbname;
		errcallback.previous = error_context_stack;
		error_context_stack = &errcallback;
		for (;;)
		{
			int64		e = 0;
			int64		r = 0;
			bool		more = false;
			int			batch = idem_sweep_batch;

			CHECK_FOR_INTERRUPTS();
			if (RecoveryInProgress())
				break;
			if (!sweeper_batch(batch, &e, &r, &more))
			{
				result = VISIT_NO_EXTENSION;
				break;
			}
			expired += e;
			reset += r;
			if (!more)
				break;
			if (TimestampDifferenceExceeds(start, GetCurrentTimestamp(),
										   VISIT_SLICE_MS))
			{
				result = VISIT_MORE;
				break;
			}
		}
		error_context_stack = errcallback.previous;
		if (result != VISIT_NO_EXTENSION)
			idem_stats_sweep_done(GetCurrentTimestamp(),
								  (double) (GetCurrentTimestamp() - start) / 1000.0);
		worker_report(result, 0, NULL);
	}
	PG_CATCH();
	{
		ErrorData  *edata;
		uint32		cause;

		MemoryContextSwitchTo(cxt);
		edata = CopyErrorData();
		FlushErrorState();
		AbortCurrentTransaction();
		cause = sweeper_cause(edata);

		/* A DROP EXTENSION that raced with the sweep is no failure. */
		StartTransactionCommand();
		if (sweeper_extension_installed())
		{
			if (cause != worker_my_args().last_cause)
			{
				edata->elevel = WARNING;
				ThrowErrorData(edata);
			}
			IDEM_PAUSE("sweeper-report-failure");
			worker_report(VISIT_FAILED, cause, edata->message);
		}
		else
			worker_report(VISIT_NO_EXTENSION, 0, NULL);
		CommitTransactionCommand();
	}
	PG_END_TRY();

	if (expired > 0 || reset > 0)
		elog(DEBUG1, "idempotency sweep: " INT64_FORMAT " expired, "
			 INT64_FORMAT " reset", expired, reset);
	proc_exit(0);
}

/* ---------------------------------------------------------------------
 * The launcher
 * ---------------------------------------------------------------------
 */

typedef struct DbEntry
{
	Oid			oid;
	char		name[NAMEDATALEN];
} DbEntry;

/*
 * Is a database worth visiting: connections allowed, not a template (a
 * sweeper sitting in template1 would make CREATE DATABASE fail), not
 * half-dropped (DATCONNLIMIT_INVALID_DB, -2)?
 */
static bool
database_form_visitable(Form_pg_database db)
{
	return db->datallowconn && !db->datistemplate && db->datconnlimit != -2;
}

/* The databases worth visiting, read from the shared catalog pg_database. */
static List *
launcher_databases(void)
{
	List	   *dbs = NIL;
	Relation	rel;
	TableScanDesc scan;
	HeapTuple	tup;
	MemoryContext outer = CurrentMemoryContext;

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	(void) GetTransactionSnapshot();

	rel = table_open(DatabaseRelationId, AccessShareLock);
	scan = table_beginscan_catalog(rel, 0, NULL);
	while (HeapTupleIsValid(tup = heap_getnext(scan, ForwardScanDirection)))
	{
		Form_pg_database db = (Form_pg_database) GETSTRUCT(tup);
		DbEntry    *entry;
		MemoryContext old;

		if (!database_form_visitable(db))
			continue;
		old = MemoryContextSwitchTo(outer);
		entry = palloc(sizeof(DbEntry));
		entry->oid = db->oid;
		strlcpy(entry->name, NameStr(db->datname), NAMEDATALEN);
		dbs = lappend(dbs, entry);
		MemoryContextSwitchTo(old);
	}
	table_endscan(scan);
	table_close(rel, AccessShareLock);
	CommitTransactionCommand();
	return dbs;
}

/*
 * Does the database still exist and accept connections?  A database can be
 * dropped between the launcher's listing and its visit.
 */
static bool
database_visitable(Oid dbid)
{
	HeapTuple	tup;
	bool		ok = false;

	StartTransactionCommand();
	tup = SearchSysCache1(DATABASEOID, ObjectIdGetDatum(dbid));
	if (HeapTupleIsValid(tup))
	{
		Form_pg_database db = (Form_pg_database) GETSTRUCT(tup);

		ok = database_form_visitable(db);
		ReleaseSysCache(tup);
	}
	CommitTransactionCommand();
	return ok;
}

/* The launcher's memory of a database, created on first use. */
static DbTrack *
launcher_track(Oid dbid)
{
	for (int i = 0; i < ntracked; i++)
		if (tracked[i].dbid == dbid)
			return &tracked[i];
	if (ntracked == MAX_TRACKED_DBS)
		ntracked = 0;			/* forget everything rather than fail */
	memset(&tracked[ntracked], 0, sizeof(DbTrack));
	tracked[ntracked].sessions_seen = SESSIONS_NEVER_SEEN;
	tracked[ntracked].dbid = dbid;
	return &tracked[ntracked++];
}

/*
 * Visit one database: start a sweeper there and wait until it exits.
 * Returns true when that database still has work due.
 */
static bool
launcher_visit(DbEntry *db)
{
	BackgroundWorker worker;
	BackgroundWorkerHandle *handle;
	BgwHandleStatus status;
	pid_t		pid;
	DbTrack    *track = launcher_track(db->oid);
	VisitResult result;
	char		message[REPORT_MESSAGE_LEN];
	uint32		cause;
	SweeperArgs args;
	TimestampTz now = GetCurrentTimestamp();

	if (track->next_try > now)
		return false;			/* backing off after failures */
	if (!database_visitable(db->oid))
		return false;			/* dropped since the listing */

	memset(&worker, 0, sizeof(worker));
	worker.bgw_flags = BGWORKER_SHMEM_ACCESS |
		BGWORKER_BACKEND_DATABASE_CONNECTION;
	worker.bgw_start_time = BgWorkerStart_RecoveryFinished;
	worker.bgw_restart_time = BGW_NEVER_RESTART;
	snprintf(worker.bgw_library_name, BGW_MAXLEN, "idempotency");
	snprintf(worker.bgw_function_name, BGW_MAXLEN, "idem_sweeper_main");
	snprintf(worker.bgw_name, BGW_MAXLEN, "idempotency sweeper");
	snprintf(worker.bgw_type, BGW_MAXLEN, "idempotency sweeper");
	worker.bgw_main_arg = ObjectIdGetDatum(db->oid);
	worker.bgw_notify_pid = MyProcPid;

	SpinLockAcquire(&worker_shared->mutex);
	args.visit = ++worker_shared->visit;
	worker_shared->dbid = db->oid;
	worker_shared->result = VISIT_NONE;
	worker_shared->cause = 0;
	worker_shared->message[0] = '\0';
	worker_shared->sessions_seen = track->sessions_seen;
	SpinLockRelease(&worker_shared->mutex);
	args.last_cause = track->last_cause;
	args.sessions_seen = track->sessions_seen;
	StaticAssertStmt(sizeof(SweeperArgs) <= BGW_EXTRALEN,
					 "SweeperArgs must fit in bgw_extra");
	memcpy(worker.bgw_extra, &args, sizeof(args));

	if (!RegisterDynamicBackgroundWorker(&worker, &handle))
	{
		if (!track->warned_no_slot)
			ereport(LOG,
					(errmsg("idempotency launcher could not start a sweeper for database \"%s\"",
							db->name),
					 errhint("Raise max_worker_processes.")));
		track->warned_no_slot = true;
		return false;
	}
	status = WaitForBackgroundWorkerStartup(handle, &pid);
	if (status == BGWH_STARTED)
		status = WaitForBackgroundWorkerShutdown(handle);
	if (status == BGWH_POSTMASTER_DIED)
		proc_exit(1);
	pfree(handle);
	track->warned_no_slot = false;

	SpinLockAcquire(&worker_shared->mutex);
	result = worker_shared->result;
	cause = worker_shared->cause;
	strlcpy(message, worker_shared->message, sizeof(message));
	if (result == VISIT_DONE || result == VISIT_MORE)
		track->sessions_seen = worker_shared->sessions_seen;
	SpinLockRelease(&worker_shared->mutex);

	if ((result == VISIT_NONE || result == VISIT_FAILED) &&
		!database_visitable(db->oid))
		return false;			/* dropped during the visit: no failure */
	if (result == VISIT_NONE || result == VISIT_FAILED)
	{
		int64		backoff;

		if (result == VISIT_NONE)
		{
			strlcpy(message, "the sweeper exited without reporting",
					sizeof(message));
			cause = SWEEPER_VANISHED_CAUSE;
		}
		if (cause != track->last_cause)
			ereport(LOG,
					(errmsg("idempotency sweep of database \"%s\" failed: %s",
							db->name, message),
					 errdetail("The launcher retries later; this message is not repeated while the cause stays the same.")));
		track->last_cause = cause;
		track->failures = Min(track->failures + 1, BACKOFF_MAX_DOUBLINGS);
		backoff = Min((int64) Max(idem_sweep_interval_ms, BACKOFF_FLOOR_MS) <<
					  track->failures, (int64) MAX_BACKOFF_MS);
		track->next_try = TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
													  backoff);
		return false;
	}
	if (track->failures > 0)
		ereport(LOG,
				(errmsg("idempotency sweep of database \"%s\" works again",
						db->name)));
	track->failures = 0;
	track->next_try = 0;
	track->last_cause = 0;
	return result == VISIT_MORE;
}

/*
 * Main of the launcher: a round over every database once per
 * idempotency.sweep_interval; nothing while sweep_interval is 0 or the
 * server is in recovery.
 */
void
idem_launcher_main(Datum arg)
{
	MemoryContext round_cxt;

	pqsignal(SIGHUP, SignalHandlerForConfigReload);
	pqsignal(SIGTERM, die);
	BackgroundWorkerUnblockSignals();
	BackgroundWorkerInitializeConnection(NULL, NULL, 0);

	round_cxt = AllocSetContextCreate(TopMemoryContext,
									  "idempotency launcher round",
									  ALLOCSET_DEFAULT_SIZES);
	for (;;)
	{
		long		nap_ms = IDLE_CHECK_MS;

		CHECK_FOR_INTERRUPTS();
		if (ConfigReloadPending)
		{
			ConfigReloadPending = false;
			ProcessConfigFile(PGC_SIGHUP);
		}

		if (idem_sweep_interval_ms > 0 && !RecoveryInProgress())
		{
			TimestampTz start = GetCurrentTimestamp();
			bool		more = false;
			List	   *dbs;
			ListCell   *lc;
			MemoryContext old = MemoryContextSwitchTo(round_cxt);

			dbs = launcher_databases();
			foreach(lc, dbs)
			{
				CHECK_FOR_INTERRUPTS();
				if (launcher_visit((DbEntry *) lfirst(lc)))
					more = true;
			}
			MemoryContextSwitchTo(old);
			MemoryContextReset(round_cxt);

			if (more)
				nap_ms = MORE_WORK_PAUSE_MS;
			else
			{
				long		elapsed = (long) ((GetCurrentTimestamp() - start) / 1000);

				nap_ms = Max(idem_sweep_interval_ms - elapsed, 1);
			}
		}

		(void) WaitLatch(MyLatch,
						 WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 nap_ms, PG_WAIT_EXTENSION);
		ResetLatch(MyLatch);
	}
}
